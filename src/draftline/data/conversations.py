"""Read conversations or prompts: a JSON list, JSONL, or a Hugging Face ``datasets`` directory written by
``save_to_disk`` (its ``train`` split, or its only one).

Record forms: OpenAI ``messages``; ShareGPT ``conversations``; FastChat's MT-Bench question form
(``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}``, each turn a user turn); a plain
``prompt`` string (one user turn). A record without an assistant turn is a *prompt*: only regeneration can use
it (the verifier answers each user turn in order), so without it prompts are skipped, and an input of prompts
only is an error. ``id`` (or ``question_id``) and ``category`` are kept in the sample; ``--categories``
selects by category.

A malformed record (invalid JSON, an unknown role, a ShareGPT turn without ``from``, an empty assistant turn)
or an id used twice is an error naming its line (or row) and the fix, unless ``skip_bad=True``
(``--skip-bad-records``): then such records are skipped (duplicate ids made unique) and counted in the manifest.
Input that is not UTF-8 is an error naming the line and byte offset; Parquet files are read with pyarrow; other
formats (CSV, ...) are refused, saying which ones are read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from draftline.config import parse_categories
from draftline.errors import DataError
from draftline.util import file_sha256

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
_ROLES = {"system", "user", "assistant"}


@dataclass
class Conversations:
    samples: list[dict]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line or index, reason)
    prompts: int = 0  # records without an assistant turn (kept with prompts=True, else skipped)


def _normalise(record: object) -> dict:  # noqa: C901  (one branch per input format and its refusals)
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
    elif "turns" in record:  # FastChat's MT-Bench questions: user turns, answered in order
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a list of strings (the user turns)")
        out = [{"role": "user", "content": t} for t in turns]
    elif "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError("'prompt' must be a string")
        out = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError("none of 'messages' (OpenAI form), 'conversations' (ShareGPT form), 'turns' (MT-Bench "
                         "form) or 'prompt'")
    if not any(m["role"] in ("user", "assistant") for m in out):
        raise ValueError("no user or assistant turn")
    if any(m["role"] == "assistant" and not m["content"].strip() for m in out):
        raise ValueError("an empty assistant turn (nothing to learn from; drop the turn or the record)")
    rid = record.get("id") if record.get("id") is not None else record.get("question_id")
    sample = {"id": "" if rid is None else str(rid), "messages": out}
    if isinstance(record.get("category"), str) and record["category"]:
        sample["category"] = record["category"]
    return sample


def is_prompt(sample: dict) -> bool:
    """True for a sample without an assistant turn (only regeneration can give it one)."""
    return not any(m["role"] == "assistant" for m in sample["messages"])


def _records_from_dataset(path: Path) -> list[tuple[int, object]]:
    import datasets  # noqa: PLC0415 (a dataset directory only: 1-2 s to import, and prepare refuses a typo first)

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


READ_FORMATS = "JSONL, a JSON list, Parquet, or a Hugging Face dataset directory (save_to_disk)"


def _records_from_json(path: Path) -> tuple[list[tuple[int, object]], list[tuple[int, str]]]:
    raw = path.read_bytes()
    if path.suffix.lower() == ".parquet" or raw[:4] == b"PAR1":
        return _records_from_parquet(path), []
    if path.suffix.lower() in (".csv", ".tsv", ".txt", ".xlsx", ".arrow") and raw.lstrip()[:1] not in (b"{", b"["):
        raise DataError(f"{path}: {path.suffix} files are not read; convert it to {READ_FORMATS}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at_line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path} is not UTF-8: line {at_line}, byte offset {e.start} (0x{raw[e.start]:02x}); "
                        "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    records: list[tuple[int, object]] = []
    skipped: list[tuple[int, str]] = []
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), start=1)), skipped
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); use a JSON "
                            "list or one JSON object per line") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            skipped.append((lineno, f"invalid JSON: {e.msg}"))
    return records, skipped


def _records_from_parquet(path: Path) -> list[tuple[int, object]]:
    import pyarrow.parquet as pq  # noqa: PLC0415 (a Parquet file only: prepare refuses a typo before it loads)

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 (pyarrow's ArrowInvalid and friends)
        raise DataError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]}); pass {READ_FORMATS}") \
            from None
    return list(enumerate(rows, start=1))


def source_digest(path: Path | str) -> str:
    """sha256 of the input: the file's bytes, or every file of a dataset directory (names and bytes)."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def load_conversations(path: Path | str, *, prompts: bool = False, skip_bad: bool = False) -> Conversations:
    """Load and normalise every conversation in ``path``; raise :class:`DataError` if none is usable.

    ``prompts=True`` (regeneration will answer them) keeps records without an assistant turn; otherwise they
    are skipped, and an input holding only such records is a :class:`DataError` asking for
    ``--regenerate-endpoint``. A malformed record or a repeated id is a :class:`DataError` unless
    ``skip_bad`` (then skipped, or made unique, and counted in ``skipped``)."""
    path = Path(path)
    skipped: list[tuple[int, str]]
    if path.is_dir():
        records, skipped = _records_from_dataset(path), []
    elif path.is_file():
        records, skipped = _records_from_json(path)
    else:
        raise DataError(f"conversations {path} does not exist: pass --conversations a JSONL or JSON file or a "
                        "Hugging Face dataset directory (save_to_disk)")
    unit = "row" if path.is_dir() or path.suffix.lower() == ".parquet" else "line"
    bad = list(skipped)
    samples: list[dict] = []
    prompt_only = 0
    seen: dict[str, int] = {}
    for where, rec in records:
        try:
            s = _normalise(rec)
        except ValueError as e:
            bad.append((where, str(e)))
            continue
        s["id"] = s["id"] or f"{path.stem}-{where}"
        if s["id"] in seen:
            bad.append((where, f"id {s['id']!r} is used already by {unit} {seen[s['id']]}"))
            if not skip_bad:
                continue
            s["id"] = f"{s['id']}~{where}"
        seen.setdefault(s["id"], where)
        if is_prompt(s):
            prompt_only += 1
            if not prompts:
                skipped.append((where, "no assistant turn (a prompt: pass --regenerate-endpoint to have the "
                                       "verifier answer it)"))
                continue
        samples.append(s)
    if bad and not skip_bad:
        where, why = bad[0]
        more = f" (and {len(bad) - 1} more bad records)" if len(bad) > 1 else ""
        raise DataError(f"{path} {unit} {where}: {why}{more}; fix it, or pass --skip-bad-records to skip such "
                        "records (counted in the manifest)")
    skipped = bad + [s for s in skipped if s not in bad]
    if not samples and prompt_only:
        raise DataError(f"{path} holds prompts only: {prompt_only} of its {len(records)} records have no "
                        "assistant turn, so there is nothing to learn from yet; pass --regenerate-endpoint URL (an "
                        "OpenAI-compatible server of the verifier, e.g. `vllm serve <verifier>`) so the verifier "
                        "answers them")
    if not samples:
        detail = "; ".join(f"{unit} {n}: {why}" for n, why in skipped[:5])
        raise DataError(f"no usable conversation in {path}" + (f" ({detail})" if detail else ""))
    return Conversations(samples=samples, skipped=skipped, prompts=prompt_only)


def select_categories(samples: list[dict], spec: str | None, source: Path | str) -> list[dict]:
    """The samples ``spec`` (see :func:`draftline.config.parse_categories`) selects; a name no sample has is a :class:`DataError`
    (a typo would otherwise select nothing, or drop nothing, silently)."""
    keep, drop = parse_categories(spec)
    if not keep and not drop:
        return samples
    present = {s["category"] for s in samples if "category" in s}
    if not present:
        raise DataError(f"--categories {spec} was given but no record of {source} has a 'category' field: "
                        "drop the setting or use an input with categories")
    unknown = sorted((keep | drop) - present)
    if unknown:
        raise DataError(f"--categories: no record of {source} has category {', '.join(unknown)} (its categories: "
                        f"{', '.join(sorted(present))})")
    if keep:
        return [s for s in samples if s.get("category") in keep]
    return [s for s in samples if s.get("category") not in drop]
