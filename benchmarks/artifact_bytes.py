"""artifact-bytes: what one finetune run logs as artifacts, over the bf16 bytes of the drafter's weights.

No DeepSpeed run: random bf16 tensors with the drafter's state-dict shapes (the speculators model built on the
meta device, so nothing of the model is allocated) go through the same hand-off writer finetune uses
(``handoff.write_weights``, then the training metadata beside it), and the other files finetune logs
(``training_metadata.json``, ``training_config.json``, ``plan.json``) are written as it writes them. The
accuracy chart and the parent's load report are small and not written here; their sizes are assumed (see
``OTHER_ASSUMED``). The floor is the drafter's own tensors as raw bytes: floating ones in bf16, ``d2t``/``t2d``
in their own dtypes. The DeepSpeed checkpoint a run keeps in its work directory (logged only with
``--log-checkpoints``) is given for comparison, computed from DeepSpeed's layout: 16-bit module weights plus
fp32 master weights and both Adam moments of the trainable parameters.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from draftline import names

OTHER_ASSUMED = {"per_position_accuracy.png": 40_000, "parent_load_report.json": 4_000}


def drafter_tensors(shape: str) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
    """``{key: (shape, dtype, trainable)}`` of the drafter's state dict, from a meta-device build."""
    from benchmarks.common import drafter_config
    from draftline.drafter.model import meta_drafter

    model = meta_drafter(drafter_config(shape))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: (tuple(v.shape), torch.bfloat16 if v.is_floating_point() else v.dtype, k in trainable)
            for k, v in model.state_dict().items()}


def _nbytes(dims: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in dims:
        n *= d
    return n


def run(shape: str = "real") -> dict:
    from benchmarks.common import AUX, SHAPES
    from draftline.config import FinetuneConfig
    from draftline.drafter import handoff
    from draftline.drafter.checkpoints import VERIFIER_OWNED
    from draftline.registry import lineage
    from draftline.train.plan import make_plan

    layout = drafter_tensors(shape)
    kept = {k: v for k, v in layout.items() if k not in VERIFIER_OWNED}
    floor = sum(_nbytes(d, t) for d, t, _ in kept.values())
    g = torch.Generator().manual_seed(0)
    state = {}
    for key, (dims, dtype, _) in kept.items():  # random, made in bf16 directly (no fp32 copy of 2.4 GB)
        state[key] = torch.zeros(dims, dtype=dtype) if not dtype.is_floating_point else \
            torch.empty(dims, dtype=dtype).normal_(0.0, 0.02, generator=g)
    s = SHAPES[shape]
    layer = {"model_type": "llama", **{k: s[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim", "vocab_size")},
             "num_hidden_layers": 1}
    cfg = FinetuneConfig(data="runs:/0/data", init="aq-medai-random", steps=10)
    params = {"init": cfg.init, names.PARENT_NAME: cfg.init, names.VOCAB_POLICY: "parent", names.VERIFIER_AUX_LAYERS: AUX,
              names.ZERO_STAGE: 2, "world_size": 8, "ttt_steps": 3, names.TRAIN_STEPS: cfg.steps}
    meta = lineage.training_metadata(params, {"draft_size": s["draft_vocab_size"]}, extra={"finetune_run_id": "x"})
    with tempfile.TemporaryDirectory(prefix="draftline-bench-artifacts-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        out = handoff.write_weights(state, root / handoff.WEIGHTS, layer=layer,
                                    selected={"selected": "last", "step": 10, "tag": "step10", "last_step": 10,
                                              "best": None})
        lineage.write_json(out / lineage.METADATA_FILE, meta)
        write_s = time.perf_counter() - t
        del state
        lineage.write_json(root / lineage.METADATA_FILE, meta)
        (root / "training_config.json").write_text(cfg.model_dump_json(indent=2))
        (root / "plan.json").write_text(json.dumps(make_plan(None), indent=2, default=str))
        files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    logged = sum(files.values()) + sum(OTHER_ASSUMED.values())
    trainable = sum(_nbytes(d, torch.bfloat16) // 2 for k, (d, _, tr) in kept.items() if tr)
    module_16bit = sum(_nbytes(d, t) for d, t, _ in layout.values())
    zero_ckpt = module_16bit + 12 * trainable  # fp32 master + Adam m + Adam v, over all ranks' partitions
    ratio = logged / floor
    return {
        "shape": shape, "files": files, "assumed": OTHER_ASSUMED, "artifact_bytes": logged,
        "weights_floor_bytes": floor, "ratio": ratio, "write_s": round(write_s, 2),
        "trainable_params": trainable,
        "zero_checkpoint_bytes": zero_ckpt, "target": 1.05,
        "summary": {"artifact bytes / bf16 weight bytes": f"{ratio:.5f} (target <= 1.05)",
                    "artifact GB": f"{logged / 1e9:.3f}", "bf16 weights GB": f"{floor / 1e9:.3f}",
                    "ZeRO checkpoint GB (not logged)": f"{zero_ckpt / 1e9:.1f} "
                                                       f"({zero_ckpt / floor:.1f}x the weights)"},
    }
