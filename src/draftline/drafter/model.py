"""Build speculators' ``Eagle3DraftModel`` for a verifier, pack samples into its inputs, and read its metrics."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from speculators.models.eagle3 import Eagle3DraftModel, shift_batch
from tqdm.auto import trange
from transformers import AutoConfig

from draftline.console import bar_kwargs
from draftline.drafter import (
    attention,  # noqa: F401  (registers the blockwise draft attention with transformers)
    mla,  # noqa: F401  (registers the MLA decoder layer with speculators)
)
from draftline.drafter.batches import batch_plan, batches
from draftline.drafter.fast_ops import bf16_argmax_by_max
from draftline.drafter.form import split as split_form
from draftline.drafter.layer_kinds import VERIFIER_ONLY_KEYS
from draftline.drafter.loss import kl_div
from draftline.drafter.shape import layer_config
from draftline.drafter.walk import walk_sums
from draftline.serving.hf_model import is_trusted, load_config

DEFAULT_DTYPE = torch.bfloat16


LAYER_FILE = "layer_config.json"  # beside the DeepSpeed checkpoint: the layer the run trained


def meta_drafter(config, *, dtype: torch.dtype | None = None, attn: str = "sdpa") -> Eagle3DraftModel:
    """The ``Eagle3DraftModel`` ``config`` describes, built on the meta device: shapes and parameter counts with
    no weight allocated and no verifier read; ``dtype`` the dtype its floating tensors get (default: torch's);
    ``attn`` the draft attention (any works on meta; the ranks build with ``sdpa``). ``config`` is not changed."""
    config = copy.deepcopy(config)
    config.transformer_layer_config._attn_implementation = attn  # noqa: SLF001
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous)
    try:
        with torch.device("meta"):
            return Eagle3DraftModel(config)
    finally:
        torch.set_default_dtype(previous)

def build_draft_model(verifier_name_or_path: str, *, d2t: torch.Tensor, t2d: torch.Tensor,
                      aux_layer_ids: list[int], draft_vocab_size: int, ttt_steps: int = 3,
                      attn_impl: str = "sdpa", dtype: torch.dtype = DEFAULT_DTYPE,
                      norm_before_residual: bool = False, layer: dict | None = None):
    """A fresh drafter (random trainable weights, verifier embeddings and lm_head rows), cast to ``dtype``.

    ``layer`` is the decoder layer config (:func:`draftline.drafter.shape.layer_config`; default: the verifier's own, with one layer),
    with the EAGLE form it carries (:mod:`draftline.drafter.form`; none: 3.0).
    ``sdpa``/``eager`` attention train on the CPU, where speculators' default flex attention does not.
    """
    # a hand-off written before layer_config dropped them may still carry the verifier's quantization
    layer, eagle = split_form(layer or layer_config(verifier_name_or_path))
    layer = {k: v for k, v in layer.items() if k not in VERIFIER_ONLY_KEYS}
    layer_cfg = AutoConfig.for_model(layer.pop("model_type"), **layer)
    load_config(verifier_name_or_path)  # a trusted custom config class, registered for speculators' own reads
    model: torch.nn.Module = Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=verifier_name_or_path,
        target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        fc_norm=eagle.fc_norm,  # EAGLE 3.1 (drafter/form.py); speculators' TTT loop feeds the post-norm state on
        norm_output=eagle.norm_output,
        ttt_steps=ttt_steps,
        draft_attn_impl=attn_impl,
        trust_remote_code=is_trusted(verifier_name_or_path),
    )
    return model.to(dtype)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


PAIRING = "vllm-shifted"  # recorded as the ``train.pairing`` param and version tag (docs/design.md: the pairing)


def pack(records: Sequence[Mapping[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Pack samples, each shifted into the pairing vLLM serves, into one ``[1, total]`` sequence (no padding).

    Every sample first goes through speculators' own ``shift_batch``, as its trainer does: the verifier's hidden
    state at *t* is paired with the token at *t+1* and the verifier's last hidden state at *t+1* (whose argmax
    is the token at *t+2*, the one vLLM's proposer drafts); positions start at 1, as speculators sets them.
    Captured data stays unshifted on disk; this is the one place the shift happens.
    """
    shifted = [shift_batch({**r, "lengths": torch.tensor([r["input_ids"].numel()]),
                            "position_ids": torch.arange(r["input_ids"].numel())}) for r in records]
    cat = lambda key: torch.cat([s[key] for s in shifted]).unsqueeze(0).to(device)  # noqa: E731
    lengths = torch.cat([s["lengths"] for s in shifted])
    return {
        "input_ids": cat("input_ids"),
        "loss_mask": cat("loss_mask"),
        "hidden_states": cat("hidden_states"),
        "verifier_last_hidden_states": cat("verifier_last_hidden_states"),
        "position_ids": cat("position_ids"),
        "document_ids": torch.repeat_interleave(torch.arange(len(lengths)), lengths).unsqueeze(0).to(device),
    }


def loss_config():
    """speculators' ``kl_div`` loss, its gradient made in one pass (:mod:`draftline.drafter.loss`: speculators'
    fused kernel does not train on a CPU, its eager one walks back through every intermediate)."""
    return {"kl_div": (kl_div, 1.0)}


def forward(model, batch: dict[str, torch.Tensor], ttt_steps: int, loss_cfg=None, ttt_loss_decay: float = 1.0,
            walk: bool = False):
    """``(loss, metrics)``; metrics are speculators' ``*_sum``/``*_total`` pairs. Draft position k's loss
    weighs ``ttt_loss_decay ** k`` (speculators' ``ttt_step_loss_decay``; the metrics are unweighted). With
    ``walk`` the metrics also carry the sums of vLLM's walk over the same drafts (:mod:`draftline.drafter.walk`)."""
    with bf16_argmax_by_max():  # speculators' nine argmaxes a step (drafter/fast_ops.py)
        drafts, loss, metrics = model(**batch, ttt_steps=ttt_steps, ttt_step_loss_decay=ttt_loss_decay,
                                      loss_config=loss_cfg or loss_config())
    if walk:
        metrics = {**metrics, **walk_sums(drafts, batch, model.d2t, ttt_steps)}
    return loss, metrics


def trained_shares(packs: Sequence[dict[str, torch.Tensor]]) -> list[float]:
    """Each micro-batch's share of the step's trained tokens (``loss_mask``). speculators' loss is a mean over a
    batch's trained tokens, so the micro-batches' losses weighted by these shares sum to the whole batch's loss,
    and their gradients to its gradient, wherever each sample starts with untrained (prompt) tokens, as chat
    samples do: the draft positions' shifted masks then lose no trained token at a micro-batch's edge."""
    counts = [float(p["loss_mask"].sum()) for p in packs]
    total = sum(counts)
    return [c / total if total else 1.0 / len(counts) for c in counts]


def add_hidden_noise(hidden: torch.Tensor, std: float, layers: int) -> torch.Tensor:
    """EAGLE's augmentation: Gaussian noise on the verifier's hidden states, ``std`` times each aux layer's
    per-token RMS (the layers differ in scale by orders of magnitude), so the drafter learns to draft from
    features a little off the ones it was trained on, as its own drafts are at serving time."""
    parts = hidden.unflatten(-1, (layers, -1))
    rms = parts.float().pow(2).mean(-1, keepdim=True).sqrt()
    noisy = parts.float() + torch.randn(parts.shape, dtype=torch.float32, device=hidden.device) * rms * std
    return noisy.to(hidden.dtype).flatten(-2)


def summarise(sums: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """Turn summed ``*_sum``/``*_total`` pairs into the metrics we log, plus the simulated acceptance length
    ``1 + sum_k prod_{j<=k} cond_acc_j`` (averaged over every reply position) and, where the walk's sums are
    there, ``walk_acceptance_length`` (averaged over the drafts vLLM would make)."""
    out: dict[str, float] = {}
    for key, value in sums.items():
        if key.endswith("_sum"):
            base = key[: -len("_sum")]
            total = sums.get(base + "_total", 0.0)
            if total:
                out[base] = value / total
    out["loss"] = out.pop("loss", float("nan"))
    acc, prod = 1.0, 1.0
    for k in range(ttt_steps):
        prod *= out.get(f"cond_acc_{k}", 0.0)
        acc += prod
    out["acceptance_length"] = acc
    if "walk_accepted" in out:  # vLLM's walk over the same drafts (drafter/walk.py): what serving would report
        out["walk_acceptance_length"] = 1.0 + out.pop("walk_accepted")
    return out


def accumulate(into: dict[str, float], metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    for k, v in metrics.items():
        into[k] = into.get(k, 0.0) + float(v.detach().float().sum())
    return into


@torch.no_grad()
def metric_sums(model, records: Sequence[Mapping[str, torch.Tensor]], *, ttt_steps: int, tokens_per_batch: int,
                dtype: torch.dtype, device: torch.device | str = "cpu", loss_cfg=None, rank: int = 0,
                world: int = 1, progress: bool = False) -> dict[str, float]:
    """Summed ``*_sum``/``*_total`` metrics of ``model`` over ``records`` in fixed token-budget chunks (the same
    chunks on every call): validation and evaluation both read a drafter through this. With ``world`` > 1 rank
    ``rank`` takes every ``world``-th chunk, and every rank runs the same number of forwards (ZeRO-3 gathers
    parameters collectively); a rank's surplus forward, on chunk 0, is not counted. :func:`summarise` the
    (all-reduced) sums."""
    model.eval()
    lengths = [int(r["input_ids"].numel()) for r in records]
    chunks = sorted(batch_plan(lengths, tokens_per_batch, seed=0, epoch=0))
    cfg = loss_cfg or loss_config()
    sums: dict[str, float] = {}
    for i in trange(-(-len(chunks) // world), desc="teacher-forced", unit="batch", **bar_kwargs(progress)):
        idx = i * world + rank
        batch = pack([records[j] for j in chunks[idx if idx < len(chunks) else 0]], device)
        for key in ("hidden_states", "verifier_last_hidden_states"):
            batch[key] = batch[key].to(dtype)
        _, metrics = forward(model, batch, ttt_steps, cfg, walk=True)
        # a surplus forward adds zeros under the same keys: every rank all-reduces a tensor of the same length
        accumulate(sums, metrics if idx < len(chunks) else {k: v * 0 for k, v in metrics.items()})
    return sums


def train_steps_in_process(model, records: Sequence[Mapping[str, torch.Tensor]], *, steps: int, lr: float,
                           ttt_steps: int = 3, tokens_per_batch: int = 2048, seed: int = 0,
                           progress: bool = False, callback=None, callback_every: int = 0) -> dict[str, float]:
    """A bare PyTorch AdamW loop (one process, no DeepSpeed): the tiny parent's trainer and the benchmark floor.
    ``callback(step)`` runs every ``callback_every`` steps (evaluation in benchmarks)."""
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    cfg = loss_config()
    model.train()
    it = batches(records, tokens_per_batch, seed=seed)
    last: dict[str, float] = {}
    dtype = params[0].dtype
    for step in trange(1, steps + 1, desc="train", **bar_kwargs(progress)):
        batch = pack(next(it))
        for key in ("hidden_states", "verifier_last_hidden_states"):
            batch[key] = batch[key].to(dtype)
        loss, metrics = forward(model, batch, ttt_steps, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        last = summarise(accumulate({}, metrics), ttt_steps)
        if callback is not None and callback_every and step % callback_every == 0:
            callback(step)
    model.eval()
    return last
