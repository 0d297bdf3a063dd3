"""The SGLang/SpecForge (``midlayer``) layout of an export, validated by reading it back through the parent-loading
path: what ``finetune init=<that directory>`` would build (the decoder layer from the exported ``config.json``,
the drafter on the meta device, the strict ``midlayer.`` -> ``layers.0.`` key and shape match) must receive
bit-identical weights, and the layer it describes must be the exported drafter's (head_dim, rope base, sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from draftline import names
from draftline.drafter.aux_ids import served_aux_fields
from draftline.drafter.checkpoints import (
    _iter_tensors,
    detect_layout,
    find_checkpoint,
    match_keys,
    read_header,
    to_midlayer_layout,
)
from draftline.drafter.form import EagleForm, of_checkpoint, with_form
from draftline.drafter.shape import aux_layer_ids, layer_config, rope_theta, specforge_config
from draftline.errors import CheckpointError
from draftline.train.preflight import drafter_shapes

LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "hidden_act")


def check_reload(model, out: Path, verifier: str) -> dict[str, int]:
    """Raise :class:`CheckpointError` unless ``out`` loads back as a parent with ``model``'s exact weights.
    ``verifier``: where the verifier's config lies on this host. Returns ``{"tensors": n}``."""
    files = find_checkpoint(out)
    header = read_header(files)
    if detect_layout(header) != "midlayer":
        raise CheckpointError(f"export validation failed: {out} is not in the midlayer layout")
    aux = aux_layer_ids(files.config)
    # as finetune builds the drafter for init=<out>, in the EAGLE form its files are in
    layer = with_form(layer_config(verifier, files.config), of_checkpoint(files.config, header, len(aux or [])))
    fields = dict(layer)
    theirs = AutoConfig.for_model(fields.pop("model_type"), **fields)
    ours = model.config.transformer_layer_config
    wrong = [f"{k} {getattr(theirs, k, None)} (drafter {getattr(ours, k, None)})" for k in LAYER_FIELDS
             if getattr(theirs, k, None) != getattr(ours, k, None)]
    if rope_theta(theirs) != rope_theta(ours):
        wrong.append(f"rope_theta {rope_theta(theirs)} (drafter {rope_theta(ours)})")
    if wrong:
        raise CheckpointError(f"export validation failed: {out / 'config.json'} describes another layer: "
                              + ", ".join(wrong))
    if aux != list(model.config.eagle_aux_hidden_state_layer_ids):
        raise CheckpointError(f"export validation failed: {out} names aux layers {aux}, the drafter "
                              f"{model.config.eagle_aux_hidden_state_layer_ids}")
    shapes = drafter_shapes(verifier, layer, aux_layer_ids=aux,
                            draft_vocab_size=int(files.config["draft_vocab_size"]))
    mapped, _ = match_keys(header, shapes, root=out)
    state = model.state_dict()
    n = 0
    for key, get, _, _ in _iter_tensors(files):
        target = mapped.get(key)
        if target is None:
            continue
        if not torch.equal(get(), state[target].detach().cpu()):
            raise CheckpointError(f"export validation failed: {key} in {out} differs from the drafter's {target}")
        n += 1
    return {"tensors": n}


def write_midlayer(model, out: Path, params: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = to_midlayer_layout({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    aux = json.loads(params[names.VERIFIER_AUX_LAYERS])
    cfg = specforge_config(model.config.transformer_layer_config, draft_vocab_size=model.draft_vocab_size,
                           aux_layer_ids=aux, form=EagleForm.of_model(model.config),
                           norm_before_residual=bool(model.config.norm_before_residual))
    cfg.update(served_aux_fields(aux))  # SpecForge's form, with the ids also where vLLM's V2 runner reads them
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
