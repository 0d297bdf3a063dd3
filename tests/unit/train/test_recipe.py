"""The finetune recipe's knobs do what their --help says: the learning-rate curve DeepSpeed runs, the precision
auto picks, the loss weighting across draft positions, and the noise on the verifier's hidden states."""

import pytest
import torch

from draftline.config import FinetuneConfig
from draftline.train import precision
from draftline.train.finetune import ds_config


def _lr_curve(schedule: str, steps: int = 20, warmup: int = 4, lr: float = 1e-3) -> list[float]:
    from deepspeed.runtime import lr_schedules

    conf = ds_config(FinetuneConfig(data="x", steps=steps, warmup_steps=warmup, lr=lr, lr_schedule=schedule,
                                    precision="fp32"))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=conf["optimizer"]["params"]["lr"])
    sched = getattr(lr_schedules, conf["scheduler"]["type"])(opt, **conf["scheduler"]["params"])
    curve = []
    for _ in range(steps):
        curve.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return curve


def test_each_lr_schedule_is_the_curve_deepspeed_runs():
    linear, cosine, constant = (_lr_curve(s) for s in ("linear", "cosine", "constant"))
    for curve in (linear, cosine, constant):
        assert curve[1] < curve[3] <= 1e-3 + 1e-12  # the warm-up ramps up to the peak
    assert constant[-1] == pytest.approx(1e-3)  # constant holds the peak
    assert linear[-1] < 0.15e-3 and cosine[-1] < 0.15e-3  # both decay towards 0 by the last step
    assert linear[13] == pytest.approx(0.5e-3, rel=0.05)  # halfway through the decay: half the peak
    assert cosine[8] > linear[8] and cosine[16] < linear[16]  # cosine holds longer, then falls faster


def test_precision_auto_measures_on_cpus_and_keeps_what_it_is_told(monkeypatch):
    assert precision.choose("fp32", on_cpu=True, hidden=64, intermediate=128).precision == "fp32"
    assert precision.choose("auto", on_cpu=False, hidden=64, intermediate=128).precision == "bf16"
    kept = precision.Choice("fp32", "auto: a bf16 matmul ran 0.01x as fast as fp32 on this CPU")
    assert precision.choose("auto", on_cpu=True, hidden=64, intermediate=128, resumed=kept) == kept
    assert precision.choose("fp32", on_cpu=True, hidden=64, intermediate=128, resumed=kept) == kept  # same params
    monkeypatch.setattr(precision, "measure", lambda h, i: 2.1)
    fast = precision.choose("auto", on_cpu=True, hidden=64, intermediate=128)
    assert fast.precision == "bf16" and "2.1x" in fast.reason
    monkeypatch.setattr(precision, "measure", lambda h, i: 0.01)  # a CPU without bf16 instructions
    slow = precision.choose("auto", on_cpu=True, hidden=64, intermediate=128)
    assert slow.precision == "fp32" and "needs >=" in slow.reason


def test_the_measurement_itself_is_quick_and_real():
    import time

    t = time.perf_counter()
    ratio = precision.measure(576, 1536)  # SmolLM2's drafter: bf16 over fp32 matmul speed on this CPU
    # a real timing: finite, within what CPUs give (0.02x on an EPYC without bf16 units, ~4x with AMX)
    assert 0.001 < ratio < 100 and time.perf_counter() - t < 5


def test_hidden_noise_is_relative_to_each_aux_layers_scale():
    from draftline.drafter.model import add_hidden_noise

    torch.manual_seed(0)
    small, large = torch.randn(1, 4096, 64), 1000 * torch.randn(1, 4096, 64)
    hidden = torch.cat([small, large], dim=-1)
    noisy = add_hidden_noise(hidden, 0.1, layers=2)
    assert noisy.shape == hidden.shape and noisy.dtype == hidden.dtype
    for part, original in ((noisy[..., :64], small), (noisy[..., 64:], large)):
        rel = (part - original).pow(2).mean().sqrt() / original.pow(2).mean().sqrt()
        assert rel == pytest.approx(0.1, rel=0.05)


def test_ttt_loss_decay_weighs_later_positions_less_and_leaves_the_metrics_alone(tiny):
    from transformers import AutoConfig

    from draftline.drafter.model import build_draft_model, forward

    verifier = str(tiny["verifier"])
    t2d = torch.zeros(AutoConfig.from_pretrained(verifier).vocab_size, dtype=torch.bool)
    t2d[:256] = True
    model = build_draft_model(verifier, d2t=torch.zeros(256, dtype=torch.long), t2d=t2d, aux_layer_ids=[1, 2, 3],
                              draft_vocab_size=256, dtype=torch.float32)
    torch.manual_seed(0)
    n = 32
    batch = {"input_ids": torch.randint(0, 256, (1, n)), "hidden_states": torch.randn(1, n, 3 * 128),
             "verifier_last_hidden_states": torch.randn(1, n, 128), "loss_mask": torch.ones(1, n, dtype=torch.bool),
             "position_ids": torch.arange(1, n + 1)[None], "document_ids": torch.zeros(1, n, dtype=torch.long)}
    flat, m1 = forward(model, batch, 3)
    decayed, m2 = forward(model, batch, 3, ttt_loss_decay=0.5)
    assert decayed < flat
    assert {k: float(v) for k, v in m1.items() if "acc" in k} == {k: float(v) for k, v in m2.items() if "acc" in k}
