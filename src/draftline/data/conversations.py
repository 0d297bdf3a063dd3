"""Read conversations in OpenAI ``messages`` form or ShareGPT form: a JSON list, JSONL, or a Hugging Face
``datasets`` directory written by ``save_to_disk`` (its ``train`` split, or its only one).

Malformed records are reported with their line (or index) and skipped; an empty result is an error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from draftline.errors import DataError

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
_ROLES = {"system", "user", "assistant"}


@dataclass
class Conversations:
    samples: list[dict]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line or index, reason)


def _normalise(record: object) -> dict:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError("'messages' is not a list")
        out = []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a role in system|user|assistant and a string content")
            out.append({"role": m["role"], "content": m["content"]})
    elif "conversations" in record:
        out = []
        for m in record["conversations"] or []:
            role = _SHAREGPT_ROLES.get(str(m.get("from", "")).lower()) if isinstance(m, dict) else None
            if role is None or not isinstance(m.get("value"), str):
                raise ValueError("each ShareGPT turn needs from in human|gpt|system and a string value")
            out.append({"role": role, "content": m["value"]})
    else:
        raise ValueError("neither 'messages' (OpenAI form) nor 'conversations' (ShareGPT form)")
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn (nothing to learn from)")
    return {"id": str(record.get("id", "")), "messages": out}


def _records_from_dataset(path: Path) -> list[tuple[int, object]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path} is a directory but not a Hugging Face dataset saved with save_to_disk ({e}); "
                        "pass a JSONL/JSON file or such a directory") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds)) if len(ds) == 1 else None
        if split is None:
            raise DataError(f"dataset {path} has splits {sorted(ds)} and none is called train: save the split "
                            "to use on its own")
        ds = ds[split]
    return [(i, row) for i, row in enumerate(ds, start=1)]


def _records_from_json(path: Path) -> tuple[list[tuple[int, object]], list[tuple[int, str]]]:
    text = path.read_text(encoding="utf-8")
    records: list[tuple[int, object]] = []
    skipped: list[tuple[int, str]] = []
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), start=1)), skipped
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON ({e}); use a JSON list or one JSON object per line") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            skipped.append((lineno, f"invalid JSON: {e.msg}"))
    return records, skipped


def source_digest(path: Path | str) -> str:
    """sha256 of the input: the file's bytes, or every file of a dataset directory (names and bytes)."""
    from draftline.util import file_sha256

    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def load_conversations(path: Path | str) -> Conversations:
    """Load and normalise every conversation in ``path``; raise :class:`DataError` if none is usable."""
    path = Path(path)
    if path.is_dir():
        records, skipped = _records_from_dataset(path), []
    elif path.is_file():
        records, skipped = _records_from_json(path)
    else:
        raise DataError(f"conversations {path} does not exist: pass --conversations a JSONL or JSON file or a "
                        "Hugging Face dataset directory (save_to_disk)")
    samples = []
    for where, rec in records:
        try:
            s = _normalise(rec)
        except ValueError as e:
            skipped.append((where, str(e)))
            continue
        s["id"] = s["id"] or f"{path.stem}-{where}"
        samples.append(s)
    if not samples:
        unit = "row" if path.is_dir() else "line"
        detail = "; ".join(f"{unit} {n}: {why}" for n, why in skipped[:5])
        raise DataError(f"no usable conversation in {path}" + (f" ({detail})" if detail else ""))
    return Conversations(samples=samples, skipped=skipped)
