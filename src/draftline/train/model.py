"""Build speculators' ``Eagle3DraftModel`` for a verifier, pack samples into its inputs, and read its metrics."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

DEFAULT_DTYPE = torch.bfloat16


def build_draft_model(verifier_name_or_path: str, *, d2t: torch.Tensor, t2d: torch.Tensor,
                      aux_layer_ids: list[int], draft_vocab_size: int, ttt_steps: int = 3,
                      attn_impl: str = "sdpa", dtype: torch.dtype = DEFAULT_DTYPE,
                      norm_before_residual: bool = False):
    """A fresh drafter (random trainable weights, verifier embeddings and lm_head rows), cast to ``dtype``.

    The transformer layer config is the verifier's with one layer, as EAGLE-3 prescribes; ``sdpa``/``eager``
    attention train on the CPU, where speculators' default flex attention does not.
    """
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    verifier_config = AutoConfig.from_pretrained(verifier_name_or_path)
    verifier_config = getattr(verifier_config, "text_config", verifier_config)
    layer_config = copy.deepcopy(verifier_config)
    layer_config.num_hidden_layers = 1
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=verifier_name_or_path,
        target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        ttt_steps=ttt_steps,
        draft_attn_impl=attn_impl,
    )
    return model.to(dtype)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def pack(records: Sequence[dict[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Pack samples into one ``[1, total]`` sequence with per-document positions and ids (no padding)."""
    cat = lambda key: torch.cat([r[key] for r in records]).unsqueeze(0).to(device)  # noqa: E731
    lengths = [int(r["input_ids"].numel()) for r in records]
    return {
        "input_ids": cat("input_ids"),
        "loss_mask": cat("loss_mask"),
        "hidden_states": cat("hidden_states"),
        "verifier_last_hidden_states": cat("verifier_last_hidden_states"),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device),
        "document_ids": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        .unsqueeze(0).to(device),
    }


def loss_config():
    from speculators.losses import resolve_loss_config

    # The eager KL loss: speculators' fused loss does not train on the CPU.
    return resolve_loss_config("kl_div", "eager")


def forward(model, batch: dict[str, torch.Tensor], ttt_steps: int, loss_cfg=None):
    """``(loss, metrics)``; metrics are speculators' ``*_sum``/``*_total`` pairs."""
    _, loss, metrics = model(**batch, ttt_steps=ttt_steps, loss_config=loss_cfg or loss_config())
    return loss, metrics


def summarise(sums: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """Turn summed ``*_sum``/``*_total`` pairs into the metrics we log, plus the simulated acceptance length
    ``1 + sum_k prod_{j<=k} cond_acc_j``."""
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
    return out


def accumulate(into: dict[str, float], metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    for k, v in metrics.items():
        into[k] = into.get(k, 0.0) + float(v.detach().float().sum())
    return into


def train_steps_in_process(model, records: Sequence[dict[str, torch.Tensor]], *, steps: int, lr: float,
                           ttt_steps: int = 3, tokens_per_batch: int = 2048, seed: int = 0,
                           progress: bool = False, callback=None, callback_every: int = 0) -> dict[str, float]:
    """A bare PyTorch AdamW loop (one process, no DeepSpeed): the tiny parent's trainer and the benchmark floor.
    ``callback(step)`` runs every ``callback_every`` steps (evaluation in benchmarks)."""
    from tqdm.auto import trange

    from draftline.train.batches import batches

    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    cfg = loss_config()
    model.train()
    it = batches(records, tokens_per_batch, seed=seed)
    last: dict[str, float] = {}
    dtype = params[0].dtype
    for step in trange(1, steps + 1, desc="train", disable=not progress):
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
