"""The verifier as transformers and vLLM read it: its config (the language model's, for a multimodal wrapper
such as Kimi-K2.5's ``kimi_k25``), its tokenizer, its causal LM, and the dtype vLLM serves it in.

Custom code runs only when asked. A directory whose config or tokenizer exists only as code it ships
(``auto_map`` naming classes transformers does not have, as Kimi-K2-Instruct's ``kimi_k2`` does) is refused with
one line naming ``--trust-remote-code``, before anything runs, never with transformers' interactive prompt.
What this process was told to trust is kept in ``$DRAFTLINE_TRUST_REMOTE_CODE`` (the verifier directories,
``os.pathsep``-separated), so the training ranks and every vLLM draftline starts inherit the same decision.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

from draftline import environment
from draftline.errors import DataError, UsageError

TRUST_ENV = environment.TRUST_REMOTE_CODE.name
FLAG = "--trust-remote-code"
# vLLM's CPU MLA backend refuses float32 weights ("expect weight to be bfloat16, float16, ..."): a verifier with
# DeepSeek's multi-head latent attention is served in bf16 on a CPU, as every verifier is on a GPU
MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim")


def _key(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


def trusted() -> set[str]:
    return {p for p in environment.TRUST_REMOTE_CODE.get().split(os.pathsep) if p}


def allow_custom_code(path: str | Path) -> None:
    """Trust the code shipped in the verifier directory ``path`` in this process and the ones it starts."""
    environment.TRUST_REMOTE_CODE.set(os.pathsep.join(sorted(trusted() | {_key(path)})))


def trust_as_recorded(path: str | Path, recorded: object) -> None:
    """Trust ``path`` when the data it was prepared with recorded ``verifier.trust_remote_code`` true (a later
    stage inherits prepare's decision; the value may come back from MLflow as a string)."""
    if str(recorded).strip().lower() in ("1", "true", "yes"):
        allow_custom_code(path)


def is_trusted(path: str | Path) -> bool:
    return _key(path) in trusted()


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def custom_code(path: str | Path) -> list[str]:
    """What in the directory exists only as code it ships: ``config.json``'s model (a ``model_type``
    transformers does not know, with an ``auto_map``) and ``tokenizer_config.json``'s tokenizer (a class
    transformers does not have, with an ``auto_map``). Empty where transformers reads everything natively."""
    d = Path(path)
    out = []
    config = _json(d / "config.json")
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING_NAMES:
        out.append(f"config.json (model_type {config.get('model_type')!r}: "
                   f"{', '.join(sorted({str(v).split('.')[0] + '.py' for v in config['auto_map'].values()}))})")
    tok = _json(d / "tokenizer_config.json")
    tok_map = tok.get("auto_map") or {}
    tok_class = str(tok.get("tokenizer_class") or "")
    known = {c for names in TOKENIZER_MAPPING_NAMES.values() for c in (names if isinstance(names, tuple) else (names,))
             if c}
    if tok_map and tok_class.removesuffix("Fast") + "Fast" not in known and tok_class not in known:
        files = {str(v).split(".")[0] + ".py" for v in (tok_map.get("AutoTokenizer") or []) if v}
        out.append(f"tokenizer_config.json ({tok_class or 'its tokenizer'}: {', '.join(sorted(files))})")
    return out


def check_custom_code(path: str | Path) -> None:
    """One :class:`UsageError` (exit 2) when ``path`` needs its own code and this process was not told to
    trust it."""
    needs = custom_code(path)
    if needs and not is_trusted(path):
        raise UsageError(f"verifier {path} ships its model or tokenizer as custom code ({'; '.join(needs)}): pass "
                         f"{FLAG} to run it (read the .py files first), or use a directory transformers reads "
                         "natively")


def load_config(path: str | Path):
    """The directory's full config (a wrapper's too), custom code only when trusted. A trusted config class
    transformers does not have is registered with ``AutoConfig`` under its ``model_type``, so that libraries
    that read the verifier's config without asking about custom code (speculators' ``load_verifier_weights``)
    read it with the same class in this process."""
    check_custom_code(path)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=is_trusted(path))
    if config.model_type not in CONFIG_MAPPING:
        AutoConfig.register(config.model_type, type(config))
    return config


def text_config(config):
    """The language model's config: ``text_config`` of a multimodal wrapper (Kimi-K2.5), else the config."""
    sub = getattr(config, "get_text_config", None)
    return sub() if callable(sub) else getattr(config, "text_config", config)


def load_text_config(path: str | Path):
    return text_config(load_config(path))


def load_tokenizer(path: str | Path):
    check_custom_code(path)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=is_trusted(path))


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32):
    """The verifier's language model with its LM head, for capture and in-process decoding: a causal LM as it
    is, or the text model inside a multimodal wrapper (whose vision tower capture never needs)."""
    config = load_config(path)
    trust = is_trusted(path)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
            trust and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust).eval()
    return _text_model_of_wrapper(path, config, dtype)


def _text_model_of_wrapper(path: str | Path, config, dtype: torch.dtype):
    """The causal LM inside a multimodal wrapper: the wrapper loaded by transformers (its checkpoint's names
    converted as transformers converts them), its language model and LM head moved into a causal LM of its
    ``text_config``; the vision tower is dropped."""
    text = text_config(config)
    if text is config:
        raise DataError(f"verifier {path}: transformers has no causal LM for model_type {config.model_type!r} and "
                        "its config has no text_config; pass a causal LM's directory")
    wrapper = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype, trust_remote_code=is_trusted(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    model.model = wrapper.model.language_model
    model.lm_head = wrapper.get_output_embeddings()
    return model.to(dtype).eval()


def describe(path: str | Path) -> dict[str, str]:
    """``model_type`` and architecture, the wrapper's and (where it differs) the language model's, for lineage."""
    raw = _json(Path(path) / "config.json")
    text: dict[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else {}
    out = {"model_type": str(raw.get("model_type", "")),
           "architecture": ",".join(raw.get("architectures") or []) or "unknown"}
    if text.get("model_type"):
        out["text_model_type"] = str(text["model_type"])
    return out


def uses_mla(path: str | Path) -> bool:
    """Whether the verifier (its directory or config.json; a multimodal wrapper's text model) has MLA
    attention; an unreadable config says no."""
    path = Path(path).expanduser()
    raw = _json(path if path.is_file() else path / "config.json")
    text: dict[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    return all(text.get(k) for k in MLA_KEYS)


def vllm_dtype(path: str | Path) -> str:
    """The dtype draftline serves the verifier in: float32 where vLLM can run it (on a CPU, speculative output
    is token-identical to plain greedy there), bfloat16 on a GPU and for MLA verifiers, which vLLM's CPU backend
    serves in bf16 only."""
    return "bfloat16" if torch.cuda.is_available() or uses_mla(path) else "float32"
