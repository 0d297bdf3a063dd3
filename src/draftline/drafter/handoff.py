"""The weights-only hand-off from finetune to export and evaluate.

Ranks keep two DeepSpeed checkpoints in the run's work directory (``checkpoints/``): the newest (``step<N>``,
named by DeepSpeed's ``latest`` file, for ``--resume``) and the best by ``val/acceptance_length`` (tag
``best``, with ``best.json`` saying its step and value). At the end of finetune the launching process
consolidates the selected one with DeepSpeed's own tool and logs only the drafter's weights, bf16
safetensors, as the run's ``weights/`` artifacts (``model.safetensors``, ``layer_config.json``,
``selection.json``): no fp32 master weights, no Adam moments. The ZeRO checkpoints are logged too only with
``--log-checkpoints``.

Export and evaluate read ``weights/``. Another checkpoint (``--checkpoint last`` when the best was logged, or
``step<N>``) is consolidated from the work directory on the training host, or from logged checkpoints.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path
from typing import Literal, overload

import torch
from safetensors.torch import load_file, save_file

from draftline import tracking
from draftline.config import work_dir
from draftline.console import verbose
from draftline.drafter.checkpoints import VERIFIER_OWNED
from draftline.drafter.model import LAYER_FILE
from draftline.errors import CheckpointError
from draftline.util import atomic_write_text

BEST_TAG = "best"
BEST_FILE = "best.json"
WEIGHTS = "weights"  # the run's artifact folder
SELECTION_FILE = "selection.json"
WEIGHTS_FILE = "model.safetensors"
TAG_PREFIX = "draftline.checkpoint."  # run tags: selected, step, last_step, best_step


def read_best(ckpt_dir: Path) -> dict | None:
    """``{"step", "metric", "value"}`` of the best checkpoint so far, or None."""
    path = Path(ckpt_dir) / BEST_FILE
    if not path.is_file() or not (Path(ckpt_dir) / BEST_TAG).is_dir():
        return None
    return json.loads(path.read_text())


def write_best(ckpt_dir: Path, best: dict) -> None:
    atomic_write_text(Path(ckpt_dir) / BEST_FILE, json.dumps(best, indent=2) + "\n")


def last_step(ckpt_dir: Path) -> int | None:
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    m = re.fullmatch(r"step(\d+)", latest.read_text().strip())
    return int(m.group(1)) if m else None


def selection(ckpt_dir: Path) -> dict:
    """Which checkpoint finetune hands on: the best by validation when there is one, else the newest."""
    last = last_step(ckpt_dir)
    if last is None:
        raise CheckpointError(f"{ckpt_dir} holds no DeepSpeed checkpoint (no 'latest' file)")
    best = read_best(ckpt_dir)
    if best is not None:
        return {"selected": "best", "step": best["step"], "tag": BEST_TAG, "last_step": last, "best": best}
    return {"selected": "last", "step": last, "tag": f"step{last}", "last_step": last, "best": None}


def consolidate(ckpt_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation (any ZeRO stage, any rank count) of checkpoint ``tag`` (default: the
    newest)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    if not (Path(ckpt_dir) / "latest").is_file() and tag is None:
        raise CheckpointError(f"{ckpt_dir} holds no DeepSpeed checkpoint (no 'latest' file)")
    if tag is not None and not (Path(ckpt_dir) / tag).is_dir():
        raise CheckpointError(f"{ckpt_dir} holds no DeepSpeed checkpoint {tag}")

    # DeepSpeed prints its progress to stdout and a bar to stderr: shown with -v only
    sink = sys.stderr if verbose() else io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)


def write_weights(state: dict[str, torch.Tensor], out: Path, *, layer: dict | None, selected: dict) -> Path:
    """The drafter's own tensors (not the verifier's embeddings and head) as bf16 safetensors, with the layer
    config and what was selected."""
    out.mkdir(parents=True, exist_ok=True)
    kept = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
            for k, v in state.items() if k not in VERIFIER_OWNED}
    save_file(kept, str(out / WEIGHTS_FILE), metadata={"format": "pt", "step": str(selected["step"])})
    if layer is not None:
        (out / LAYER_FILE).write_text(json.dumps(layer, indent=2, sort_keys=True) + "\n")
    (out / SELECTION_FILE).write_text(json.dumps(selected, indent=2, sort_keys=True) + "\n")
    return out


def run_tags(selected: dict) -> dict[str, str]:
    best = selected.get("best") or {}
    return {f"{TAG_PREFIX}selected": selected["selected"], f"{TAG_PREFIX}step": str(selected["step"]),
            f"{TAG_PREFIX}last_step": str(selected["last_step"]),
            f"{TAG_PREFIX}best_step": str(best.get("step", "none"))}


def _wanted_step(tags: dict[str, str], which: str) -> int | None:
    if which == "best":
        best = tags.get(f"{TAG_PREFIX}best_step", "none")
        return int(best) if best.isdigit() else None
    if which == "last":
        last = tags.get(f"{TAG_PREFIX}last_step", "")
        return int(last) if last.isdigit() else None
    m = re.fullmatch(r"step(\d+)", which)
    if not m:
        raise CheckpointError(f"checkpoint {which!r} is not best, last or step<N>")
    return int(m.group(1))


@overload
def fetch_weights(run, which: str, dest: Path, *, load_state: Literal[True] = True
                  ) -> tuple[Path, dict[str, torch.Tensor], int | None]: ...


@overload
def fetch_weights(run, which: str, dest: Path, *, load_state: bool
                  ) -> tuple[Path, dict[str, torch.Tensor] | None, int | None]: ...


def fetch_weights(run, which: str, dest: Path, *, load_state: bool = True
                  ) -> tuple[Path, dict[str, torch.Tensor] | None, int | None]:
    """The finetune ``run``'s drafter weights for ``which`` (best | last | step<N>):
    ``(directory with layer_config.json or None, state dict, step)``. With ``load_state=False`` the state is
    None where the run handed these weights on as a file (the directory then holds them, ready to read)."""
    tags = run.data.tags
    run_id = run.info.run_id
    logged_step = tags.get(f"{TAG_PREFIX}step")
    if logged_step is None:  # a run from before the hand-off: its newest ZeRO checkpoint was logged
        if which not in ("best", "last"):
            raise CheckpointError(f"run {run_id} logged only its newest checkpoint: pass --checkpoint last")
        ckpt = tracking.download(f"{run.info.artifact_uri}/checkpoints", dest)
        return ckpt, consolidate(ckpt), None
    want = _wanted_step(tags, which)
    if which == "best" and want is None:
        want = int(logged_step)  # no validation ran: the newest is all there is
    if want is not None and str(want) == logged_step:
        weights = tracking.download(f"{run.info.artifact_uri}/{WEIGHTS}", dest)
        return weights, load_file(str(weights / WEIGHTS_FILE)) if load_state else None, want
    tag = BEST_TAG if which == "best" or str(want) == tags.get(f"{TAG_PREFIX}best_step") else f"step{want}"
    for where in (work_dir() / run_id / "checkpoints", None):
        if where is None:
            try:
                where = tracking.download(f"{run.info.artifact_uri}/checkpoints", dest)
            except Exception:  # noqa: BLE001
                break
        if (where / tag).is_dir():
            return where, consolidate(where, tag), want
    kept = f"best (step {tags.get(TAG_PREFIX + 'best_step')}) and last (step {tags.get(TAG_PREFIX + 'last_step')})"
    raise CheckpointError(f"run {run_id} handed on the weights of step {logged_step}; checkpoint {which} "
                          f"(step {want}) is only in its ZeRO checkpoints ({kept} are kept in "
                          f"{work_dir() / run_id / 'checkpoints'} on the training host, and logged with "
                          "--log-checkpoints): run this there, or pass --checkpoint best")
