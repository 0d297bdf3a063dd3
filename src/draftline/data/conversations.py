"""Read conversations in OpenAI ``messages`` form or ShareGPT form (JSON list or JSONL).

Malformed records are reported with their line (or index) and skipped; an empty result is an error.
"""

from __future__ import annotations

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


def load_conversations(path: Path | str) -> Conversations:
    """Load and normalise every conversation in ``path``; raise :class:`DataError` if none is usable."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"conversations file {path} does not exist: pass --conversations a JSONL or JSON file")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    records: list[tuple[int, object]] = []
    skipped: list[tuple[int, str]] = []
    if stripped.startswith("["):
        try:
            records = list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON ({e}); use a JSON list or one JSON object per line") from None
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                skipped.append((lineno, f"invalid JSON: {e.msg}"))
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
        detail = "; ".join(f"line {n}: {why}" for n, why in skipped[:5])
        raise DataError(f"no usable conversation in {path}" + (f" ({detail})" if detail else ""))
    return Conversations(samples=samples, skipped=skipped)
