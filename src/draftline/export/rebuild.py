"""The finetuned drafter rebuilt from a finetune run's consolidated weights, for the verifier on this host."""

from __future__ import annotations

import json

import torch

from draftline import names
from draftline.drafter.checkpoints import VERIFIER_OWNED
from draftline.drafter.model import build_draft_model
from draftline.errors import CheckpointError


def build_trained_model(state: dict[str, torch.Tensor], params: dict[str, str], layer: dict | None = None):
    """A fresh drafter for the run's verifier, decoder layer and vocabulary, with the consolidated weights."""
    aux = json.loads(params[names.VERIFIER_AUX_LAYERS])
    model = build_draft_model(local_verifier(params), d2t=state["d2t"], t2d=state["t2d"],
                              aux_layer_ids=aux, draft_vocab_size=int(state["d2t"].numel()),
                              ttt_steps=int(params[names.TTT_STEPS]), dtype=torch.bfloat16, layer=layer)
    own = set(model.state_dict())
    expected = {k for k in own if k not in VERIFIER_OWNED}
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - own)
    if missing:
        raise CheckpointError(f"the consolidated checkpoint lacks {', '.join(missing)}")
    if unknown:  # e.g. EAGLE 3.1's fc_norm.* of a run whose hand-off does not say its form: never dropped
        raise CheckpointError(f"the consolidated checkpoint has {', '.join(unknown[:4])}, which the rebuilt drafter "
                              "has no place for: its layer_config.json does not describe the drafter trained")
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model.eval()


def local_verifier(params: dict[str, str]) -> str:
    """Where the finetune run's verifier lies on this host (runs from before ``verifier.path`` kept it in
    ``verifier.name_or_path``)."""
    return params.get(names.VERIFIER_PATH) or params[names.VERIFIER_NAME_OR_PATH]
