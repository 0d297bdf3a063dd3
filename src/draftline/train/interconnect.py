"""What a ZeRO stage sends over the GPUs' interconnect each step, how long that takes, and the compute beside it.

Per GPU and optimiser step, for P trainable parameters, F frozen, N GPUs in all and b bytes a value (2 in bf16,
4 in fp32), with NCCL's ring algorithms (each GPU sends (N-1)/N of the buffer per reduce-scatter or all-gather,
twice that per all-reduce; nccl-tests' PERFORMANCE.md):

* ZeRO-0: the gradients all-reduced: 2 x (N-1)/N x bP.
* ZeRO-1 and ZeRO-2: the gradients reduce-scattered to their owners, the updated parameters all-gathered:
  2 x (N-1)/N x bP, as ZeRO-0 (Rajbhandari et al., "ZeRO", SC 2020, section 7: 2Psi for stages 1 and 2).
* ZeRO-3: the parameters all-gathered for the forward and again for the backward, the gradients
  reduce-scattered: 3 x (N-1)/N x bP (the paper's 3Psi, 1.5x the others); the frozen parameters are partitioned
  too and gathered for the forward and the backward: 2 x (N-1)/N x bF (an upper bound: the embeddings need no
  backward). DeepSpeed's defaults (``stage3_max_reuse_distance`` 1e9) keep a gathered layer between the
  test-time-training steps that call it again, so each is gathered once per pass, not once per TTT step.

Time is bytes / bandwidth, the link's figure per direction: a lower bound, since NCCL reaches less (measure yours
with nccl-tests' ``all_reduce_perf`` and pass its bus bandwidth as ``--link-gb-s``). Compute is the matmul FLOPs
of one step, T tokens and k TTT steps: ``fc`` 6 x T x its parameters once, the decoder layer 6 x T x its
parameters per step, the frozen ``lm_head`` 4 x T x H x V per step (forward and the input gradient),
``verifier_lm_head`` 2 x T x H x V once (the targets); attention's T^2 terms are left out (about 1% at 4096
tokens for the Kimi shapes). Its time at the GPU's bf16 dense peak is a lower bound too; the ratio of the two says
whether the link or the arithmetic bounds a step (DeepSpeed overlaps the reduce with the backward,
``overlap_comm``, so the step takes about the larger of the two, not their sum).
"""

from __future__ import annotations

# The mission's GPU, the RTX PRO 6000 Blackwell: 96 GB of GDDR7 (32 modules of 24 Gbit), less what the driver
# keeps; pass --gpu-memory-gib with what nvidia-smi reports on the real machine to be exact (B200: 180).
DEFAULT_GPU_MEMORY_GIB = 95.0
DEFAULT_GPU = "RTX PRO 6000 Blackwell (96 GB, PCIe 5.0)"
# Per direction, as the vendor states the link. The mission's GPUs (RTX PRO 6000 Blackwell) have no NVLink: every
# collective crosses PCIe 5.0.
LINKS = {
    "pcie": (63.0, "PCIe 5.0 x16: 32 GT/s x 16 lanes with 128b/130b encoding, 63 GB/s per direction (PCI-SIG); "
                   "the RTX PRO 6000 Blackwell has no NVLink"),
    "nvlink": (900.0, "NVLink 5 (HGX B200): 1.8 TB/s per GPU, 900 GB/s per direction (NVIDIA)"),
}
# bf16 dense tensor throughput, for compute time. RTX PRO 6000 Blackwell: NVIDIA states 4,000 AI TOPS (FP4 with
# sparsity); Blackwell halves the rate from sparse to dense, FP4 to FP8 and FP8 to bf16: 500 TFLOP/s, derived,
# not measured. Pass --gpu-tflops with what the GPU reaches.
DEFAULT_TFLOPS = 500.0
TFLOPS_SOURCE = ("RTX PRO 6000 Blackwell: 4,000 AI TOPS (FP4, sparse; NVIDIA) / 8 = 500 TFLOP/s bf16 dense, "
                 "derived")


def sent_bytes(stage: int, trainable: int, frozen: int, n: int, value_bytes: int) -> tuple[int, str]:
    """Bytes one GPU sends per step under ``stage``, and the formula."""
    if n <= 1:
        return 0, "one GPU: nothing sent"
    share = (n - 1) / n
    if stage == 3:
        return int(share * value_bytes * (3 * trainable + 2 * frozen)), "(N-1)/N x b x (3P + 2F)"
    return int(share * value_bytes * 2 * trainable), "(N-1)/N x b x 2P"


def step_flops(parts: dict[str, int], shape: dict[str, int], tokens: int, ttt_steps: int) -> int:
    """Matmul FLOPs of one training step on one GPU (``parts``: trainable ``fc`` and ``layer`` parameters)."""
    hv = shape["hidden_size"] * shape["draft_vocab_size"]
    return tokens * (6 * parts["fc"] + ttt_steps * (6 * parts["layer"] + 4 * hv) + 2 * hv)


def traffic(plan_counts: dict, stages: list[int], *, gpus: int, tokens: int, ttt_steps: int, precision: str,
            link: str = "pcie", link_gb_s: float | None = None, gpu_tflops: float | None = DEFAULT_TFLOPS) -> dict:
    """Per stage: bytes sent, seconds on the link, beside the step's compute; what was assumed."""
    if link not in LINKS:
        raise ValueError(f"interconnect must be one of {', '.join(LINKS)}, got {link!r}")
    bandwidth, source = (link_gb_s, f"given: {link_gb_s:g} GB/s") if link_gb_s else LINKS[link]
    b = 2 if precision == "bf16" else 4
    flops = step_flops(plan_counts["parts"], plan_counts["shape"], tokens, ttt_steps)
    compute_s = flops / (gpu_tflops * 1e12) if gpu_tflops else None
    per_stage = {}
    for stage in stages:
        sent, formula = sent_bytes(stage, plan_counts["trainable"], plan_counts["frozen"], gpus, b)
        link_s = sent / (bandwidth * 1e9)
        per_stage[str(stage)] = {"sent_bytes": sent, "formula": formula, "link_s": link_s,
                                 "link_over_compute": link_s / compute_s if compute_s else None}
    return {"link": link, "bandwidth_gb_s": bandwidth, "bandwidth_source": source, "step_flops": flops,
            "gpu_tflops": gpu_tflops, "tflops_source": TFLOPS_SOURCE if gpu_tflops == DEFAULT_TFLOPS else
            ("given" if gpu_tflops else None), "compute_s": compute_s, "stages": per_stage}


def pick_stage(stages: dict, traffic_: dict) -> tuple[int | None, str]:
    """The stage to train with and why: of those that fit, the one that sends the least; among equals ZeRO-2
    (gradients and optimiser states partitioned at no extra traffic), then the most headroom."""
    fitting = [int(k) for k, s in stages.items() if s["fits"] is not False]
    if not fitting:
        return None, "no stage fits: see the fixes above"
    sent = {k: traffic_["stages"][str(k)]["sent_bytes"] for k in fitting}
    best = min(fitting, key=lambda k: (sent[k], k != 2, -(stages[str(k)]["headroom"] or 0)))
    why = [f"ZeRO-{best} fits"] if stages[str(best)]["fits"] else [f"ZeRO-{best} (fit not checked)"]
    if 3 in sent and best != 3 and sent[3] > sent[best]:
        why.append(f"sends {sent[best] / 1e9:.2f} GB a step per GPU against ZeRO-3's {sent[3] / 1e9:.2f} GB")
    elif best == 3:
        why.append("it is the only stage that fits" if len(fitting) == 1 else "it sends the least")
    ratio = traffic_["stages"][str(best)]["link_over_compute"]
    if ratio is not None:
        bound = "the link" if ratio > 1 else "the arithmetic"
        why.append(f"its link time is {ratio:.2f}x the compute at {traffic_['gpu_tflops']:g} TFLOP/s: {bound} "
                   "bounds a step")
    return best, "; ".join(why)
