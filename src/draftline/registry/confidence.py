"""How sure an acceptance figure is: per-prompt evidence, a bootstrap interval over prompts, and the paired
difference of two drafters measured on the same prompts; and how sure a speed-up is (:func:`throughput_ratio`).

Acceptance length is a ratio over the whole set, ``1 + sum(accepted) / sum(drafts)``, so a resample draws
prompts with replacement and recomputes the ratio (prompts of different lengths weigh as they do in the figure
itself). The paired difference resamples the *same* prompt indices for both drafters, which removes the
between-prompt variance both share: two drafters equally good on a set show a difference near 0 with a narrow
interval, where two independent intervals would overlap widely. Seeded, so a figure is reproducible.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from draftline import tracking
from draftline.mlflow_errors import absent, raise_failure

PER_PROMPT_FILE = "per_prompt.jsonl"
DEFAULT_RESAMPLES = 2000


def prompt_key(prompt: list[int]) -> str:
    """A prompt's identity across evaluations (the sha256 of its token ids, 16 hex digits)."""
    return hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()[:16]


@dataclass
class Interval:
    value: float
    low: float
    high: float
    level: float
    n: int

    @property
    def width(self) -> float:
        return self.high - self.low

    def text(self, unit: str | None = None) -> str:
        """``1.18 [1.08, 1.29]``; from one unit (a prompt, a wave: no spread to bootstrap) ``0.84 (1 wave: no
        interval)``, or ``(n=1: ...)`` where no ``unit`` is named."""
        if self.n < 2:
            return f"{self.value:.2f} ({f'{self.n} {unit}' if unit else f'n={self.n}'}: no interval)"
        return f"{self.value:.2f} [{self.low:.2f}, {self.high:.2f}]"


def _ratio(drafts, accepted, idx) -> float:
    d = sum(drafts[i] for i in idx)
    return 1.0 + sum(accepted[i] for i in idx) / d if d else 1.0


def _quantiles(values: list[float], level: float) -> tuple[float, float]:
    values = sorted(values)
    lo_i = int((1 - level) / 2 * (len(values) - 1))
    hi_i = int(round((1 + level) / 2 * (len(values) - 1)))
    return values[lo_i], values[hi_i]


def acceptance_of(rows: list[dict]) -> float:
    """Acceptance length of ``rows`` (per-prompt ``drafts``/``accepted``): ``1 + accepted / drafts`` over them all."""
    return _ratio([r["drafts"] for r in rows], [r["accepted"] for r in rows], range(len(rows)))


def acceptance_interval(rows: list[dict], *, level: float = 0.95, resamples: int = DEFAULT_RESAMPLES,
                        seed: int = 0) -> Interval:
    """Acceptance length of ``rows`` (per-prompt ``drafts``/``accepted``) with its percentile bootstrap interval."""
    drafts, accepted = [r["drafts"] for r in rows], [r["accepted"] for r in rows]
    n = len(rows)
    value = _ratio(drafts, accepted, range(n))
    if n < 2:
        return Interval(value, value, value, level, n)
    rng = random.Random(seed)
    boot = [_ratio(drafts, accepted, [rng.randrange(n) for _ in range(n)]) for _ in range(resamples)]
    lo, hi = _quantiles(boot, level)
    return Interval(value, lo, hi, level, n)


def throughput_ratio(ours_tokens: list[int], ours_s: list[float], theirs_tokens: list[int], theirs_s: list[float],
                     *, level: float = 0.95, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval:
    """Tokens per second of ``ours`` over ``theirs``, measured in paired units (waves of the same prompts): the
    ratio of sums, with the paired percentile bootstrap interval over the units."""
    n = len(ours_s)

    def ratio(idx) -> float:
        ours = sum(ours_tokens[i] for i in idx) / max(sum(ours_s[i] for i in idx), 1e-12)
        theirs = sum(theirs_tokens[i] for i in idx) / max(sum(theirs_s[i] for i in idx), 1e-12)
        return ours / theirs if theirs else float("nan")

    value = ratio(range(n))
    if n < 2:
        return Interval(value, value, value, level, n)
    rng = random.Random(seed)
    lo, hi = _quantiles([ratio([rng.randrange(n) for _ in range(n)]) for _ in range(resamples)], level)
    return Interval(value, lo, hi, level, n)


def paired_difference(ours: list[dict], theirs: list[dict], *, level: float = 0.95,
                      resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval | None:
    """Acceptance length of ``ours`` minus ``theirs`` on the prompts both measured (matched by ``key``), with the
    paired bootstrap interval; None when they share no prompt."""
    by_key = {r["key"]: r for r in theirs}
    pairs = [(r, by_key[r["key"]]) for r in ours if r["key"] in by_key]
    if not pairs:
        return None
    a_d, a_a = [p[0]["drafts"] for p in pairs], [p[0]["accepted"] for p in pairs]
    b_d, b_a = [p[1]["drafts"] for p in pairs], [p[1]["accepted"] for p in pairs]
    n = len(pairs)
    value = _ratio(a_d, a_a, range(n)) - _ratio(b_d, b_a, range(n))
    if n < 2:
        return Interval(value, value, value, level, n)
    rng = random.Random(seed)
    boot = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(_ratio(a_d, a_a, idx) - _ratio(b_d, b_a, idx))
    lo, hi = _quantiles(boot, level)
    return Interval(value, lo, hi, level, n)


def carried_path(digest: str) -> str:
    """Where a run that carries another run's evaluation (export) keeps its per-prompt evidence."""
    return f"evaluations/{digest[:12]}/{PER_PROMPT_FILE}"


def carry_per_prompt(evaluation_run_id: str, digest: str) -> None:
    """Copy an evaluation run's per-prompt evidence into the active run (export carries evaluations onto the
    version's LoggedModel, whose metrics then name the export run)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = tracking.client().download_artifacts(evaluation_run_id, PER_PROMPT_FILE, tmp)
        except MlflowException as e:
            if not absent(e):
                raise_failure(e, f"read {PER_PROMPT_FILE} of evaluation run {evaluation_run_id}",
                              f"READ permission on the experiment of run {evaluation_run_id}")
            return  # an evaluation from before per-prompt evidence
        mlflow.log_artifact(path, artifact_path=str(Path(carried_path(digest)).parent))


def read_per_prompt(client, run_id: str, digest: str | None = None) -> list[dict] | None:
    """The per-prompt evidence of run ``run_id`` (an evaluation, or an export carrying one for ``digest``);
    None when there is none (an older evaluation); a run this user may not read is said, not taken for none."""
    for name in (PER_PROMPT_FILE, carried_path(digest) if digest else None):
        if name is None:
            continue
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = client.download_artifacts(run_id, name, tmp)
                return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        except MlflowException as e:
            if not absent(e):
                raise_failure(e, f"read {name} of run {run_id}", f"READ permission on the experiment of run {run_id}")
            continue  # no such artifact
    return None
