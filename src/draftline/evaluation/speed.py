"""What a drafter buys: decoding speed with and without it, the same prompts on two vLLM servers side by side.

A drafter is worth the tokens per second it buys, not its acceptance alone: each draft step costs a drafter
forward and each verification a wider verifier step. So the same prompts go to the server that drafts and to the
plain verifier, at each concurrency the team serves, in *waves* of ``c`` requests in flight: each wave runs on
one server and then on the other, the order swapped every wave, so whatever else the machine does falls on both.
Where the two servers share the CPUs (loopback on a CPU host), each wave starts once both have gone idle
(``settle``): vLLM on a CPU keeps a core busy for about a second after its last request, and a wave measured in
that second ran on half the machine. Alternating without it biased the ratio either way by up to 2x between runs
on 2 cores (docs/benchmarks.md, speed).
Every request generates exactly ``max_new_tokens`` (``ignore_eos``; greedy, the same sampling on both), so the
two sides decode the same number of tokens and a wave's times compare directly. Where the two servers cannot run
side by side (a GPU node the verifier fills), each decodes every wave while it is up (:func:`decode_side`) and
the waves are paired afterwards: the machine's noise then falls on one side at a time, and the logged
``alternated`` says which it was.

Per concurrency: output tokens per second on each side (all tokens over all waves' wall time), time per output
token and request latency (medians), and the speed-up, drafted over plain tokens per second, with a paired
bootstrap interval over waves (:func:`draftline.registry.confidence.throughput_ratio`). Logged as
``eval/speed/c<c>/*``; a policy's ``min_speedup`` reads the interval's lower bound.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from draftline import names
from draftline.console import bar_kwargs
from draftline.registry.confidence import Interval, throughput_ratio
from draftline.serving.client import auth_headers, complete

PREFIX = names.SPEED
SWEEP = "eval/sweep"


@dataclass
class Side:
    """One server's waves at one concurrency: wall seconds and tokens per wave, latency per request."""

    wave_s: list[float]
    wave_tokens: list[int]
    latency_s: list[float]
    tokens: list[int]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.wave_tokens) / max(sum(self.wave_s), 1e-9)

    @property
    def tpot_ms(self) -> float:
        return 1000 * statistics.median(s / max(n, 1) for s, n in zip(self.latency_s, self.tokens, strict=True))

    @property
    def latency_median_s(self) -> float:
        return statistics.median(self.latency_s)


@dataclass
class Speed:
    concurrency: int
    drafted: Side
    plain: Side
    speedup: Interval
    alternated: bool = True

    def metrics(self) -> dict[str, float]:
        p = f"{PREFIX}/c{self.concurrency}"
        return {f"{p}/speedup": self.speedup.value, f"{p}/speedup_low": self.speedup.low,
                f"{p}/speedup_high": self.speedup.high, f"{p}/waves": float(self.speedup.n),
                f"{p}/alternated": float(self.alternated),
                f"{p}/drafted_tokens_per_s": self.drafted.tokens_per_s,
                f"{p}/plain_tokens_per_s": self.plain.tokens_per_s,
                f"{p}/drafted_tpot_ms": self.drafted.tpot_ms, f"{p}/plain_tpot_ms": self.plain.tpot_ms,
                f"{p}/drafted_latency_s": self.drafted.latency_median_s,
                f"{p}/plain_latency_s": self.plain.latency_median_s}

    def text(self) -> str:
        return (f"x{self.speedup.text('wave')} at concurrency {self.concurrency} ({self.drafted.tokens_per_s:.1f} vs "
                f"{self.plain.tokens_per_s:.1f} tokens/s; {self.drafted.tpot_ms:.0f} vs {self.plain.tpot_ms:.0f} "
                f"ms per token; {self.speedup.n} waves)")


def _wave(client, endpoint: str, model: str, prompts: list[list[int]], max_new_tokens: int, headers: dict,
          side: Side) -> None:
    def one(prompt):
        t0 = time.perf_counter()
        out = complete(client, endpoint, model, prompt, max_tokens=max_new_tokens, headers=headers,
                       extra={"ignore_eos": True})
        return time.perf_counter() - t0, len(out)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        done = list(pool.map(one, prompts))
    side.wave_s.append(time.perf_counter() - start)
    side.wave_tokens.append(sum(n for _, n in done))
    side.latency_s += [s for s, _ in done]
    side.tokens += [n for _, n in done]


def decode_side(server: tuple[str, str], prompts: list[list[int]], *, max_new_tokens: int,
                concurrencies: list[int], progress: bool = False) -> dict[int, Side]:
    """One server alone, every wave at each concurrency (a host where the two servers cannot run together:
    a GPU node the verifier fills); paired with the other side by wave afterwards (:func:`pair`)."""
    headers = auth_headers()
    endpoint, model = server
    out = {}
    with httpx.Client() as client:
        complete(client, endpoint, model, prompts[0], max_tokens=4, headers=headers)  # warm-up, not counted
        for c in concurrencies:
            out[c] = Side([], [], [], [])
            for i in tqdm(range(0, len(prompts), c), desc=f"[draftline] speed at concurrency {c}", unit="wave",
                          **bar_kwargs(progress)):
                _wave(client, endpoint, model, prompts[i:i + c], max_new_tokens, headers, out[c])
    return out


def pair(drafted: dict[int, Side], plain: dict[int, Side], level: float = 0.95) -> list[Speed]:
    return [Speed(c, drafted[c], plain[c], throughput_ratio(drafted[c].wave_tokens, drafted[c].wave_s,
                                                             plain[c].wave_tokens, plain[c].wave_s, level=level))
            for c in sorted(drafted)]


def measure_speed(drafted: tuple[str, str], plain: tuple[str, str], prompts: list[list[int]], *,
                  max_new_tokens: int, concurrencies: list[int], level: float = 0.95,
                  progress: bool = False, settle: Callable[[], object] | None = None) -> list[Speed]:
    """Decode ``prompts`` on the drafted server and on the plain one (each ``(endpoint, served model)``), at each
    concurrency, alternating wave by wave; one :class:`Speed` per concurrency. A warm-up request on each
    server first, not counted. ``settle``, where given, is called before every wave and returns once the
    machine is quiet (both loopback servers idle)."""
    headers = auth_headers()
    sides: dict[str, dict[int, Side]] = {"drafted": {}, "plain": {}}
    with httpx.Client() as client:
        for endpoint, model in (drafted, plain):  # first requests pay for lazy initialisation: not counted
            complete(client, endpoint, model, prompts[0], max_tokens=4, headers=headers)
        for c in concurrencies:
            waves = [prompts[i:i + c] for i in range(0, len(prompts), c)]
            for name in sides:
                sides[name][c] = Side([], [], [], [])
            with tqdm(total=2 * len(waves), desc=f"[draftline] speed at concurrency {c}", unit="wave",
                      **bar_kwargs(progress)) as bar:
                for i, wave in enumerate(waves):
                    for name in (("drafted", "plain") if i % 2 == 0 else ("plain", "drafted")):
                        endpoint, model = drafted if name == "drafted" else plain
                        if settle is not None:
                            settle()
                        _wave(client, endpoint, model, wave, max_new_tokens, headers, sides[name][c])
                        bar.update(1)
    return pair(sides["drafted"], sides["plain"], level)


def speed_metrics(speeds: list[Speed]) -> dict[str, float]:
    return {k: v for s in speeds for k, v in s.metrics().items()}


def speed_summary(speeds: list[Speed]) -> dict[str, list[float]]:
    """For the command's JSON: ``{"c1": [speed-up, low, high], ...}``."""
    return {f"c{s.concurrency}": [round(s.speedup.value, 4), round(s.speedup.low, 4), round(s.speedup.high, 4)]
            for s in speeds}


def _at(speeds: list[Speed], c: int) -> Speed:
    return next(s for s in speeds if s.concurrency == c)


def fastest_k(sweep: dict[int, list[Speed]], c: int | None = None) -> int:
    """The num_speculative_tokens with the highest speed-up at concurrency ``c`` (default: the lowest swept; one
    request in flight is where a drafter has the most to give, and where a team feels it as latency)."""
    c = c or lowest(sweep)
    return max(sorted(sweep), key=lambda k: _at(sweep[k], c).speedup.value)


def lowest(sweep: dict[int, list[Speed]]) -> int:
    return min(s.concurrency for speeds in sweep.values() for s in speeds)


def sweep_metrics(sweep: dict[int, list[Speed]]) -> dict[str, float]:
    """``eval/sweep/k<k>/c<c>/{speedup,speedup_low,speedup_high,drafted_tokens_per_s}`` and, per concurrency,
    ``eval/sweep/c<c>/fastest_k``."""
    out: dict[str, float] = {}
    for k, speeds in sorted(sweep.items()):
        for s in speeds:
            p = f"{SWEEP}/k{k}/c{s.concurrency}"
            out.update({f"{p}/speedup": s.speedup.value, f"{p}/speedup_low": s.speedup.low,
                        f"{p}/speedup_high": s.speedup.high, f"{p}/drafted_tokens_per_s": s.drafted.tokens_per_s})
    for s in next(iter(sweep.values())):
        out[f"{SWEEP}/c{s.concurrency}/fastest_k"] = float(fastest_k(sweep, s.concurrency))
    return out


def sweep_text(sweep: dict[int, list[Speed]]) -> str:
    """``k=1 x0.71 [0.62, 0.80], k=2 ... at concurrency 1``: the lowest concurrency swept."""
    c = lowest(sweep)
    return ", ".join(f"k={k} x{_at(sweep[k], c).speedup.text()}" for k in sorted(sweep)) + f" at concurrency {c}"
