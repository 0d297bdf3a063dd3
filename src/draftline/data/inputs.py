"""What prepare reads, checked and read once before any heavy library loads: the conversations (parsed,
categories selected, cut at ``max_samples``) and the verifier directory (resolved, its config.json valid JSON,
its tokenizer files present); and a prepared data set as finetune and evaluate name it (its manifest). Only the standard library, pydantic and draftline's light modules are imported
here, so a typo is refused in well under two seconds; Hugging Face's hub client loads only for a repo id, and
``datasets``/``pyarrow`` only for a dataset directory or a Parquet file."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftline.config import PrepareConfig
from draftline.data.conversations import load_conversations, select_categories
from draftline.errors import DataError

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
MANIFEST = "manifest.json"
REMOTE_PREFIXES = ("runs:/", "models:/", "mlflow-artifacts:/")


@dataclass
class Inputs:
    """prepare's inputs as read: the samples to use, per category, the records skipped, the verifier's path."""

    samples: list[dict]
    verifier_path: str
    categories: dict[str, int] = field(default_factory=dict)
    skipped: int = 0


def read_inputs(cfg: PrepareConfig) -> Inputs:
    """The conversations and the verifier, each checked: one :class:`DataError` naming the file and the fix."""
    convs = load_conversations(cfg.conversations, prompts=bool(cfg.regenerate_endpoint),
                               skip_bad=cfg.skip_bad_records)
    for where, why in convs.skipped[:20]:
        log.warning("skipped record %s of %s: %s", where, cfg.conversations, why)
    samples = select_categories(convs.samples, cfg.categories, cfg.conversations)
    samples = samples[: cfg.max_samples] if cfg.max_samples else samples
    categories = dict(sorted(Counter(s["category"] for s in samples if "category" in s).items()))
    verifier = resolve_verifier(cfg.verifier)
    check_verifier_files(verifier)
    return Inputs(samples=samples, verifier_path=verifier, categories=categories, skipped=len(convs.skipped))


def resolve_verifier(name_or_path: str) -> str:
    """A local directory (made absolute) or a repo id present in the local Hugging Face cache."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DataError(f"verifier directory {p} has no config.json: pass a Hugging Face model directory")
        return str(p.resolve())
    if p.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise DataError(f"verifier {name_or_path} is not a directory: pass a local Hugging Face model directory "
                        "or a repo id already in the local cache")
    from huggingface_hub import snapshot_download  # noqa: PLC0415 (a repo id only: the hub client is not light)

    try:
        return snapshot_download(name_or_path, local_files_only=True,
                                 cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception:  # noqa: BLE001
        raise DataError(f"verifier {name_or_path} is not in the local Hugging Face cache and nothing is "
                        f"downloaded at run time: `huggingface-cli download {name_or_path}` first, or pass "
                        "its local directory") from None


def check_verifier_files(path: str) -> None:
    """config.json is JSON and a tokenizer file is there."""
    d = Path(path)
    try:
        json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else \
            f" ({e})"
        raise DataError(f"verifier {d}: config.json is not valid JSON{where}; restore the model's config.json "
                        "(a truncated copy?)") from None
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise DataError(f"verifier {d} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json): "
                        "copy the model's tokenizer files into it")


def check_data_ref(ref: str) -> None:
    """A prepared data set named on the command line: a local directory holding a readable manifest (a remote
    URI is checked where it is downloaded)."""
    if ref.startswith(REMOTE_PREFIXES):
        return
    if not Path(ref).expanduser().is_dir():
        raise DataError(f"data {ref} is neither a directory nor a runs:/ URI: pass the output of prepare")
    read_manifest(Path(ref).expanduser())


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{data_dir} has no {MANIFEST}: pass the output of `draftline prepare` "
                        "(runs:/<prepare run id>/data or its local directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); prepare the data again") from None
