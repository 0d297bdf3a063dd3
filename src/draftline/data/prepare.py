"""The prepare stage: conversations -> tokens, loss masks, token frequencies, verifier hidden-state shards.

One MLflow run; the data set is logged with ``mlflow.log_input`` and a digest, and its files as the run's
``data/`` artifacts, which finetune reads as ``runs:/<run id>/data``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from draftline.config import PrepareConfig
from draftline.data import shards
from draftline.errors import DataError

log = logging.getLogger(__name__)


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
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, local_files_only=True,
                                 cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception:  # noqa: BLE001
        raise DataError(f"verifier {name_or_path} is not in the local Hugging Face cache and nothing is "
                        f"downloaded at run time: `huggingface-cli download {name_or_path}` first, or pass "
                        "its local directory") from None


def resolve_aux_layers(aux: list[int] | None, num_layers: int) -> list[int]:
    ids = list(aux) if aux else [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
        raise DataError(f"aux layers {ids} must be distinct and within [0, {num_layers}] for a verifier with "
                        f"{num_layers} layers" + ("" if aux else "; pass --aux-layers explicitly"))
    return ids


def build_data(cfg: PrepareConfig, out_dir: Path, *, progress: bool = True) -> dict:
    """Write shards, token frequencies and the manifest into ``out_dir``; returns the manifest."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.data.capture import iter_hidden_states
    from draftline.data.conversations import load_conversations
    from draftline.data.tokenize import tokenize_conversations

    convs = load_conversations(cfg.conversations)
    for where, why in convs.skipped[:20]:
        log.warning("skipped record %s of %s: %s", where, cfg.conversations, why)
    samples = convs.samples[: cfg.max_samples] if cfg.max_samples else convs.samples

    verifier_path = resolve_verifier(cfg.verifier)
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    tokenized = tokenize_conversations(samples, tokenizer, cfg.max_length)
    if not tokenized:
        raise DataError(f"no conversation in {cfg.conversations} has an assistant token within "
                        f"max_length={cfg.max_length}")
    verifier = AutoModelForCausalLM.from_pretrained(verifier_path, dtype=torch.float32).eval()
    num_layers = verifier.config.num_hidden_layers
    aux = resolve_aux_layers(cfg.aux_layers, num_layers)

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = verifier.config.vocab_size
    freqs = torch.zeros(vocab, dtype=torch.long)
    entries, pending, pending_tokens = [], [], 0
    stream = iter_hidden_states(verifier, tokenized, aux, cfg.batch_size)
    total_tokens = sum(len(t.input_ids) for t in tokenized)
    with tqdm(total=total_tokens, desc="verifier hidden states", unit="tok", disable=not progress) as bar:
        for rec in stream:
            freqs += torch.bincount(rec["input_ids"][rec["loss_mask"]], minlength=vocab)
            pending.append(rec)
            pending_tokens += rec["input_ids"].numel()
            bar.update(rec["input_ids"].numel())
            if pending_tokens >= cfg.shard_tokens:
                entries.append(shards.write_shard(out_dir / f"shard-{len(entries):05d}.safetensors", pending))
                pending, pending_tokens = [], 0
        if pending:
            entries.append(shards.write_shard(out_dir / f"shard-{len(entries):05d}.safetensors", pending))
    save_file({"freqs": freqs}, str(out_dir / shards.FREQS))
    hidden = verifier.config.hidden_size
    manifest = {
        "format_version": shards.FORMAT_VERSION,
        "verifier": verifier_path,
        "verifier_name": cfg.verifier,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "aux_layer_ids": aux,
        "dtype": "bfloat16",
        "bytes_per_token": (len(aux) + 1) * hidden * 2,
        "max_length": cfg.max_length,
        "samples": sum(e["samples"] for e in entries),
        "tokens": sum(e["tokens"] for e in entries),
        "masked_tokens": sum(e["masked_tokens"] for e in entries),
        "skipped_records": len(convs.skipped),
        "source": str(Path(cfg.conversations).resolve()),
        "shards": entries,
    }
    return shards.write_manifest(out_dir, manifest)


def run(cfg: PrepareConfig, *, progress: bool = True) -> dict[str, str]:
    """The prepare stage as one MLflow run. Returns ``{"run_id", "data_uri", "digest"}``."""
    import mlflow
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    from draftline import lineage, tracking

    tracking.setup()
    with tracking.stage_run("prepare", run_name="prepare") as active:
        run_id = active.info.run_id
        with tempfile.TemporaryDirectory(prefix="draftline-prepare-") as tmp:
            out = Path(tmp) / "data"
            manifest = build_data(cfg, out, progress=progress)
            tracking.log_params_once({
                "verifier.name_or_path": manifest["verifier"],
                "verifier.aux_layers": manifest["aux_layer_ids"],
                "data.source": manifest["source"],
                "data.max_length": cfg.max_length,
                "data.max_samples": cfg.max_samples,
                "data.digest": manifest["digest"],
            })
            mlflow.log_metrics({"data/samples": manifest["samples"], "data/tokens": manifest["tokens"],
                                "data/masked_tokens": manifest["masked_tokens"],
                                "data/skipped_records": manifest["skipped_records"],
                                "data/bytes_per_token": manifest["bytes_per_token"]}, step=0)
            dataset = MetaDataset(source=resolve_dataset_source(manifest["source"]), name=cfg.name,
                                  digest=manifest["digest"][:36])
            mlflow.log_input(dataset, context="training",
                             tags={"samples": str(manifest["samples"]), "tokens": str(manifest["tokens"]),
                                   "sha256": manifest["digest"]})
            mlflow.set_tags({"draftline.data.digest": manifest["digest"], **lineage.environment_tags()})
            mlflow.log_artifacts(str(out), artifact_path="data")
            shutil.rmtree(out, ignore_errors=True)
    return {"run_id": run_id, "data_uri": f"runs:/{run_id}/data", "digest": manifest["digest"]}
