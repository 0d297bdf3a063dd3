"""Capture through vLLM against capture in this process, on the same samples, for both verifier families.

For the Llama tiny verifier (vLLM float32) and the Kimi-shaped one (``make-tiny --family kimi``, vLLM bf16,
``--trust-remote-code``): prepare's hidden-state capture through a loopback vLLM (draftline's CPU-safe
connector) and through transformers, on the same demo conversations. Per family: tokens/s of each (vLLM's
start-up apart), and how far vLLM's shards are from transformers' (relative norm of the difference, over all
positions and at each sample's first position), beside transformers' own bf16 against its float32.

Also the basis of evaluate's bf16 lossless tolerance (``BF16_TIE_MARGIN``): on the Kimi-shaped verifier, the
top-2 log-probability margin at every position of the same samples in bf16 and in float32; where bf16 picks
another first choice than float32, how small float32's margin was.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from draftline.config import PrepareConfig
from draftline.data.prepare import build_data
from draftline.data.shards import open_prepared
from draftline.serving import hf_model
from draftline.testing.kimi import make_tiny_kimi
from draftline.testing.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo" / "conversations.jsonl"


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return round(((x.float() - y.float()).norm() / y.float().norm()).item(), 4)


def _capture(verifier: str, backend: str, out: Path, samples: int, trust: bool) -> tuple[dict, float]:
    cfg = PrepareConfig(conversations=str(DEMO), verifier=verifier, max_samples=samples, max_length=256,
                        batch_size=8, capture_backend=backend, trust_remote_code=trust)
    t0 = time.perf_counter()
    manifest = build_data(cfg, out, progress=False)
    seconds = time.perf_counter() - t0
    records = list(open_prepared(out).records())
    cat = {k: torch.cat([r[k] for r in records]) for k in ("hidden_states", "verifier_last_hidden_states")}
    cat["first"] = torch.cat([r["hidden_states"][:1] for r in records])
    cat["tokens"] = manifest["tokens"]
    return cat, seconds


def _family(name: str, verifier: str, tmp: Path, samples: int) -> dict:
    trust = name == "kimi"
    if trust:
        hf_model.allow_custom_code(verifier)
    from draftline.serving.engine import VllmServer

    started = []
    real_start = VllmServer.start

    def timed_start(self):  # vLLM's start-up, kept apart from the capture itself
        out = real_start(self)
        started.append(self.startup_s)
        return out

    VllmServer.start = timed_start  # type: ignore[method-assign]
    try:
        v, v_s = _capture(verifier, "vllm", tmp / f"{name}-vllm", samples, trust)
    finally:
        VllmServer.start = real_start  # type: ignore[method-assign]
    t, t_s = _capture(verifier, "transformers", tmp / f"{name}-hf", samples, trust)
    model = hf_model.load_causal_lm(verifier, dtype=torch.bfloat16)
    from draftline.data.capture import iter_hidden_states
    from draftline.data.tokenize import TokenizedSample

    recs = list(open_prepared(tmp / f"{name}-hf").records())
    own = list(iter_hidden_states(model, [TokenizedSample(str(i), r["input_ids"].tolist(), [1] * len(r["input_ids"]))
                                          for i, r in enumerate(recs)], [2, 4, 5], 8))
    bf16 = torch.cat([r["hidden_states"] for r in own])
    startup = started[0] if started else 0.0
    return {
        "dtype_in_vllm": hf_model.vllm_dtype(verifier), "tokens": t["tokens"],
        "vllm_startup_s": round(startup, 1),
        "vllm_tokens_per_s": round(t["tokens"] / max(v_s - startup, 1e-9), 1),
        "transformers_tokens_per_s": round(t["tokens"] / t_s, 1),
        "vllm_vs_transformers_rel_diff": _rel(v["hidden_states"], t["hidden_states"]),
        "vllm_vs_transformers_rel_diff_last": _rel(v["verifier_last_hidden_states"], t["verifier_last_hidden_states"]),
        "vllm_vs_transformers_rel_diff_first_position": _rel(v["first"], t["first"]),
        "transformers_bf16_vs_fp32_rel_diff": _rel(bf16, t["hidden_states"]),
    }


@torch.inference_mode()
def _margins(verifier: str, tmp: Path) -> dict:
    recs = list(open_prepared(tmp / "kimi-hf").records())
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = hf_model.load_causal_lm(verifier, dtype=dtype)
        logps = [model(r["input_ids"][None]).logits[0].float().log_softmax(-1) for r in recs]
        out[str(dtype)] = torch.cat(logps)
    fp, bf = out["torch.float32"], out["torch.bfloat16"]
    top_fp, top_bf = fp.topk(2, dim=-1), bf.topk(2, dim=-1)
    margin_fp = top_fp.values[:, 0] - top_fp.values[:, 1]
    flipped = top_fp.indices[:, 0] != top_bf.indices[:, 0]
    noise = (margin_fp - (top_bf.values[:, 0] - top_bf.values[:, 1])).abs()
    q = lambda t, p: round(torch.quantile(t, p).item(), 4) if t.numel() else None  # noqa: E731
    return {"positions": int(fp.shape[0]), "first_choice_flipped_by_bf16": int(flipped.sum()),
            "fp32_margin_where_flipped_max": q(margin_fp[flipped], 1.0),
            "fp32_margin_where_flipped_p90": q(margin_fp[flipped], 0.9),
            "margin_noise_p50": q(noise, 0.5), "margin_noise_p99": q(noise, 0.99),
            "positions_with_fp32_margin_at_most_0.25": int((margin_fp <= 0.25).sum())}


def run(samples: int = 24) -> dict:
    with tempfile.TemporaryDirectory(prefix="draftline-capture-bench-") as tmp:
        tmp = Path(tmp)
        llama = make_tiny(tmp / "tiny", DEMO, parent_steps=0, progress=False)
        kimi = make_tiny_kimi(tmp / "kimi", DEMO, parent_steps=0, progress=False)
        families = {"llama": _family("llama", str(llama["verifier"]), tmp, samples),
                    "kimi": _family("kimi", str(kimi["verifier"]), tmp, samples)}
        margins = _margins(str(kimi["verifier"]), tmp)
    summary = {f"{name} {key}": value for name, fam in families.items() for key, value in fam.items()
               if key in ("vllm_tokens_per_s", "transformers_tokens_per_s", "vllm_vs_transformers_rel_diff",
                          "vllm_vs_transformers_rel_diff_first_position", "transformers_bf16_vs_fp32_rel_diff")}
    summary.update({f"kimi bf16 {k}": v for k, v in margins.items()})
    return {"shape": "tiny+kimi", "samples": samples, "families": families, "bf16_margins": margins,
            "summary": summary}
