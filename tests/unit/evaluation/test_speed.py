"""What a drafter buys: the speed-up's paired interval over waves, the setting that asks for it, and the policy
rule that gates on its lower bound (the measurement itself runs on real vLLM in tests/integration/test_kimi.py)."""

import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from draftline import names
from draftline.cli import cli
from draftline.config import EvaluateConfig
from draftline.evaluation.speed import Side, Speed, fastest_k, sweep_metrics, sweep_text
from draftline.registry.confidence import Interval, throughput_ratio
from draftline.registry.evidence import Evaluation, Evidence
from draftline.registry.policies import Policy, evaluate
from draftline.serving.engine import wait_idle


def test_the_speedup_is_the_ratio_of_tokens_per_second_with_a_paired_interval():
    # the same waves, the drafted side twice as fast in each, machine noise shared wave by wave
    noise = [1.0, 1.6, 0.8, 1.3, 2.2, 0.9, 1.1, 1.4]
    tokens = [32] * len(noise)
    two = throughput_ratio(tokens, [n / 2 for n in noise], tokens, noise)
    assert two.value == pytest.approx(2.0) and two.low == pytest.approx(2.0) and two.high == pytest.approx(2.0)
    # a drafter that is sometimes faster, sometimes slower: the interval spans 1
    mixed = throughput_ratio(tokens, [n * f for n, f in zip(noise, [0.8, 1.2] * 4, strict=True)], tokens, noise)
    assert mixed.low < 1.0 < mixed.high and mixed.n == len(noise)
    slow = throughput_ratio(tokens, [2 * n for n in noise], tokens, noise)  # 0.5x: the CPU tier's finding
    assert slow.high < 1.0


@pytest.mark.parametrize(("text", "want"), [("1", [1]), ("8,1", [1, 8]), ("off", []), ("1,1,8", [1, 8])])
def test_speed_concurrencies(text, want):
    assert EvaluateConfig(target="t", data="d", speed_concurrency=text).speed_at == want


@pytest.mark.parametrize(("text", "want"), [("1..4", [1, 2, 3, 4]), ("4,1,2", [1, 2, 4]), ("2..2", [2])])
def test_sweep_k(text, want):
    assert EvaluateConfig(target="t", data="d", sweep_k=text).sweep == want


def _speeds(values: dict[int, float]) -> list[Speed]:
    side = Side([1.0], [10], [1.0], [10])
    return [Speed(c, side, side, Interval(v, v - 0.1, v + 0.1, 0.95, 8)) for c, v in values.items()]


def test_the_sweep_recommends_the_k_that_decodes_fastest_at_the_lowest_concurrency():
    # k=2 is fastest at one request in flight, k=1 at eight: the recommendation is the latency one
    sweep = {1: _speeds({1: 0.70, 8: 0.40}), 2: _speeds({1: 0.81, 8: 0.30}), 3: _speeds({1: 0.62, 8: 0.22})}
    assert fastest_k(sweep) == 2 and fastest_k(sweep, 8) == 1
    m = sweep_metrics(sweep)
    assert m["eval/sweep/c1/fastest_k"] == 2 and m["eval/sweep/c8/fastest_k"] == 1
    assert m["eval/sweep/k3/c8/speedup_low"] == pytest.approx(0.12)
    assert sweep_text(sweep).startswith("k=1 x0.70 [0.60, 0.80], k=2 x0.81")


@pytest.mark.parametrize(("args", "named"), [(["--speed-concurrency", "fast"], "--speed-concurrency 'fast'"),
                                             (["--speed-concurrency", "0,8"], "at least 1"),
                                             (["--plain-endpoint", "http://127.0.0.1:9/v1"], "--vllm-endpoint"),
                                             (["--sweep-k", "0..3"], "--sweep-k '0..3'"),
                                             (["--sweep-k", "1..4", "--speed-concurrency", "off"], "not off"),
                                             (["--sweep-k", "1,2", "--vllm-endpoint", "http://127.0.0.1:9/v1"],
                                              "fixed when it starts")])
def test_evaluate_refuses_speed_settings_it_cannot_use_at_once(args, named, tmp_path):
    """Refused as settings, before the (empty) data folder is even looked at."""
    start = time.monotonic()
    r = CliRunner().invoke(cli, ["evaluate", "--target", "random", "--data", str(tmp_path), *args])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert named in r.output and "manifest" not in r.output
    assert time.monotonic() - start < 2


def _judge(metrics: dict, rule: dict):
    policy = Policy(stage="Production", export_validated=False, evaluation={"data": "evaluation"},
                    min_speedup=rule)
    ev = Evaluation("evaluation", "d" * 36, {names.MEASURED_ACCEPTANCE_LENGTH: 2.0, **metrics})
    mv = SimpleNamespace(tags={}, version="3")
    return [r for r in evaluate(policy, mv, evidence=Evidence(version=[ev])) if r.rule.startswith("speed-up")][0]


def test_the_speed_gate_reads_the_lower_bound():
    fast = {"eval/speed/c1/speedup": 1.4, "eval/speed/c1/speedup_low": 1.2, "eval/speed/c1/speedup_high": 1.6,
            "eval/speed/c1/drafted_tokens_per_s": 70.0, "eval/speed/c1/plain_tokens_per_s": 50.0}
    assert _judge(fast, {"concurrency": 1, "value": 1.05}).passed
    unsure = {**fast, "eval/speed/c1/speedup_low": 0.98}  # the point estimate passes; the interval does not
    result = _judge(unsure, {"concurrency": 1, "value": 1.05})
    assert not result.passed and "lower bound 0.980 < 1.05" in result.detail
    missing = _judge(fast, {"concurrency": 8, "value": 1.05})
    assert not missing.passed and "--speed-concurrency 8" in missing.detail
    one = _judge({**fast, "eval/speed/c1/speedup_low": 1.4, "eval/speed/c1/waves": 1.0}, {"concurrency": 1,
                                                                                         "value": 1.05})
    assert not one.passed and "no interval" in one.detail and "at least 2 prompts" in one.detail  # one wave


def test_one_wave_is_said_to_give_no_interval():
    from draftline.export.directory import model_card

    tokens = [64]
    assert throughput_ratio(tokens, [1.0], tokens, [2.0]).text() == "2.00 (n=1: no interval)"
    m = {names.MEASURED_ACCEPTANCE_LENGTH: 1.5, names.MEASURED_PROMPTS: 8.0, "eval/speed/c8/speedup": 0.84,
         "eval/speed/c8/speedup_low": 0.84, "eval/speed/c8/speedup_high": 0.84, "eval/speed/c8/waves": 1.0,
         "eval/speed/c8/drafted_tokens_per_s": 52.3, "eval/speed/c8/plain_tokens_per_s": 62.0}
    card = model_card({}, {}, [{"data": {"name": "evaluation", "digest": "ab" * 32}, "metrics": m}])
    assert "x0.84 (1 wave: no interval) at concurrency 8" in card


def test_the_model_card_says_what_the_drafter_buys():
    from draftline.export.directory import model_card

    evaluated = [{"data": {"name": "evaluation", "digest": "ab" * 32}, "metrics": {
        names.MEASURED_ACCEPTANCE_LENGTH: 1.5, names.MEASURED_LOW: 1.4,
        names.MEASURED_HIGH: 1.6, names.MEASURED_PROMPTS: 12.0,
        "eval/speed/c1/speedup": 0.53, "eval/speed/c1/speedup_low": 0.39, "eval/speed/c1/speedup_high": 0.71,
        "eval/speed/c1/drafted_tokens_per_s": 23.5, "eval/speed/c1/plain_tokens_per_s": 44.7}},
        {"data": {"name": "teacher-forced only", "digest": "cd" * 32}, "metrics": {"eval/teacher_forced/x": 1.0}}]
    card = model_card({names.VERIFIER_NAME_OR_PATH: "v"}, {}, evaluated)
    assert ("| evaluation (`abababababab`) | 12 | 1.500 [1.400, 1.600] | x0.53 [0.39, 0.71] at concurrency 1 "
            "(23.5 vs 44.7 tokens/s) |") in card
    assert "teacher-forced only" not in card and "## Measured by vLLM" not in model_card({}, {}, [])


def _server_of(code: str):
    """A VllmServer whose process is ``python -c code``: what wait_idle reads is the CPU it uses."""
    import subprocess
    import sys
    from pathlib import Path

    from draftline.serving.engine import ServeSpec, VllmServer

    server = VllmServer(ServeSpec(model="m", dtype="float32", trust_remote_code=False), python=Path(sys.executable))
    server.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.3)  # the interpreter's own start, not what is measured
    return server


@pytest.mark.parametrize(("busy_s", "cap_s", "at_least", "at_most"),
                         [(0.0, 3.0, 0.0, 0.6), (0.8, 3.0, 0.4, 2.5), (60.0, 1.5, 1.5, 2.0)])
def test_a_wave_waits_until_the_server_has_gone_idle(busy_s, cap_s, at_least, at_most):
    """vLLM on a CPU keeps a core busy for about a second after a request; the next wave waits it out (a server
    that never goes idle is waited for no longer than the cap)."""
    server = _server_of(f"import time\nt = time.monotonic()\nwhile time.monotonic() - t < {busy_s}: pass\n"
                        "time.sleep(60)")
    try:
        waited = wait_idle([server], cap_s=cap_s)
        assert at_least <= waited <= at_most, waited
    finally:
        server.stop()


def test_every_wave_starts_on_a_settled_machine(monkeypatch):
    """measure_speed settles before every wave on each side, so no wave runs in the other server's busy second."""
    from draftline.evaluation import speed

    events: list[str] = []

    def wave(client, endpoint, model, prompts, max_new_tokens, headers, side):
        events.append(model)
        side.wave_s.append(1.0)
        side.wave_tokens.append(8 * len(prompts))
        side.latency_s += [1.0] * len(prompts)
        side.tokens += [8] * len(prompts)

    monkeypatch.setattr(speed, "_wave", wave)
    monkeypatch.setattr(speed, "complete", lambda *a, **k: [])
    prompts = [[1, 2, 3]] * 4
    out = speed.measure_speed(("http://d", "drafted"), ("http://p", "plain"), prompts, max_new_tokens=8,
                              concurrencies=[1, 2], settle=lambda: events.append("settle"))
    assert [s.speedup.n for s in out] == [4, 2]
    assert events[0::2] == ["settle"] * 12 and set(events[1::2]) == {"drafted", "plain"}
    assert events[1:8:2] == ["drafted", "plain", "plain", "drafted"]  # the order swapped every wave
