"""The export stage: take the finetune run's handed-on weights, write a directory vLLM loads as it is, validate it
by reloading it through speculators, log it, and register it as a new model version carrying the lineage.

The directory (``drafter/``): ``config.json`` (speculators format, with the verifier, aux-layer ids, draft
vocabulary and target hidden size always written), ``model.safetensors``, ``lineage.json``, ``README.md`` (a
model card with ``base_model:``) and ``checksums.json`` (sha256 of every other file), written last: the
digests are computed on a second thread while MLflow uploads the files, so checksumming costs no extra pass.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from draftline.config import ExportConfig
from draftline.errors import CheckpointError, DataError, DiskFullError, DraftlineError
from draftline.registry.lineage import LINEAGE_FILE
from draftline.registry.transfer import CHECKSUMS  # one name for the manifest, in exports and pulls

# Running out of room, as the OS reports it.
ROOM_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "file too large"}
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)")  # Python's OSError; Rust's io::Error
_FAILED_FILE = re.compile(r"^##### File (.+) #####$", re.M)  # MLflow's report of a failed artifact download


def out_of_room(exc: BaseException | None) -> tuple[int, str | None] | None:
    """``(errno, file or None)`` when ``exc``, or an exception behind it, is ENOSPC, EDQUOT or EFBIG.

    Not every library re-raises the OSError: safetensors reports it as text ("File too large (os error 27)"),
    MLflow's artifact download as a text block per failed file, and draftline's own wrappers raise
    ``from None`` (the original stays in ``__context__``); so the chain is walked and the messages read.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in ROOM_ERRNOS:
            return exc.errno, exc.filename if isinstance(exc.filename, str) else None
        text = str(exc)
        codes = [int(a or b) for a, b in _ERRNO_IN_TEXT.findall(text)]
        codes += [c for c in ROOM_ERRNOS if os.strerror(c) in text]
        code = next((c for c in codes if c in ROOM_ERRNOS), None)
        if code is not None:
            failed = _FAILED_FILE.search(text)
            return code, failed.group(1) if failed else None
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def room_for(target: Path | str, *, space_fix: str, size_fix: str):
    """Turn running out of room while writing ``target`` into one :class:`DiskFullError` that names the file
    and the fix; any other error passes through unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        found = out_of_room(e)
        if found is None:
            raise
        code, name = found
        path = name if name and os.path.isabs(name) else f"{target}/{name}" if name else str(target)
        if code == errno.EFBIG:
            raise DiskFullError(f"file too large while writing {path} (over the file size limit, `ulimit -f`, "
                                f"or the largest file its file system takes): {size_fix}") from None
        raise DiskFullError(f"{ROOM_ERRNOS[code]} while writing {path}: {space_fix}") from None


def _room_in_tmp(target: Path):
    where = tempfile.gettempdir()
    return room_for(target, space_fix=f"free space on {where} or point TMPDIR elsewhere",
                    size_fix="raise the limit or point TMPDIR elsewhere")


def _room_in_store(target: str):
    return room_for(target, space_fix=f"free space on the artifact store ({target}) and on "
                    f"{tempfile.gettempdir()}, then export again",
                    size_fix="raise the limit, then export again")


def build_trained_model(state: dict[str, torch.Tensor], params: dict[str, str], layer: dict | None = None):
    """A fresh drafter for the run's verifier, decoder layer and vocabulary, with the consolidated weights."""
    from draftline.drafter.checkpoints import VERIFIER_OWNED
    from draftline.drafter.model import build_draft_model

    aux = json.loads(params["verifier.aux_layers"])
    model = build_draft_model(local_verifier(params), d2t=state["d2t"], t2d=state["t2d"],
                              aux_layer_ids=aux, draft_vocab_size=int(state["d2t"].numel()),
                              ttt_steps=int(params["ttt_steps"]), dtype=torch.bfloat16, layer=layer)
    expected = {k for k in model.state_dict() if k not in VERIFIER_OWNED}
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"the consolidated checkpoint lacks {', '.join(missing)}")
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model.eval()


def local_verifier(params: dict[str, str]) -> str:
    """Where the finetune run's verifier lies on this host (runs from before ``verifier.path`` kept it in
    ``verifier.name_or_path``)."""
    return params.get("verifier.path") or params["verifier.name_or_path"]


def serving_id(cfg: ExportConfig, params: dict[str, str]) -> str:
    """The verifier as a serving host knows it (``vllm serve <pulled dir>`` loads it by this), never a path
    on the training host."""
    recorded = params.get("verifier.name_or_path", "")
    chosen = cfg.verifier_id or recorded
    if not chosen or Path(chosen).is_absolute() or chosen.startswith(("./", "../", "~")) or (
            chosen == params.get("verifier.path") and not cfg.verifier_id):
        raise DataError(f"the finetune run recorded its verifier only as the path {recorded} on the training host, "
                        "which a serving host cannot load: pass --verifier-id ORG/NAME (the Hugging Face repo id "
                        "the serving hosts load it by), here or to prepare")
    return chosen


def sha256_manifest(directory: Path) -> dict[str, str]:
    from draftline.util import file_sha256

    return {p.name: file_sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != CHECKSUMS}


def model_card(lineage: dict, metrics: dict[str, float]) -> str:
    base = lineage.get("parent.source") if lineage.get("parent.source") not in (None, "none") else \
        lineage.get("verifier.name_or_path")
    rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(lineage.items()))
    mrows = "\n".join(f"| `{k}` | {v:.4f} |" for k, v in sorted(metrics.items()))
    relation = "base_model_relation: finetune\n" if lineage.get("parent.source") not in (None, "none") else ""
    return f"""---
base_model: {base}
{relation}license: other  # the parent's and the verifier's licenses apply
datasets: [draftline-data-{str(lineage.get('data.digest', 'unknown'))[:12]}]
library_name: speculators
tags: [eagle3, speculative-decoding, draftline]
---
# EAGLE-3 drafter

Trained by draftline for the verifier `{lineage.get('verifier.name_or_path')}` on data set
`{lineage.get('data.digest')}` (sha256 over its shards); serve it with vLLM, where that verifier loads by its id:

```
vllm serve <this dir>   # the verifier comes from speculators_config.verifier.name_or_path
vllm serve {lineage.get('verifier.name_or_path')} --speculative-config '{{"model": "<this dir>", "method": "eagle3", "num_speculative_tokens": {lineage.get('eval.recommended_num_speculative_tokens', lineage.get('ttt_steps', 3))}}}'
```

## Lineage

| fact | value |
|---|---|
{rows}

## Metrics at the end of finetuning

| metric | value |
|---|---|
{mrows}
"""


def write_drafter(model, out: Path, lineage: dict, metrics: dict[str, float]) -> None:
    """Write the speculators-format directory (``checksums.json`` comes with the upload)."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.target_hidden_size = model.hidden_size
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size"):
        if cfg.get(key) is None:
            raise CheckpointError(f"the exported config.json lacks {key}; vLLM would fall back to defaults")
    if not (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path"):
        raise CheckpointError("the exported config.json names no verifier")
    (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(model_card(lineage, metrics))


def upload_with_checksums(out: Path, model_id: str) -> dict[str, str]:
    """Upload ``out`` as the LoggedModel's artifacts, then its ``checksums.json``; the digests are computed on
    a second thread while MLflow uploads the files (both read them from the page cache)."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow import MlflowClient

    client = MlflowClient()
    with ThreadPoolExecutor(1, thread_name_prefix="draftline-sha256") as pool:
        digests = pool.submit(sha256_manifest, out)
        client.log_model_artifacts(model_id, str(out))
        manifest = digests.result()
    with tempfile.TemporaryDirectory(prefix="draftline-checksums-") as one:  # the API uploads folders only
        (Path(one) / CHECKSUMS).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        client.log_model_artifacts(model_id, one)  # last: a model with checksums.json is complete
    return manifest


def write_midlayer(model, out: Path, params: dict[str, str]) -> None:
    from safetensors.torch import save_file

    from draftline.drafter.checkpoints import to_midlayer_layout
    from draftline.drafter.shape import specforge_config

    out.mkdir(parents=True, exist_ok=True)
    state = to_midlayer_layout({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = specforge_config(model.config.transformer_layer_config, draft_vocab_size=model.draft_vocab_size,
                           aux_layer_ids=json.loads(params["verifier.aux_layers"]))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def validate(model, out: Path, seed: int = 0, verifier_path: str | None = None) -> None:
    """Reload ``out`` with speculators and require identical weights and identical outputs on a batch.
    ``verifier_path``: where the verifier lies on this host (the config names it by its serving id)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from draftline.drafter.model import pack

    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (not saved; flex needs a GPU)
    if verifier_path:  # speculators loads the verifier's embeddings and head by this name
        config.speculators_config.verifier.name_or_path = verifier_path
    reloaded = Eagle3DraftModel.from_pretrained(str(out), config=config).to(torch.bfloat16).eval()
    ours, theirs = model.state_dict(), reloaded.state_dict()
    for key in (k for k in ours if k in theirs):
        if not torch.equal(ours[key].cpu(), theirs[key].cpu()):
            raise CheckpointError(f"export validation failed: {key} differs after reloading {out}")
    g = torch.Generator().manual_seed(seed)
    n, h = 33, model.hidden_size
    aux = len(model.config.eagle_aux_hidden_state_layer_ids)
    sample = {"input_ids": torch.randint(0, model.verifier_vocab_size, (n,), generator=g),
              "loss_mask": torch.ones(n, dtype=torch.bool),
              "hidden_states": torch.randn(n, aux * h, generator=g).to(torch.bfloat16),
              "verifier_last_hidden_states": torch.randn(n, h, generator=g).to(torch.bfloat16)}
    batch = pack([sample])  # in the pairing vLLM serves, as in training
    del batch["loss_mask"], batch["verifier_last_hidden_states"]
    with torch.no_grad():
        a, b = model(**batch, ttt_steps=3), reloaded(**batch, ttt_steps=3)
    if not all(torch.equal(x, y) for x, y in zip(a, b)):
        raise CheckpointError(f"export validation failed: the reloaded drafter in {out} drafts other tokens")


def run(cfg: ExportConfig) -> dict[str, str]:
    """The export stage as one MLflow run. Returns ``{"run_id", "model_uri", "version"}``."""
    import mlflow
    from mlflow import MlflowClient

    from draftline import tracking
    from draftline.registry import lineage as lin
    from draftline.registry import versions

    tracking.setup()
    client = MlflowClient()
    ft_id = tracking.parse_run_ref(cfg.run)[0]
    try:
        ft = client.get_run(ft_id)
    except Exception:  # noqa: BLE001
        raise DataError(f"finetune run {ft_id} does not exist on {tracking.tracking_uri()}") from None
    if ft.info.status != "FINISHED" or ft.data.tags.get("draftline.step") != "finetune":
        raise DataError(f"run {ft_id} is not a finished finetune run (status {ft.info.status}, step "
                        f"{ft.data.tags.get('draftline.step')}); export a finetune run that finished")
    params = ft.data.params
    metrics = {k: v for k, v in ft.data.metrics.items() if k in lin.HEADLINE_METRICS}

    with tracking.stage_run("export", run_name="export",
                            tags={"draftline.finetune.run_id": ft_id}) as active, \
            tempfile.TemporaryDirectory(prefix="draftline-export-") as tmp:
        tmp = Path(tmp)
        from draftline.drafter.handoff import fetch_weights
        from draftline.drafter.model import LAYER_FILE

        with _room_in_tmp(tmp):
            where, state, step = fetch_weights(ft, cfg.checkpoint, tmp / "weights")
        layer = json.loads((where / LAYER_FILE).read_text()) if (where / LAYER_FILE).is_file() else None
        model = build_trained_model(state, params, layer)
        del state
        shutil.rmtree(tmp / "weights", ignore_errors=True)
        lineage = {k: params[k] for k in lin.VERSION_TAG_PARAMS if k in params}
        if step is not None:
            lineage["checkpoint.step"] = str(step)
        lineage["verifier.name_or_path"] = serving_id(cfg, params)
        model.config.speculators_config.verifier.name_or_path = lineage["verifier.name_or_path"]
        lineage.update({"finetune.run_id": ft_id, "ttt_steps": params.get("ttt_steps", "3")})
        from draftline.evaluation.stage import attach, evaluations_for

        evaluated = evaluations_for(client, ft_id, step)
        from draftline.registry.policies import policy_set

        found = recommended_k(evaluated, policy_set())
        k = found[0] if found else None
        if found:  # measured: vLLM reads num_speculative_tokens from here, and pull prints the same
            model.config.speculators_config.proposal_methods[0].speculative_tokens = k
            lineage["eval.recommended_num_speculative_tokens"] = str(k)
            lineage["eval.recommended_num_speculative_tokens.set"] = found[1]
        out = tmp / "drafter"
        try:
            with _room_in_tmp(out):
                write_drafter(model, out, lineage, metrics)
        except OSError as e:
            raise DraftlineError(f"cannot write the export to {e.filename or out} ({e.strerror}): point TMPDIR "
                                 "at a writable directory") from None
        validate(model, out, verifier_path=local_verifier(params))
        vllm_check = check_in_vllm(cfg.vllm_check, out, local_verifier(params), k or int(params.get("ttt_steps", 3)))
        tracking.log_params_once({"export.layout": cfg.layout, "export.registered_model": cfg.registered_model,
                                  "export.checkpoint": cfg.checkpoint, "export.vllm_check": vllm_check,
                                  **{k: v for k, v in lineage.items() if k != "ttt_steps"}})
        # the drafter is an MLflow 3 LoggedModel: lineage as its params, the finetune run's metrics on it
        logged = mlflow.initialize_logged_model(
            name=lin.logged_model_name(cfg.registered_model), source_run_id=active.info.run_id,
            model_type="eagle3-drafter", params={k: str(v) for k, v in lineage.items()},
            tags={"draftline.kind": "drafter", "draftline.finetune.run_id": ft_id})
        try:
            with _room_in_store(logged.artifact_location):
                manifest = upload_with_checksums(out, logged.model_id)
                export_sha = export_digest(manifest)
            if cfg.layout == "midlayer":
                with _room_in_tmp(tmp / "midlayer"):
                    write_midlayer(model, tmp / "midlayer", params)
                from draftline.export.midlayer import check_reload  # init=<that dir> gives these weights

                check_reload(model, tmp / "midlayer", local_verifier(params))
                with _room_in_store(f"{active.info.artifact_uri}/midlayer"):
                    mlflow.log_artifacts(str(tmp / "midlayer"), artifact_path="midlayer")
            last = int(params.get("train.steps", 0))
            for key, v in metrics.items():  # the finetune run's final values, attached to the model
                client.log_metric(active.info.run_id, key, v, step=last, model_id=logged.model_id)
            attach(evaluated, logged.model_id)  # evaluations of this checkpoint, linked to their data sets
            mlflow.set_logged_model_tags(logged.model_id, {"export.sha256": export_sha, "export.validated": "true"})
            mlflow.finalize_logged_model(logged.model_id, "READY")
        except BaseException:
            with contextlib.suppress(Exception):
                mlflow.finalize_logged_model(logged.model_id, "FAILED")
            raise
        tags = {**lineage, "export.sha256": export_sha, "export.validated": "true", "export.vllm_check": vllm_check,
                "export.run_id": active.info.run_id, **versions.checksums_tag(manifest),
                **{f"metric.{k}": f"{v:.4f}" for k, v in metrics.items()}}
        mlflow.set_tags({"export.sha256": export_sha, "export.validated": "true",
                         "draftline.model_id": logged.model_id})
        description = versions.describe(lineage)
        version = versions.register(client, cfg.registered_model, model_id=logged.model_id,
                                    run_id=active.info.run_id, tags=tags, description=description)
        mlflow.set_tags({"draftline.model_version": f"models:/{cfg.registered_model}/{version.version}",
                         "mlflow.runName": f"export → {cfg.registered_model} v{version.version}",
                         "mlflow.note.content": description})
    return {"run_id": active.info.run_id, "model_uri": f"models:/{cfg.registered_model}/{version.version}",
            "version": str(version.version)}


def check_in_vllm(mode: str, out: Path, verifier_dir: str, k: int) -> str:
    """Load the export in real vLLM beside the verifier and draft with it (``mode`` auto|on|off); what happened,
    in words, for the ``export.vllm_check`` tag. A refusal by vLLM raises, naming vLLM's own error."""
    from draftline.console import say
    from draftline.serving.engine import vllm_python

    if mode == "off":
        return "off"
    python = vllm_python(required=mode == "on")
    if python is None:
        return "skipped: no vLLM venv (./setup.sh --vllm)"
    from draftline.serving.checks import check_serves
    from draftline.serving.engine import EngineError

    say(f"[draftline] loading the export in vLLM beside {verifier_dir} (k={k}) ...")
    try:
        found = check_serves(out, verifier_dir, k=k, python=python)
    except EngineError as e:
        raise CheckpointError(f"export validation failed: vLLM refuses this drafter ({e}); nothing was "
                              "registered") from None
    say(f"[draftline] vLLM served the export: {found['drafts']} drafts in {found['seconds']} s")
    return f"passed: {found['drafts']} drafts, acceptance length {found['acceptance_length']} on probe prompts"


def recommended_k(evaluated: list[dict], preferred_set: str | None = None) -> tuple[int, str] | None:
    """``(num_speculative_tokens, the evaluation set it came from)``: from the measured evaluation on
    ``preferred_set`` (the set the Production policy judges by: a name or a digest prefix) when there is one,
    else from the newest measured evaluation."""
    from draftline.registry.evidence import RECOMMENDED_K

    measured = [r for r in evaluated if RECOMMENDED_K in r["metrics"]]
    on_set = [r for r in measured if preferred_set and (r["data"]["name"] == preferred_set or (
        len(preferred_set) >= 8 and r["data"]["digest"].startswith(preferred_set)))]
    for result in on_set or measured:
        return int(result["metrics"][RECOMMENDED_K]), result["data"]["name"]
    return None


def export_digest(manifest: dict[str, str]) -> str:
    """One sha256 naming the whole export: over the sorted (file, sha256) pairs (what pulls check)."""
    from draftline.registry.transfer import manifest_digest_of

    return manifest_digest_of(manifest)

