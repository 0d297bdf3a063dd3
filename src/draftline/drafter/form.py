"""The EAGLE form of a drafter: 3.0, or 3.1 (vLLM's blog of 2026-05-26, arXiv 2605.09992).

EAGLE 3.1 adds two switches to an EAGLE-3 drafter, each a top-level key of its config.json as vLLM
(``llama_eagle3.py``, ``deepseek_eagle3.py``), speculators (``Eagle3SpeculatorConfig``) and SGLang read them:

- ``fc_norm``: one RMSNorm per aux hidden state before ``fc`` (weights ``fc_norm.{i}.weight``): the verifier's
  layers differ in scale by orders of magnitude, and ``fc`` sees them normalised;
- ``norm_output``: the drafter's post-norm state (the one ``lm_head`` reads) is what the next draft step is fed,
  instead of the pre-norm one.

Which form a drafter has is decided here, once: from a config (:func:`EagleForm.of_config`), the decoder-layer
dict a finetune run hands on (:func:`split`, :func:`with_form`), a parent's config and tensors checked against
each other and against the run's settings (:func:`choose`). speculators 0.9 builds and trains both switches
(its TTT loop feeds the post-norm state on where ``norm_output``); vLLM 0.32 serves both for Llama and MLA
layers. vLLM loads a config saying ``fc_norm`` whose checkpoint has no ``fc_norm.*`` tensors without a word
(the norms stay at ones), so that disagreement is refused here. speculators' own trainer writes 3.1 as
``norm_before_fc`` (one norm over the concatenation) instead of ``fc_norm``: vLLM's MLA drafter has no such
norm, so draftline writes ``fc_norm``, as lightseekorg's Kimi-K2.6 3.1 drafters do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from draftline.errors import CheckpointError, ParentMismatch

FORM_KEY = "eagle"  # where a finetune run's decoder-layer dict (layer_config.json) carries the form
FC_NORM_KEY = re.compile(r"^(?:model\.)?fc_norm\.(\d+)\.weight$")


@dataclass(frozen=True)
class EagleForm:
    fc_norm: bool = False
    norm_output: bool = False

    @property
    def name(self) -> str:
        """``3.0``, ``3.1``, or the one switch a drafter has (``3.0+fc_norm``)."""
        if self.fc_norm and self.norm_output:
            return "3.1"
        extra = [k for k in ("fc_norm", "norm_output") if getattr(self, k)]
        return "+".join(["3.0", *extra])

    def fields(self) -> dict[str, bool]:
        """The config keys, as vLLM, speculators and SGLang read them (top level)."""
        return {"fc_norm": self.fc_norm, "norm_output": self.norm_output}

    @classmethod
    def of_model(cls, config) -> EagleForm:
        """The form of a built drafter (its ``Eagle3SpeculatorConfig``)."""
        return cls(fc_norm=bool(config.fc_norm), norm_output=bool(config.norm_output))

    @classmethod
    def of_config(cls, config: dict[str, Any] | None) -> EagleForm:
        """The form a drafter's config.json states (speculators, vLLM's flat MLA form, SpecForge's): absent keys
        are 3.0, as every reader takes them."""
        config = config or {}
        return cls(fc_norm=bool(config.get("fc_norm", False)), norm_output=bool(config.get("norm_output", False)))


def split(layer: dict[str, Any]) -> tuple[dict[str, Any], EagleForm]:
    """A decoder-layer dict without the form it carries, and that form (3.0 where it carries none: a hand-off
    written before 3.1 was known)."""
    rest = {k: v for k, v in layer.items() if k != FORM_KEY}
    return rest, EagleForm(**layer.get(FORM_KEY, {}))


def with_form(layer: dict[str, Any], form: EagleForm) -> dict[str, Any]:
    return {**layer, FORM_KEY: form.fields()}


def fc_norms(keys: Iterable[str]) -> int:
    """How many ``fc_norm.{i}.weight`` tensors a checkpoint holds."""
    return sum(1 for k in keys if FC_NORM_KEY.match(k))


# from random init: 3.0, which every vLLM serves; 3.1 leads by 0.04-0.08 served acceptance on both tiers but no
# interval excludes zero (eagle-forms), docs/kimi.md ("EAGLE 3.1") says which to pick and why
DEFAULT = EagleForm()


def of_checkpoint(config: dict[str, Any] | None, keys: Iterable[str], aux_layers: int) -> EagleForm:
    """The form a checkpoint is in: its config's, where it says ``fc_norm``; where it does not, its tensors'
    (one ``fc_norm.{i}.weight`` per aux layer: 3.1's norms, whatever the config forgot to say)."""
    stated = EagleForm.of_config(config)
    if "fc_norm" not in (config or {}) and fc_norms(keys) == aux_layers:
        return EagleForm(fc_norm=True, norm_output=stated.norm_output)
    return stated


def check_tensors(name: str, form: EagleForm, keys: Iterable[str], aux_layers: int, fix: str | None = None) -> None:
    """A drafter's config and its tensors agree on ``fc_norm``: one norm per aux layer where it says so, none
    where it does not. ``fix`` replaces the fix each refusal names (a pulled directory's is to export it again)."""
    found = fc_norms(keys)
    if form.fc_norm and found != aux_layers:
        fix = fix or "pass the drafter's whole checkpoint"
        raise CheckpointError(f"{name}: its config says fc_norm (EAGLE 3.1) but it holds {found} fc_norm.*.weight "
                              f"tensors for {aux_layers} aux layers: a drafter with its norms missing is served "
                              f"with norms of ones; {fix}")
    if not form.fc_norm and found:
        fix = fix or 'set "fc_norm": true in its config.json (EAGLE 3.1)'
        raise CheckpointError(f"{name}: it holds {found} fc_norm.*.weight tensors but its config does not say "
                              f"fc_norm: true; {fix}")


def choose(*, fc_norm: bool | None, norm_output: bool | None, parent: str | None,
           parent_config: dict[str, Any] | None, parent_keys: Iterable[str] = (), aux_layers: int = 3) -> EagleForm:
    """The form a finetune trains: the parent's (its config, checked against its tensors), or for a random
    init :data:`DEFAULT`; ``fc_norm``/``norm_output`` given (``--fc-norm``, ``--norm-output``) must be the
    parent's: its weights were trained in its form."""
    if parent is None:
        return EagleForm(fc_norm=DEFAULT.fc_norm if fc_norm is None else fc_norm,
                         norm_output=DEFAULT.norm_output if norm_output is None else norm_output)
    keys = list(parent_keys)
    own = of_checkpoint(parent_config, keys, aux_layers)
    check_tensors(f"parent {parent}", own, keys, aux_layers)
    asked = {"fc_norm": fc_norm, "norm_output": norm_output}
    differ = [k for k, v in asked.items() if v is not None and v != getattr(own, k)]
    if differ:
        flags = " and ".join(f"--{k.replace('_', '-')} {str(asked[k]).lower()}" for k in differ)
        stated = ", ".join(f"{k} {str(v).lower()}" for k, v in own.fields().items())
        raise ParentMismatch(f"parent {parent} is EAGLE {own.name} ({stated}); {flags} would train its weights in another form than they were trained in: drop "
                             f"{'them' if len(differ) > 1 else 'it'} (the parent's form is the default), or start "
                             "from --init random")
    return own
