"""Promotion policies (``registry_policies/*.yaml``): evaluate them against a version (read by
:mod:`draftline.registry.policy_file`)."""

from __future__ import annotations

from dataclasses import dataclass

from draftline import names
from draftline.registry.confidence import paired_difference
from draftline.registry.evidence import Evidence, on_digest, on_set
from draftline.registry.policy_file import (
    POLICIES_ENV,
    Comparison,
    EvaluationRule,
    Policy,
    SpeedRule,
    TagValue,
    load_policy,
    policy_path,
    policy_set,
)

__all__ = ["POLICIES_ENV", "Comparison", "EvaluationRule", "Policy", "RuleResult", "SpeedRule", "TagValue",
           "evaluate", "load_policy", "policy_path", "policy_set"]


@dataclass
class RuleResult:
    rule: str
    passed: bool
    detail: str


def _metric(mv, key: str) -> float | None:
    value = mv.tags.get(f"metric.{key}")
    return float(value) if value not in (None, "") else None


def evaluate(policy: Policy, mv, *, current=None, parent=None, evidence: Evidence | None = None) -> list[RuleResult]:
    """Every rule with pass/fail and its numbers. ``current``/``parent`` are model versions or None; metric
    rules on ``eval/*`` read ``evidence`` on the policy's evaluation set, the others the version's tags."""
    out = []
    missing = [t for t in policy.require_tags if not mv.tags.get(t)]
    out.append(RuleResult("lineage tags present", not missing,
                          "all present" if not missing else "missing: " + ", ".join(missing)))
    for tag, want in policy.require_tag_values.items():
        got = mv.tags.get(tag)
        detail = f"{tag}={got}" if got == want.value else \
            f"{tag}={got or '(not recorded)'}, needs {want.value}" + (f": {want.why}" if want.why else "")
        out.append(RuleResult(f"{tag} is {want.value}", got == want.value, detail))
    if policy.export_validated:
        ok = mv.tags.get(names.EXPORT_VALIDATED) == "true"
        out.append(RuleResult("export validated", ok, f"export.validated={mv.tags.get(names.EXPORT_VALIDATED)}"))
    ev = None
    if policy.evaluation is not None:
        ev, result = _evaluated(policy.evaluation, evidence or Evidence())
        out.extend(result)
    out.extend(_floors(policy, mv, ev))
    if policy.min_speedup is not None:
        out.append(_speed_rule(policy.min_speedup, ev))
    for label, cmp_, other in (("current Production", policy.not_worse_than_current, current),
                               ("parent", policy.not_worse_than_parent, parent)):
        if cmp_ is None:
            continue
        if cmp_.metric.startswith("eval/"):
            out.append(_compare_evaluations(policy, cmp_, label, ev, evidence or Evidence(), other))
            continue
        if other is None:
            out.append(RuleResult(f"not worse than {label}", True, f"no {label} version: nothing to compare"))
            continue
        if other.tags.get(names.TRAIN_PAIRING) != mv.tags.get(names.TRAIN_PAIRING):
            out.append(RuleResult(f"not worse than {label}", True,
                                  f"v{other.version} was trained in another pairing "
                                  f"({other.tags.get(names.TRAIN_PAIRING) or 'unshifted'}): its metrics are not comparable"))
            continue
        v, w = _metric(mv, cmp_.metric), _metric(other, cmp_.metric)
        ok = v is not None and (w is None or v >= w - cmp_.margin)
        out.append(RuleResult(f"{cmp_.metric} not worse than {label} (v{other.version}) - {cmp_.margin}", ok,
                              f"{v} vs {w}"))
    if policy.same_verifier_as_current and current is not None:
        a, b = mv.tags.get(names.VERIFIER_NAME_OR_PATH), current.tags.get(names.VERIFIER_NAME_OR_PATH)
        out.append(RuleResult("same verifier as current Production", a == b, f"{a} vs {b}"))
    return out


def _floors(policy: Policy, mv, ev) -> list[RuleResult]:
    """``min_metrics``: ``eval/*`` from the evaluation on the policy's set, the others from the version's tags."""
    out = []
    for key, floor in policy.min_metrics.items():
        if key.startswith("eval/"):
            v = ev.value(key, prefer_measured=policy.evaluation.prefer_measured) if ev and policy.evaluation else None
            out.append(RuleResult(f"{key} >= {floor}", v is not None and v >= floor,
                                  (f"{key}={v:.4f} ({ev.summary()})" if v is not None else f"{key} not measured")
                                  if ev else "no evaluation on the policy's set"))
            continue
        v = _metric(mv, key)
        out.append(RuleResult(f"{key} >= {floor}", v is not None and v >= floor,
                              f"{key}={v}" if v is not None else f"{key} not recorded"))
    return out


def _evaluated(rule: EvaluationRule, evidence: Evidence):
    """The version's evaluation on the policy's set, and the rules about it."""
    ev = on_set(evidence.version, rule.data)
    if ev is None:
        return None, [RuleResult(f"evaluated on {rule.data}", False,
                                 f"no evaluation on {rule.data}: {evidence.version_hint}")]
    out = [RuleResult(f"evaluated on {rule.data}", True, f"{ev.name} {ev.digest[:12]}: {ev.summary()}")]
    if rule.min_prompts is not None and names.MEASURED_ACCEPTANCE_LENGTH in ev.metrics:  # teacher-forced only: no prompts decoded
        n = ev.metrics.get(names.MEASURED_PROMPTS)
        ok = n is not None and n >= rule.min_prompts
        out.append(RuleResult(f"measured on >= {rule.min_prompts} prompts", ok,
                              f"{int(n)} prompts" if n is not None else "the evaluation does not say how many "
                              f"prompts it measured: {evidence.version_hint}"))
    if rule.require_lossless and names.LOSSLESS in ev.metrics:
        ok = ev.metrics[names.LOSSLESS] == 1.0
        out.append(RuleResult("speculative decoding lossless", ok, "output identical to the verifier's greedy "
                              "output" if ok else "the measured run changed the verifier's output: a bug; do not "
                              "serve it, report it"))
    return ev, out


def _compare_evaluations(policy: Policy, cmp_: Comparison, label: str, ev, evidence: Evidence, other) -> RuleResult:
    """``cmp_.metric`` of the version vs ``label`` (current Production or parent) on the same evaluation set;
    measured against measured, else teacher-forced against teacher-forced; never across data sets."""
    rule = f"{cmp_.metric} not worse than {label}" + (f" - {cmp_.margin}" if cmp_.margin else "")
    theirs_all = evidence.parent if label == "parent" else evidence.current
    hint = evidence.parent_hint if label == "parent" else evidence.current_hint
    if theirs_all is None:  # only the parent's can be missing: a random init
        return RuleResult(rule, True, "random init: no parent to compare with")
    if label != "parent" and other is None:
        return RuleResult(rule, True, f"no {label} version: nothing to compare")
    if ev is None or policy.evaluation is None:  # ev is found by the policy's evaluation rule
        return RuleResult(rule, False, "the version has no evaluation on the policy's set")
    theirs = on_digest(theirs_all, ev.digest)
    if theirs is None:
        elsewhere = on_set(theirs_all, policy.evaluation.data) if theirs_all else None
        why = (f"the {label} was evaluated on another data set named {elsewhere.name} ({elsewhere.digest[:12]}, "
               f"not {ev.digest[:12]}): numbers from different evaluation sets are not compared"
               if elsewhere else f"the {label} has no evaluation on {ev.name} ({ev.digest[:12]})")
        return RuleResult(rule, False, f"{why}: {hint}")
    prefer = policy.evaluation.prefer_measured
    if cmp_.metric == names.EVAL_ACCEPTANCE_LENGTH:  # like with like: measured only when both were measured
        prefer = prefer and ev.headline_kind() == "measured" and theirs.headline_kind() == "measured"
    v, w = ev.value(cmp_.metric, prefer_measured=prefer), theirs.value(cmp_.metric, prefer_measured=prefer)
    if v is None or w is None:
        return RuleResult(rule, False, f"{cmp_.metric} missing ({v} vs {w})")
    kind = ("measured" if prefer else "teacher-forced") if cmp_.metric == names.EVAL_ACCEPTANCE_LENGTH else cmp_.metric
    detail = f"{kind} {v:.4f} vs {label} {w:.4f} ({v - w:+.4f}); version {ev.summary()}; {label} {theirs.summary()}"
    if cmp_.confidence is not None and cmp_.metric == names.EVAL_ACCEPTANCE_LENGTH and prefer:
        return _compare_paired(cmp_, cmp_.confidence, label, rule, ev, theirs, hint,
                               f"{kind} {v:.4f} vs {label} {w:.4f} ({v - w:+.4f})")
    if cmp_.confidence is not None:  # teacher-forced on one side at least: no per-prompt decoding to pair
        detail += "; teacher-forced, so the point estimates (the paired form needs both sides measured)"
    return RuleResult(rule, v >= w - cmp_.margin, detail)


def _compare_paired(cmp_: Comparison, confidence: float, label: str, rule: str, ev, theirs, hint: str,
                    point: str) -> RuleResult:
    """The paired form: the difference prompt by prompt on the prompts both sides measured, with its bootstrap
    interval; the rule holds when the interval's lower bound is >= -margin."""
    rule = f"{rule} at {confidence:.0%} (paired)"
    for who, e, fix in (("the version", ev, "rerun its evaluation"), (f"the {label}", theirs, hint)):
        if not e.per_prompt:
            return RuleResult(rule, False, f"{who} has no per-prompt evidence on {ev.name} (evaluated before "
                              f"draftline kept it): {fix}")
    diff = paired_difference(ev.per_prompt, theirs.per_prompt, level=confidence)
    if diff is None:
        return RuleResult(rule, False, f"the version and the {label} share no prompt on {ev.name}: evaluate both "
                          "with the same --max-prompts")
    ok = diff.low >= -cmp_.margin
    words = (f"lower bound {diff.low:+.4f} {'>=' if ok else '<'} -{cmp_.margin}: "
             + ("not worse, at this confidence" if ok else "could be worse by more than the margin"))
    return RuleResult(rule, ok, f"{point}; paired delta {diff.value:+.4f} [{diff.low:+.4f}, {diff.high:+.4f}] on "
                      f"{diff.n} prompts; {words}")


def _speed_rule(rule: SpeedRule, ev) -> RuleResult:
    """The speed-up the drafter buys, on the policy's evaluation set: the lower bound of its paired interval
    over waves must reach ``rule.value`` (a point estimate above it with an interval below it does not pass)."""
    name = f"speed-up at concurrency {rule.concurrency} >= {rule.value}"
    if ev is None:
        return RuleResult(name, False, "no evaluation on the policy's set")
    p = f"{names.SPEED}/c{rule.concurrency}"
    value, low, high = (ev.metrics.get(f"{p}/{k}") for k in ("speedup", "speedup_low", "speedup_high"))
    if value is None or low is None:
        return RuleResult(name, False, f"the evaluation measured no speed at concurrency {rule.concurrency}: "
                          f"evaluate on vLLM with --speed-concurrency {rule.concurrency}")
    waves = ev.metrics.get(f"{p}/waves")
    if waves is not None and waves < 2:
        return RuleResult(name, False, f"x{value:.3f} from {int(waves)} wave: no interval to decide on; evaluate "
                          f"on at least {2 * rule.concurrency} prompts (--max-prompts)")
    tps = ev.metrics.get(f"{p}/drafted_tokens_per_s"), ev.metrics.get(f"{p}/plain_tokens_per_s")
    ok = low >= rule.value
    return RuleResult(name, ok, f"x{value:.3f} [{low:.3f}, {high:.3f}] ({tps[0]:.1f} vs {tps[1]:.1f} tokens/s); "
                      f"lower bound {low:.3f} {'>=' if ok else '<'} {rule.value}")
