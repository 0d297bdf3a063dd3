"""The prepare stage: conversations -> tokens, loss masks, token frequencies, verifier hidden-state shards.

One MLflow run; the data set is logged with ``mlflow.log_input`` and a digest, and its files as the run's
``data/`` artifacts, which finetune reads as ``runs:/<run id>/data``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import mlflow
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftline import names, tracking
from draftline.config import PrepareConfig, work_dir
from draftline.console import bar_kwargs, say
from draftline.data import replies, shards, storage
from draftline.data.capture import iter_hidden_states
from draftline.data.capture_vllm import iter_hidden_states_vllm, loopback_capture_server, probe_capture
from draftline.data.conversations import is_prompt, source_digest
from draftline.data.inputs import Inputs, check_verifier_files, read_inputs, resolve_verifier
from draftline.data.regenerate import probe, regenerate, served_models
from draftline.data.tokenize import TokenizedSample, tokenize_conversations
from draftline.disk_space import human_bytes
from draftline.errors import DataError
from draftline.registry import lineage
from draftline.registry.lineage import verifier_identity
from draftline.results import PrepareResult
from draftline.serving import hf_model
from draftline.serving.client import redact
from draftline.serving.engine import vllm_python
from draftline.serving.vllm_support import require_served
from draftline.util import interrupt_on_signals, same_command

log = logging.getLogger(__name__)


def resolve_aux_layers(aux: list[int] | None, num_layers: int) -> list[int]:
    ids = list(aux) if aux else [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
        raise DataError(f"aux layers {ids} must be distinct and within [0, {num_layers}] for a verifier with "
                        f"{num_layers} layers" + ("" if aux else "; pass --aux-layers explicitly"))
    return ids


def verifier_fingerprint(path: str) -> str:
    """sha256 over the verifier's config and tokenizer files (what shapes and tokenises; weights are too big
    to hash per prepare and are named by the path)."""
    h = hashlib.sha256(path.encode())
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def prepare_key(cfg: PrepareConfig, verifier_path: str | None = None) -> str:
    """sha256 naming everything the shards depend on: the input's bytes, the verifier, the settings."""
    fields = cfg.model_dump(exclude={"name", "output_dir", "log_shards", "regenerate_concurrency",
                                     "capture_endpoint", "trust_remote_code", "disk_check"})
    fields.update(conversations=source_digest(cfg.conversations),
                  verifier=verifier_fingerprint(verifier_path or resolve_verifier(cfg.verifier)),
                  format_version=shards.FORMAT_VERSION)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def build_data(cfg: PrepareConfig, out_dir: Path, *, progress: bool = True, key: str | None = None,
               inputs: Inputs | None = None) -> dict:
    """Write shards, token frequencies and the manifest into ``out_dir``; returns the manifest. Finished
    shards already in ``out_dir`` for the same inputs and settings are kept and the capture resumes after them.
    ``inputs``: what :func:`~draftline.data.inputs.read_inputs` read (read here when not given)."""
    inputs = inputs or read_inputs(cfg)
    samples, categories, skipped = inputs.samples, inputs.categories, inputs.skipped
    prompts = sum(map(is_prompt, samples))
    verifier_path = inputs.verifier_path
    tokenizer = hf_model.load_tokenizer(verifier_path)
    regenerated = (_regenerate(cfg, cfg.regenerate_endpoint, samples, tokenizer, progress)
                   if cfg.regenerate_endpoint else None)
    if regenerated:
        samples = regenerated.pop("samples")
        regenerated["prompts"] = prompts  # samples that came without an assistant turn
        counted: replies.ReplyStats = regenerated.pop("stats")
        regenerated.update(counted.metrics())

    tokenized = _tokenize(cfg, tokenizer, samples, regenerated)
    config = verifier_config(verifier_path)
    aux = resolve_aux_layers(cfg.aux_layers, config.num_hidden_layers)
    writer = _shard_writer(cfg, out_dir, key, tokenized, config.vocab_size)
    if cfg.disk_check:  # the exact token count now, before the capture starts
        left = sum(len(t.input_ids) for t in tokenized) - writer.done_tokens
        storage.require_room(out_dir, storage.shard_bytes(config.hidden_size, len(aux), tokens=left,
                                                          samples=len(tokenized) - writer.done_samples,
                                                          tokens_source="counted from the tokenised samples"))
    _capture(cfg, writer, verifier_path, config, tokenized, aux, progress)
    save_file({"freqs": writer.freqs}, str(out_dir / shards.FREQS))
    if regenerated:
        replies.histogram(counted, Path(out_dir) / replies.HISTOGRAM, max_tokens=regenerated["max_tokens"])
    manifest = _manifest(cfg, out_dir, verifier_path, config, aux, writer.entries, skipped=skipped,
                         categories=categories, regenerated=regenerated)
    return shards.write_manifest(out_dir, manifest)


def _tokenize(cfg: PrepareConfig, tokenizer, samples: list[dict],
              regenerated: dict | None) -> list[TokenizedSample]:
    """The samples tokenised by the verifier's tokenizer (served sequences where the server returned their ids);
    ``regenerated`` (when given) gains how many turns and samples came from the server's ids, and how many
    samples ``--max-length`` cut."""
    tokenized = tokenize_conversations(samples, tokenizer, cfg.max_length)
    if regenerated:
        served = [t for t in tokenized if t.served]
        regenerated["turns_from_token_ids"] = sum(t.turns_from_ids for t in tokenized)
        regenerated["turns_token_ids_unplaced"] = sum(t.turns_ids_unplaced for t in tokenized)
        regenerated["served_samples"] = len(served)
        regenerated["turns_per_sample"] = (sum(t.turns_from_ids for t in served) / len(served)) if served else 0.0
        cut = [t for t in tokenized if t.cut_tokens]
        regenerated["cut_at_max_length"] = len(cut)
        regenerated["tokens_cut_at_max_length"] = sum(t.cut_tokens for t in cut)
        log.info("regenerated replies: %d samples as served (prompt ids + generated ids), %d assistant turns "
                 "placed in a template rendering, %d tokenised from text", len(served),
                 regenerated["turns_from_token_ids"] - sum(t.turns_from_ids for t in served),
                 regenerated["turns_token_ids_unplaced"])
        if cut:
            say(f"--max-length {cfg.max_length} cut {len(cut)} of {len(tokenized)} samples "
                f"({regenerated['tokens_cut_at_max_length']:,} tokens): raise it to train on whole replies")
    if not tokenized:
        raise DataError(f"no conversation in {cfg.conversations} has an assistant token within "
                        f"max_length={cfg.max_length}")
    return tokenized


def _shard_writer(cfg: PrepareConfig, out_dir: Path, key: str | None, tokenized: list[TokenizedSample],
                  vocab: int) -> shards.ShardWriter:
    """The writer of ``out_dir``'s shards, keyed by the inputs, the settings and the samples: finished shards
    of the same key are kept, and the capture resumes after them."""
    # the samples themselves are part of the key: a regeneration that failed for some conversations in one
    # run and not in the next must not resume shards cut from another sample list
    samples_digest = hashlib.sha256()
    for t in tokenized:  # streamed: one sample at a time, not one string of every token id
        samples_digest.update(json.dumps((t.id, t.input_ids, t.loss_mask)).encode() + b"\n")
    writer_key = hashlib.sha256(f"{key or prepare_key(cfg)}:{samples_digest.hexdigest()}".encode()).hexdigest()
    writer = shards.ShardWriter(out_dir, writer_key, cfg.shard_tokens, vocab, check_room=cfg.disk_check,
                                storage=cfg.hidden_storage)
    if writer.done_samples:
        log.warning("resuming the hidden-state capture in %s after %d finished shards (%d samples)",
                    out_dir, len(writer.entries), writer.done_samples)
    return writer


def _capture(cfg: PrepareConfig, writer: shards.ShardWriter, verifier_path: str, config,
             tokenized: list[TokenizedSample], aux: list[int], progress: bool) -> None:
    """The verifier's hidden states of every sample not yet in a finished shard, into ``writer``'s shards."""
    total_tokens = sum(len(t.input_ids) for t in tokenized)
    stream = _hidden_state_stream(cfg, verifier_path, config, tokenized[writer.done_samples:], aux)
    with tqdm(total=total_tokens, initial=writer.done_tokens, desc="verifier hidden states", unit="tok",
              **bar_kwargs(progress)) as bar:
        for i, rec in enumerate(stream, start=1):
            writer.add(rec)
            bar.update(rec["input_ids"].numel())
            if i % cfg.batch_size == 0:  # shards close on batch boundaries: a resumed run batches alike
                writer.boundary()
        writer.boundary(final=True)


def _manifest(cfg: PrepareConfig, out_dir: Path, verifier_path: str, config, aux: list[int], entries: list[dict],
              *, skipped: int, categories: dict[str, int], regenerated: dict | None) -> dict:
    """The data set's manifest: the verifier, the shapes, the counts, the source and every shard."""
    hidden = config.hidden_size
    return {
        "format_version": shards.FORMAT_VERSION,
        "verifier": verifier_path,
        "verifier_name": cfg.verifier,
        # what a serving host knows it by (None: only this machine's path, and export will ask for an id)
        **dict(zip(("verifier_id", "verifier_revision"),
                   verifier_identity(verifier_path, cfg.verifier, cfg.verifier_id), strict=True)),
        "verifier_trust_remote_code": hf_model.is_trusted(verifier_path),
        **{f"verifier_{k}": v for k, v in hf_model.describe(verifier_path).items()},
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": hidden,
        "vocab_size": config.vocab_size,
        "aux_layer_ids": aux,
        "dtype": "bfloat16",  # what the loader hands training, whatever the storage
        "hidden_storage": cfg.hidden_storage,
        "capture_backend": cfg.capture_backend,
        "bytes_per_token": storage.token_bytes(hidden, len(aux), cfg.hidden_storage),
        "max_length": cfg.max_length,
        "samples": sum(e["samples"] for e in entries),
        "tokens": sum(e["tokens"] for e in entries),
        "masked_tokens": sum(e["masked_tokens"] for e in entries),
        "skipped_records": skipped,
        **({"categories": categories} if categories else {}),  # samples per category, as given to tokenisation
        "source": str(Path(cfg.conversations).resolve()),
        "location": str(Path(out_dir).resolve()),
        "shards": entries,
        **({"regenerated": regenerated} if regenerated else {}),
    }


def _hidden_state_stream(cfg: PrepareConfig, verifier_path: str, config, samples, aux: list[int]):
    """Records from the verifier in this process (transformers), or from vLLM: the server ``--capture-endpoint``
    names, or a loopback one started here for the duration of the capture."""
    if cfg.capture_backend == "vllm":
        shape = dict(num_aux=len(aux), hidden_size=config.hidden_size, batch_size=cfg.batch_size)
        if cfg.capture_endpoint:
            yield from iter_hidden_states_vllm(samples, cfg.capture_endpoint, cfg.capture_model or cfg.verifier,
                                               **shape)
            return
        if not samples:
            return
        longest = max(len(s.input_ids) for s in samples)
        with tempfile.TemporaryDirectory(prefix="draftline-capture-") as out, \
                loopback_capture_server(verifier_path, [*aux, config.num_hidden_layers], out,
                                        max_len=longest + 8) as server:
            say(f"vLLM capturing layers {[*aux, config.num_hidden_layers]} on loopback (up in "
                f"{server.startup_s:.0f} s, {server.spec.dtype})")
            yield from iter_hidden_states_vllm(samples, server.endpoint, server.model, server=server, **shape)
        return

    verifier = hf_model.load_causal_lm(verifier_path, dtype=torch.float32)
    yield from iter_hidden_states(verifier, samples, aux, cfg.batch_size)


def regenerate_max_tokens(cfg: PrepareConfig, tokenizer) -> int:
    """``--regenerate-max-tokens``, or its default: ``--max-length`` for a reasoning verifier (every token of its
    thinking that a sample can hold), 512 otherwise."""
    if cfg.regenerate_max_tokens:
        return cfg.regenerate_max_tokens
    return cfg.max_length if replies.is_reasoning_verifier(tokenizer) else 512


def _regenerate(cfg: PrepareConfig, endpoint: str, samples: list[dict], tokenizer, progress: bool) -> dict:
    """The samples regenerated by the verifier behind ``endpoint`` (``cfg.regenerate_endpoint``), checked
    (:func:`replies.check`), counted, cut at their first truncated reply where asked, and what to record."""
    max_tokens = regenerate_max_tokens(cfg, tokenizer)
    r = regenerate(samples, endpoint, model=cfg.regenerate_model, max_tokens=max_tokens,
                   temperature=cfg.regenerate_temperature, concurrency=cfg.regenerate_concurrency,
                   progress=progress, chat_template_kwargs=cfg.regenerate_chat_template_kwargs)
    replies.check(r.samples, tokenizer, endpoint=redact(endpoint))
    counted = replies.stats(r.samples, tokenizer)
    say(f"regenerated: {counted.summary(max_tokens)}")
    kept = r.samples if cfg.regenerate_keep_truncated else replies.drop_truncated(r.samples)
    if counted.replies and counted.truncated == counted.replies:
        log.warning("every reply was cut at --regenerate-max-tokens %d: raise it (and --max-length) to train on "
                    "whole replies", max_tokens)
    return {"samples": kept, "endpoint": redact(endpoint), "model": r.model,
            "max_tokens": max_tokens, "temperature": cfg.regenerate_temperature,
            "chat_template_kwargs": cfg.regenerate_chat_template_kwargs,
            "keep_truncated": cfg.regenerate_keep_truncated,
            "file_sha256": r.file_sha256, "done": r.done, "reused": r.reused, "failed": r.failed,
            "stats": counted}


def verifier_config(path: str):
    """The verifier's config (its text config for multimodal ones), every file a tokenizer needs checked first:
    one :class:`DataError` naming the file and the fix, never a loader's traceback; a directory that ships its
    model or tokenizer as code is refused unless trusted (:mod:`draftline.serving.hf_model`)."""
    d = Path(path)
    check_verifier_files(path)
    try:
        config = hf_model.load_config(path)  # refuses custom code not trusted, in one line, before it runs
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"verifier {d}: transformers cannot read its config.json ({str(e).splitlines()[0]})") \
            from None
    return hf_model.text_config(config)


def preflight(cfg: PrepareConfig, inputs: Inputs) -> storage.StoragePlan | None:
    """Every check prepare can make before it opens a run or creates a folder: the input (encoding, format,
    records, ids, categories), the verifier's files, the aux layers, the capture backend and the regeneration
    endpoint. A mistake here leaves no run, no folder and no file. Returns the shards' storage plan (None with
    ``--disk-check false``), for :func:`check_room` once the output folder is known."""
    verifier = inputs.verifier_path
    if cfg.trust_remote_code:
        hf_model.allow_custom_code(verifier)
    config = verifier_config(verifier)
    aux = resolve_aux_layers(cfg.aux_layers, config.num_hidden_layers)
    if cfg.capture_backend == "vllm" and not cfg.capture_endpoint:  # the loopback capture server needs vLLM
        require_served(verifier, vllm_python(required=True),
                       fix="capture with --capture-backend transformers, or choose a verifier vLLM serves")
    if cfg.capture_endpoint:
        probe_capture(cfg.capture_endpoint, cfg.capture_model or cfg.verifier, num_aux=len(aux),
                      hidden_size=config.hidden_size)
    if cfg.regenerate_chat_template_kwargs:
        check_template_kwargs(hf_model.load_tokenizer(verifier), cfg.regenerate_chat_template_kwargs)
    if cfg.regenerate_endpoint:
        models = served_models(cfg.regenerate_endpoint)
        if cfg.regenerate_model and cfg.regenerate_model not in models:
            raise DataError(f"the regeneration endpoint {redact(cfg.regenerate_endpoint)} does not serve "
                            f"{cfg.regenerate_model}: pass --regenerate-model with one of {', '.join(models)}")
        probe(cfg.regenerate_endpoint, cfg.regenerate_model or models[0])
    return storage_plan(cfg, inputs, config, aux) if cfg.disk_check else None


def check_template_kwargs(tokenizer, kwargs: dict) -> None:
    """Refuse ``--regenerate-chat-template-kwargs`` keys that the verifier's chat template renders the same with
    and without (a misspelt switch would regenerate in the mode the deployment does not serve)."""
    probe = [{"role": "user", "content": "Hello"}]
    if tokenizer.chat_template is None:
        raise DataError("--regenerate-chat-template-kwargs: the verifier's tokenizer has no chat template to pass "
                        "them to")
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    ignored = [k for k, v in kwargs.items()
               if tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **{k: v}) == plain
               and tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                                 **{k: not v if isinstance(v, bool) else None}) == plain]
    if ignored:
        raise DataError(f"--regenerate-chat-template-kwargs: the verifier's chat template ignores "
                        f"{', '.join(map(repr, ignored))} (it renders the same with any value): use the keys its "
                        "template reads (e.g. thinking for Kimi-K2.5, enable_thinking for Qwen3)")


def check_room(plan: storage.StoragePlan | None, out: Path) -> None:
    """Say what the shards will take and refuse when ``out``'s file system cannot hold them (finished shards of
    an interrupted run already there count as written)."""
    if plan is None:
        return
    say(f"shards: about {human_bytes(plan.bytes)} ({plan.tokens:,} tokens x {plan.bytes_per_token:,} bytes, "
        f"{plan.tokens_source}) into {out}")
    storage.require_room(out, plan, kept_bytes=storage.existing_shard_bytes(out))


def storage_plan(cfg: PrepareConfig, inputs: Inputs, config, aux: list[int]) -> storage.StoragePlan:
    """The shards' bytes for the samples, their tokens counted from the text with the verifier's tokenizer."""
    tokenizer = hf_model.load_tokenizer(inputs.verifier_path)
    regen = regenerate_max_tokens(cfg, tokenizer) if cfg.regenerate_endpoint else None
    samples = inputs.samples
    tokens = storage.estimate_tokens(samples, tokenizer, cfg.max_length, regen)
    source = ("measured from the conversations' text" if regen is None else
              f"measured from the prompts, each answer counted as --regenerate-max-tokens {regen}: an upper bound")
    return storage.shard_bytes(config.hidden_size, len(aux), tokens=tokens, samples=len(samples),
                               tokens_source=source, storage=cfg.hidden_storage)


def output_dir(cfg: PrepareConfig, key: str) -> Path:
    return Path(cfg.output_dir).expanduser().resolve() if cfg.output_dir else work_dir() / "prepared" / key[:16]


def run(cfg: PrepareConfig, *, progress: bool = True, inputs: Inputs | None = None) -> PrepareResult:
    """The prepare stage as one MLflow run. ``inputs``: what
    :func:`~draftline.data.inputs.read_inputs` read already (the CLI reads them before this module loads)."""
    inputs = inputs or read_inputs(cfg)
    room = preflight(cfg, inputs)  # before the tracking store, the run and the folder exist
    key = prepare_key(cfg, inputs.verifier_path)
    out = output_dir(cfg, key)
    check_room(room, out)
    tracking.setup()
    stopped = lambda name: (f"prepare stopped by {name}; the answers and shards finished so far are kept in "  # noqa: E731
                            f"{out}: resume with {same_command()}")
    with interrupt_on_signals(stopped), shards.exclusive(out), \
            tracking.stage_run("prepare", run_name="prepare", run_id=_unfinished_run(key),
                               tags={"draftline.prepare.key": key}) as active:
        run_id = active.info.run_id
        manifest = build_data(cfg, out, progress=progress, key=key, inputs=inputs)
        tracking.log_params_once({
            **lineage.verifier_params(manifest),
            "data.source": manifest["source"],
            "data.max_length": cfg.max_length,
            "data.max_samples": cfg.max_samples,
            names.DATA_DIGEST: manifest["digest"],
            "data.location": manifest["location"],
            "data.shards_logged": cfg.log_shards,
            names.DATA_HIDDEN_STORAGE: cfg.hidden_storage,
            **_regeneration_params(manifest),
        })
        mlflow.log_metrics({"data/samples": manifest["samples"], "data/tokens": manifest["tokens"],
                            "data/masked_tokens": manifest["masked_tokens"],
                            "data/skipped_records": manifest["skipped_records"],
                            "data/bytes_per_token": manifest["bytes_per_token"],
                            "data/shard_bytes": sum((out / e["file"]).stat().st_size for e in manifest["shards"]),
                            **_regeneration_metrics(manifest)}, step=0)
        mlflow.log_input(lineage.data_set(manifest, cfg.name), context="training",
                         tags=lineage.data_set_tags(manifest))
        mlflow.set_tags({"draftline.data.digest": manifest["digest"], **lineage.environment_tags()})
        # the manifest (location + every shard's sha256) and the frequencies always; the shards only if asked
        for name in (shards.MANIFEST, shards.FREQS):
            mlflow.log_artifact(str(out / name), artifact_path="data")
        if (out / replies.HISTOGRAM).is_file():
            mlflow.log_artifact(str(out / replies.HISTOGRAM), artifact_path="data")
        if cfg.log_shards:
            for e in manifest["shards"]:
                mlflow.log_artifact(str(out / e["file"]), artifact_path="data")
    return PrepareResult(run_id=run_id, data_uri=f"runs:/{run_id}/data", digest=manifest["digest"],
                         location=manifest["location"])


def _regeneration_params(manifest: dict) -> dict[str, object]:
    regenerated = manifest.get("regenerated")
    if not regenerated:
        return {}
    kwargs = regenerated.get("chat_template_kwargs")
    return {"data.regenerate.max_tokens": regenerated["max_tokens"],
            "data.regenerate.keep_truncated": regenerated.get("keep_truncated", True),
            "data.regenerate.chat_template_kwargs": json.dumps(kwargs, sort_keys=True) if kwargs else "none"}


def _regeneration_metrics(manifest: dict) -> dict[str, float]:
    """What the verifier generated, as the data run's metrics (``data/replies``, ``data/truncated_replies``, ...)."""
    regenerated = manifest.get("regenerated") or {}
    out = {k: float(v) for k, v in regenerated.items() if k.startswith("data/")}
    if regenerated:
        out.update({"data/served_samples": float(regenerated.get("served_samples", 0)),
                    "data/turns_per_sample": float(regenerated.get("turns_per_sample", 0.0)),
                    "data/cut_at_max_length": float(regenerated.get("cut_at_max_length", 0))})
    return out


def _unfinished_run(key: str) -> str | None:
    """The prepare run an interrupted prepare of the same inputs left behind (FAILED, or RUNNING after a
    kill -9; the directory lock proves nobody is still writing), so a rerun continues it."""
    if os.environ.get("MLFLOW_RUN_ID"):  # under `mlflow run`, the run is given
        return None
    runs = mlflow.search_runs(filter_string=f"tags.`draftline.prepare.key` = '{key}'", output_format="list",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs and runs[0].info.status in ("FAILED", "RUNNING", "KILLED") else None
