"""Capture the verifier's hidden states with transformers: the aux layers and the last hidden state.

Layer id ``i`` is the input of decoder layer ``i`` (``hidden_states[i]`` in transformers' tuple, the residual
stream vLLM hands EAGLE-3). The last hidden state is taken *before* the final norm (a pre-hook on
``model.norm``), because transformers returns it after the norm and EAGLE-3 applies the verifier norm itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator

import torch
from tqdm.auto import tqdm

from draftline.console import bar_kwargs
from draftline.data.tokenize import TokenizedSample


def _final_norm(verifier) -> torch.nn.Module:
    base = getattr(verifier, "model", verifier)
    norm = getattr(base, "norm", None)
    if norm is None:
        raise TypeError(f"{type(verifier).__name__} has no model.norm; cannot capture the pre-norm last hidden state")
    return norm


@torch.inference_mode()
def iter_hidden_states(verifier, samples: Iterable[TokenizedSample], aux_layer_ids: list[int],
                       batch_size: int = 8) -> Iterator[dict[str, torch.Tensor]]:
    """Yield one record per sample: ``input_ids``, ``loss_mask``, ``hidden_states`` [T, aux*H] and
    ``verifier_last_hidden_states`` [T, H], hidden states in bf16."""
    captured: list[torch.Tensor] = []
    handle = _final_norm(verifier).register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    device = next(verifier.parameters()).device
    try:
        batch: list[TokenizedSample] = []
        for s in samples:
            batch.append(s)
            if len(batch) == batch_size:
                yield from _run_batch(verifier, batch, aux_layer_ids, captured, device)
                batch = []
        if batch:
            yield from _run_batch(verifier, batch, aux_layer_ids, captured, device)
    finally:
        handle.remove()


def _one_logit(verifier) -> dict:
    """``logits_to_keep=1`` where the verifier takes it: the hidden states are all capture needs, and full
    logits cost batch x length x vocabulary floats (1.6 GB for 8 x 1000 tokens of a 49 152-token vocabulary)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(verifier.forward).parameters else {}


def _run_batch(verifier, batch, aux_layer_ids, captured, device):
    longest = max(len(s.input_ids) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    attn = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[i, : len(s.input_ids)] = 1
    captured.clear()
    out = verifier(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True,
                   **_one_logit(verifier))
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    last = captured[-1]
    for i, s in enumerate(batch):
        n = len(s.input_ids)
        yield {
            "input_ids": torch.tensor(s.input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(s.loss_mask, dtype=torch.bool),
            "hidden_states": aux[i, :n].to(torch.bfloat16).cpu(),
            "verifier_last_hidden_states": last[i, :n].to(torch.bfloat16).cpu(),
        }


def capture_hidden_states(verifier, samples, aux_layer_ids, batch_size: int = 8, progress: bool = False):
    """All records as a list (for small data; ``prepare`` streams them into shards instead)."""
    samples = list(samples)
    it = iter_hidden_states(verifier, samples, aux_layer_ids, batch_size)
    return list(tqdm(it, total=len(samples), desc="hidden states", unit="sample", **bar_kwargs(progress)))
