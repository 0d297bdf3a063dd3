"""How far bf16 speculative decoding on vLLM strays from plain bf16 decoding: the basis of evaluate's lossless
tolerance (``draftline.evaluation.loopback.BF16_TIE_MARGIN``).

On the Kimi-shaped miniature (MLA + MoE, ``make-tiny --family kimi``; vLLM serves it in bf16 only), the same
GSM8K prompts are decoded greedily three times on real vLLM, each returning the top-2 log-probabilities of every
generated token: a plain server (no drafter) with 8 requests in flight, the same plain server one request at a
time, and a server drafting with a drafter (k=3, 8 in flight). Per pair of runs, on the positions where both
have produced the same tokens so far (the same context), it reports the noise: how much the chosen token's
log-probability and the top-2 margin differ between the two computations (p50, p99, max); and at each first
divergence, the plain server's top-2 margin there. A tolerance covers every divergence where it is at least
the largest margin at which a divergence happened, and it is justified where that margin lies within the noise
the same positions show elsewhere. Where the two runs' tokens at a divergence rank in each other's top 5 is
the rule evaluate applies (``lossless_against``, as vLLM's own ``check_logprobs_close``).
"""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from draftline import names
from draftline.drafter.model import build_draft_model
from draftline.drafter.shape import layer_config
from draftline.export.directory import write_drafter
from draftline.serving import hf_model
from draftline.serving.engine import ServeSpec, VllmServer, cannot_draft_beside
from draftline.testing.kimi import KIMI_VERIFIER_ID, make_tiny_kimi

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo" / "conversations.jsonl"
PROMPTS = ROOT / "configs" / "demo" / "gsm8k_test_prompts.jsonl"
LOGPROBS = 5  # top-5 per token: where each side's token ranks in the other's list at a divergence


def _decode(endpoint: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[list[dict]]:
    """Per prompt, per generated token: ``{"id": chosen, "top": {id: logprob, ...}}`` (top-5 and the chosen)."""
    def one(prompt: str) -> list[dict]:
        r = httpx.post(endpoint + "/completions", timeout=600, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": LOGPROBS, "return_tokens_as_token_ids": True, "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        tops = choice["logprobs"]["top_logprobs"]
        return [{"id": int(t), "top": {int(k.split(":")[1]): float(v) for k, v in (top or {}).items()}}
                for t, top in zip(choice["token_ids"], tops, strict=True)]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, prompts))


def _margin(top: dict) -> float:
    v = sorted(top.values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else float("inf")


def _rank(token: int, top: dict) -> int | None:
    """1-based rank of ``token`` in a top-logprobs dict (None where it is not listed)."""
    order = sorted(top, key=top.get, reverse=True)
    return order.index(token) + 1 if token in order else None


def _q(values: list[float], p: float) -> float | None:
    return round(torch.quantile(torch.tensor(values), p).item(), 4) if values else None


def _compare(a: list[list[dict]], b: list[list[dict]]) -> dict:
    """Noise on shared contexts and the margins at first divergences (``a`` is the reference)."""
    d_lp, d_margin, diverged = [], [], []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for pos, (s, t) in enumerate(zip(x, y, strict=True)):
            if s["id"] != t["id"]:
                diverged.append({"prompt": i, "position": pos, "margin_a": round(_margin(s["top"]), 4),
                                 "margin_b": round(_margin(t["top"]), 4), "rank_of_b_in_a": _rank(t["id"], s["top"]),
                                 "rank_of_a_in_b": _rank(s["id"], t["top"])})
                break
            if s["id"] in t["top"]:
                d_lp.append(abs(s["top"][s["id"]] - t["top"][s["id"]]))
            ma, mb = _margin(s["top"]), _margin(t["top"])
            if ma != float("inf") and mb != float("inf"):
                d_margin.append(abs(ma - mb))
    margins = [d["margin_a"] for d in diverged]
    second = [d for d in diverged if d["rank_of_b_in_a"] == 2 and d["rank_of_a_in_b"] == 2]
    top5 = [d for d in diverged if d["rank_of_b_in_a"] and d["rank_of_a_in_b"]]
    return {"positions_compared": len(d_margin), "prompts_diverged": len(diverged), "prompts": len(a),
            "logprob_noise_p50": _q(d_lp, 0.5), "logprob_noise_p99": _q(d_lp, 0.99),
            "logprob_noise_max": _q(d_lp, 1.0),
            "margin_noise_p50": _q(d_margin, 0.5), "margin_noise_p99": _q(d_margin, 0.99),
            "margin_noise_max": _q(d_margin, 1.0),
            "margin_at_divergence_max": max(margins) if margins else None,
            "divergences_each_the_others_second_choice": len(second),
            "divergences_each_in_the_others_top5": len(top5),
            "divergence_rank_max": max((max(d["rank_of_b_in_a"] or 99, d["rank_of_a_in_b"] or 99) for d in diverged),
                                       default=None),
            "divergences": diverged}


def run(prompts_n: int = 64, max_tokens: int = 32) -> dict:
    prompts = [json.loads(line)["messages"][0]["content"]
               for line in PROMPTS.read_text().splitlines()[:prompts_n]]
    with tempfile.TemporaryDirectory(prefix="draftline-bf16-ties-") as tmp:
        kimi = make_tiny_kimi(Path(tmp) / "kimi", DEMO, parent_steps=0, progress=False)
        verifier = str(kimi["verifier"])
        if reason := cannot_draft_beside(verifier):
            raise SystemExit(f"bf16-ties needs vLLM to draft beside an MLA verifier: {reason}")
        hf_model.allow_custom_code(verifier)
        n = json.loads((kimi["verifier"] / "config.json").read_text())["vocab_size"]
        d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
        t2d[:256] = True
        torch.manual_seed(0)
        model = build_draft_model(verifier, d2t=d2t, t2d=t2d, aux_layer_ids=[2, 4, 5], draft_vocab_size=256,
                                  dtype=torch.bfloat16, layer=layer_config(verifier))
        drafter = Path(tmp) / "drafter"
        write_drafter(model, drafter, {names.VERIFIER_NAME_OR_PATH: KIMI_VERIFIER_ID}, {})
        runs = {}
        with VllmServer(ServeSpec(model=verifier, max_model_len=1024)) as plain:
            runs["plain_batched"] = _decode(plain.endpoint, plain.model, prompts, max_tokens, 8)
            runs["plain_one_at_a_time"] = _decode(plain.endpoint, plain.model, prompts, max_tokens, 1)
        with VllmServer(ServeSpec(model=verifier, drafter=str(drafter), k=3, max_model_len=1024)) as spec:
            runs["speculative_k3"] = _decode(spec.endpoint, spec.model, prompts, max_tokens, 8)
    pairs = {"plain batched vs one at a time": _compare(runs["plain_batched"], runs["plain_one_at_a_time"]),
             "plain batched vs speculative k=3": _compare(runs["plain_batched"], runs["speculative_k3"])}
    summary = {f"{name}: {k}": v for name, p in pairs.items() for k, v in p.items() if k != "divergences"}
    return {"shape": "kimi", "dtype": "bfloat16", "prompts": len(prompts), "max_tokens": max_tokens,
            "pairs": pairs, "summary": summary}
