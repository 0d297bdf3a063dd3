"""An export checked before it is registered: reloaded (through speculators for its format; an MLA drafter
read back as a parent, by the strict ``midlayer.`` -> ``layers.0.`` load finetune uses) with identical weights,
layer and drafts, and loaded and drafted with by real vLLM beside the verifier."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

from draftline.console import say
from draftline.drafter.aux_ids import aux_ids_by_runner
from draftline.drafter.loading import load_drafter
from draftline.drafter.mla import MLA_FIELDS
from draftline.drafter.model import pack
from draftline.drafter.served import is_mla_drafter
from draftline.errors import CheckpointError
from draftline.serving.checks import check_serves
from draftline.serving.engine import EngineError, VerifierRefused, cannot_draft_beside, vllm_python
from draftline.serving.vllm_support import require_served, unserved


def reload(model, out: Path, verifier_path: str | None = None):
    """``out`` read back the way its form is read: speculators' ``from_pretrained``, or for an MLA drafter the
    parent load (``init=<out>``); ``verifier_path``: where the verifier lies on this host."""
    if is_mla_drafter(model):
        if verifier_path is None:
            raise CheckpointError("export validation needs the verifier's directory to read an MLA drafter back")
        reloaded = load_drafter(verifier_path, out, aux_layer_ids=list(model.config.eagle_aux_hidden_state_layer_ids),
                                dtype=torch.bfloat16)
        ours, theirs = model.config.transformer_layer_config, reloaded.config.transformer_layer_config
        wrong = [f"{k} {getattr(theirs, k, None)} (drafter {getattr(ours, k, None)})" for k in MLA_FIELDS
                 if getattr(theirs, k, None) != getattr(ours, k, None)]
        if wrong:
            raise CheckpointError(f"export validation failed: {out / 'config.json'} describes another layer: "
                                  + ", ".join(wrong))
        return reloaded
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (not saved; flex needs a GPU)
    if verifier_path:  # speculators loads the verifier's embeddings and head by this name
        config.speculators_config.verifier.name_or_path = verifier_path
    return Eagle3DraftModel.from_pretrained(str(out), config=config).to(torch.bfloat16).eval()


def validate(model, out: Path, seed: int = 0, verifier_path: str | None = None) -> None:
    """Reload ``out`` (:func:`reload`) and require identical weights and identical outputs on a batch.
    ``verifier_path``: where the verifier lies on this host (the config names it by its serving id)."""
    reloaded = reload(model, out, verifier_path)
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


def check_in_vllm(mode: str, out: Path, verifier_dir: str, k: int, *, mla_drafter: bool = False) -> str:
    """Load the export in real vLLM beside the verifier and draft with it (``mode`` auto|on|off); what happened,
    in words, for the ``export.vllm_check`` tag. A refusal by vLLM raises, naming vLLM's own error."""
    if mode == "off":
        return "off"
    python = vllm_python(required=mode == "on")
    if python is None:
        return "skipped: no vLLM venv (./setup.sh --vllm)"

    if mode == "on":
        require_served(verifier_dir, python, fix="export where vLLM serves it, or pass --vllm-check auto (it "
                       "records the check as skipped)")
    reason = unserved(verifier_dir, python) or cannot_draft_beside(verifier_dir, mla_drafter=mla_drafter)
    if reason and mode == "on":
        raise CheckpointError(f"--vllm-check on cannot run here: {reason}; export on such a host, or pass "
                              "--vllm-check auto (it records the check as skipped)")
    if reason:
        say(f"vLLM check skipped: {reason}")
        return f"skipped: {reason}"

    say(f"loading the export in vLLM beside {verifier_dir} (k={k}) ...")
    try:
        found = check_serves(out, verifier_dir, k=k, python=python)
    except VerifierRefused as e:
        raise CheckpointError(f"export validation failed: {e}; the drafter could not be tried, nothing was "
                              "registered") from None
    except EngineError as e:
        raise CheckpointError(f"export validation failed: vLLM refuses this drafter ({e}); nothing was "
                              "registered") from None
    say(f"vLLM served the export: {found['drafts']} drafts in {found['seconds']} s")
    return (f"passed: {found['drafts']} drafts, acceptance length {found['acceptance_length']} on probe prompts "
            f"({found['dtype']}); {layers_as_trained(out, found)}")


def layers_as_trained(out: Path, found: dict) -> str:
    """The layers vLLM captured, said as its log said them, after checking they are the ones the export names
    (the layers the drafter was trained on); a drafter fed other layers is refused."""
    trained = list(aux_ids_by_runner(json.loads((out / "config.json").read_text()))["v1"] or ())
    captured, whence = found["aux_layers"], found["aux_from"]
    if whence == "unknown":
        return "vLLM's log (not at INFO level) did not say which layers it captured"
    if whence == "default" or captured != trained:
        said = f"layers {captured}" if captured else "the verifier's default layers"
        raise CheckpointError(f"export validation failed: vLLM captured {said} for this drafter ({whence}), not "
                              f"the layers {trained} it was trained on; nothing was registered")
    return f"vLLM captured layers {captured}, as trained"
