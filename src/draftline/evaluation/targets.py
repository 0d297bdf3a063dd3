"""What ``draftline evaluate`` measures: a drafter named the way ``init`` names a parent (catalog name,
directory, cached HF repo id, ``models:/NAME/K|Stage|@alias``) or a finetune run (``runs:/<id>`` or its id),
found on local disk, with the MLflow LoggedModel its results attach to and its identity."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from mlflow.exceptions import MlflowException

from draftline import names, tracking
from draftline.drafter.aux_ids import aux_layer_ids, served_aux_fields
from draftline.drafter.checkpoints import detect_layout, find_checkpoint, read_header
from draftline.drafter.handoff import fetch_weights, write_weights
from draftline.drafter.loading import load_drafter as load
from draftline.drafter.model import LAYER_FILE
from draftline.drafter.parents import aux_reads, resolve_init
from draftline.errors import DataError
from draftline.mlflow_errors import absent, raise_failure
from draftline.registry import lineage
from draftline.tracking import parse_run_ref
from draftline.util import files_digest


@dataclass
class Target:
    ref: str  # as the user gave it
    kind: str  # finetune-run | registered | external
    name: str  # for people: run, models:/NAME/K, catalog name or directory
    path: Path  # directory holding the weights
    sha256: str  # over the weight files (what lineage records as parent.sha256)
    layout: str
    model_id: str | None = None  # the LoggedModel results attach to (none for a finetune run: export carries them)
    run_id: str | None = None  # the finetune run, for kind finetune-run
    step: int | None = None  # its checkpoint's step
    layer: dict | None = None  # its decoder layer, when the run recorded it


def _finetune_run(client, ref: str):
    """The finetune run ``ref`` names (``runs:/<id>[/...]`` or a bare run id), or None when it names none."""
    if ref.startswith("runs:/"):
        run_id = parse_run_ref(ref)[0]
    elif re.fullmatch(r"[0-9a-f]{32}", ref):
        run_id = ref
    else:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read run {run_id} (--target)", "READ permission on its experiment")
        raise DataError(f"target {ref}: run {run_id} does not exist on this tracking server") from None
    if run.data.tags.get(names.STEP) != "finetune" or run.info.status != "FINISHED":
        raise DataError(f"target {ref} is not a finished finetune run (step {run.data.tags.get(names.STEP)}, "
                        f"status {run.info.status}): pass a finetune run, a models:/ URI or a parent")
    return run


def resolve_target(ref: str, *, cache: Path, checkpoint: str, experiment_id: str, aux_convention: str = "auto",
                   verifier_layers: int | None = None) -> Target:
    """Find ``ref`` on local disk (downloading from MLflow where it lives there). A parent whose aux-layer ids
    name layer outputs (``aux_convention`` sglang, or its catalog's) is given as a copy whose config names the
    same layers as vLLM counts them (its weights linked), so that vLLM and the in-process chain read the layers
    it was trained on."""
    client = tracking.client()
    run = _finetune_run(client, ref.strip())
    if run is not None:
        dest = cache / "evaluate" / run.info.run_id / checkpoint
        shutil.rmtree(dest, ignore_errors=True)  # a resumed run may have moved on since the last evaluation
        where, state, step = fetch_weights(run, checkpoint, dest / "fetched", load_state=False)
        layer_file = where / LAYER_FILE
        layer = json.loads(layer_file.read_text()) if layer_file.is_file() else None
        if state is not None:  # consolidated from a ZeRO checkpoint: written once, as a hand-off would be
            write_weights(state, dest / "weights", layer=layer, selected={"step": step, "selected": checkpoint})
            del state
            shutil.rmtree(dest / "fetched", ignore_errors=True)
            where = dest / "weights"
        files = find_checkpoint(where)
        return Target(ref=ref, kind="finetune-run", name=f"runs:/{run.info.run_id} ({checkpoint}, step {step})",
                      path=where, sha256=files_digest(files.weights), layout="speculators",
                      run_id=run.info.run_id, step=step, layer=layer)
    parent = resolve_init(ref, cache=cache)
    if parent.is_random:
        raise DataError("target random is not a drafter: pass a finetune run, a models:/ URI or a parent")
    assert parent.path is not None  # resolve_init gives every parent but random a local directory
    files = find_checkpoint(parent.path)
    layout = detect_layout(read_header(files))
    sha = files_digest(files.weights)
    path = _as_vllm_counts(parent, files.config or {}, aux_convention, verifier_layers, cache / "evaluate" /
                           f"parent-{sha[:16]}")
    model_id = lineage.parent_model_id(client, parent, sha256=sha, layout=layout, experiment_id=experiment_id)
    return Target(ref=ref, kind="registered" if parent.model_version else "external",
                  name=parent.model_version or parent.name, path=path, sha256=sha, layout=layout,
                  model_id=model_id)


def _as_vllm_counts(parent, config: dict, asked: str, layers: int | None, dest: Path) -> Path:
    """The parent's directory, or (ids in the sglang convention) a copy of it whose config names the layers as
    vLLM counts them."""
    own = aux_layer_ids(config)
    if not own or parent.path is None:
        return parent.path
    convention, ids = aux_reads(parent, config, asked, layers if layers is not None else max(own) + 1)
    if convention == "vllm" or ids is None:
        return parent.path
    # named by what it holds (the weights' digest and the ids), made aside and renamed into place: two
    # evaluations of one parent share it, and neither sees the other's half-made copy
    dest = dest.with_name(f"{dest.name}-aux{'-'.join(map(str, ids))}")
    if dest.is_dir():
        if all(f.exists() for f in dest.iterdir()):  # every link still reaches its file
            return dest
        shutil.rmtree(dest, ignore_errors=True)  # a copy whose parent files moved away
    dest.parent.mkdir(parents=True, exist_ok=True)
    made = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    for f in parent.path.iterdir():
        if f.name != "config.json":
            (made / f.name).symlink_to(f.resolve())
    nested = {**(config.get("eagle_config") or {}), **served_aux_fields(ids)["eagle_config"]}
    (made / "config.json").write_text(json.dumps({**config, **served_aux_fields(ids), "eagle_config": nested},
                                                 indent=2) + "\n")
    try:
        made.rename(dest)
    except OSError:  # another evaluation put the same copy in place first
        shutil.rmtree(made, ignore_errors=True)
    return dest


def load_drafter(target: Target, verifier: str, aux_layer_ids: list[int], *, ttt_steps: int,
                 dtype: torch.dtype = torch.float32):
    """Build the drafter for ``verifier`` and copy ``target``'s weights in (strict keys and shapes), the same
    path finetune loads a parent by."""
    return load(verifier, target.path, aux_layer_ids=aux_layer_ids, layer=target.layer, ttt_steps=ttt_steps,
                dtype=dtype, name=target.name)
