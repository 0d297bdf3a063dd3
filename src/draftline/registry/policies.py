"""Promotion policies (``registry_policies/*.yaml``): load them strictly, evaluate them against a version."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from draftline import environment
from draftline.config import shipped
from draftline.errors import ConfigError
from draftline.registry.confidence import paired_difference
from draftline.registry.evidence import HEADLINE, LOSSLESS, MEASURED, PROMPTS, SPEED, Evidence, on_digest, on_set


class Comparison(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str
    margin: float = Field(0.0, ge=0.0)
    confidence: float | None = Field(None, gt=0.5, lt=1.0, description="with it, the rule reads the paired "
                                     "difference prompt by prompt: its lower bound at this confidence must be "
                                     ">= -margin (without it: the point estimates, v >= w - margin)")


class TagValue(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str
    why: str = Field("", description="shown when the tag is missing or differs: why the value matters, the fix")


class EvaluationRule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(min_length=1, description="the evaluation set every eval/ metric rule reads: its name (as "
                      "prepare --name gave it) or a prefix of its digest (8+ hex digits)")
    prefer_measured: bool = Field(True, description="eval/acceptance_length is the measured one when both sides "
                                  "have it, else the teacher-forced one")
    require_lossless: bool = Field(True, description="a measured evaluation must have reproduced the verifier's "
                                   "greedy output token for token")
    min_prompts: int | None = Field(None, ge=1, description="the measured evaluation must have decoded at least "
                                    "this many prompts (fewer give intervals too wide to decide on)")


class SpeedRule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    concurrency: int = Field(1, ge=1, description="the concurrency evaluate measured the speed-up at "
                             "(evaluate --speed-concurrency)")
    value: float = Field(gt=0.0, description="the drafter must decode at least this many times as fast as the "
                         "verifier alone: the lower bound of the measured interval, not the point estimate")


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stage: str = Field(pattern="^(Staging|Production)$")
    evaluation: EvaluationRule | None = None
    require_tags: list[str] = Field(default_factory=list)
    require_tag_values: dict[str, TagValue] = Field(default_factory=dict)
    export_validated: bool = True
    min_metrics: dict[str, float] = Field(default_factory=dict)
    not_worse_than_current: Comparison | None = None
    not_worse_than_parent: Comparison | None = None
    same_verifier_as_current: bool = False
    min_speedup: SpeedRule | None = None


@dataclass
class RuleResult:
    rule: str
    passed: bool
    detail: str


POLICIES_ENV = environment.REGISTRY_POLICIES.name  # a folder of <stage>.yaml kept by the team


def policy_path(stage: str) -> Path:
    folder = environment.REGISTRY_POLICIES.get()
    return Path(folder) / f"{stage.lower()}.yaml" if folder else shipped("registry_policies", f"{stage.lower()}.yaml")


def policy_set(stage: str = "Production") -> str | None:
    """The evaluation set the ``stage`` policy judges by (None when it has no policy or names none)."""
    try:
        rule = load_policy(policy_path(stage)).evaluation
    except ConfigError:
        return None
    return rule.data if rule else None


def load_policy(path: Path | str) -> Policy:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"policy file {path} does not exist") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"policy file {where}: not valid YAML ({what}); fix that line") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"policy file {path} is not a mapping of rules (stage:, evaluation:, ...); see "
                          "registry_policies/production.yaml")
    try:
        return Policy(**(raw or {}))
    except (ValidationError, TypeError) as e:
        detail = "; ".join(_explain(x) for x in e.errors()) if isinstance(e, ValidationError) else str(e)
        raise ConfigError(f"policy file {path} is invalid: {detail}") from None


def _explain(error: ErrorDetails) -> str:
    """One pydantic error in words; an unknown key says which known key it was probably meant to be."""
    loc = ".".join(map(str, error["loc"]))
    if error.get("type") == "extra_forbidden":
        model: type[BaseModel] = Policy
        for part in error["loc"][:-1]:
            field = model.model_fields.get(str(part))
            ann = getattr(field, "annotation", None)
            inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
            if not inner:
                break
            model = inner[0]
        close = difflib.get_close_matches(str(error["loc"][-1]), list(model.model_fields), n=1)
        return f"{loc}: unknown key" + (f" (did you mean {close[0]}?)" if close else
                                        f" (known: {', '.join(model.model_fields)})")
    return f"{loc}: {error['msg']}"


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
        ok = mv.tags.get("export.validated") == "true"
        out.append(RuleResult("export validated", ok, f"export.validated={mv.tags.get('export.validated')}"))
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
        if other.tags.get("train.pairing") != mv.tags.get("train.pairing"):
            out.append(RuleResult(f"not worse than {label}", True,
                                  f"v{other.version} was trained in another pairing "
                                  f"({other.tags.get('train.pairing') or 'unshifted'}): its metrics are not comparable"))
            continue
        v, w = _metric(mv, cmp_.metric), _metric(other, cmp_.metric)
        ok = v is not None and (w is None or v >= w - cmp_.margin)
        out.append(RuleResult(f"{cmp_.metric} not worse than {label} (v{other.version}) - {cmp_.margin}", ok,
                              f"{v} vs {w}"))
    if policy.same_verifier_as_current and current is not None:
        a, b = mv.tags.get("verifier.name_or_path"), current.tags.get("verifier.name_or_path")
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
    if rule.min_prompts is not None and MEASURED in ev.metrics:  # teacher-forced only: no prompts decoded
        n = ev.metrics.get(PROMPTS)
        ok = n is not None and n >= rule.min_prompts
        out.append(RuleResult(f"measured on >= {rule.min_prompts} prompts", ok,
                              f"{int(n)} prompts" if n is not None else "the evaluation does not say how many "
                              f"prompts it measured: {evidence.version_hint}"))
    if rule.require_lossless and LOSSLESS in ev.metrics:
        ok = ev.metrics[LOSSLESS] == 1.0
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
    if cmp_.metric == HEADLINE:  # like with like: measured only when both were measured
        prefer = prefer and ev.headline_kind() == "measured" and theirs.headline_kind() == "measured"
    v, w = ev.value(cmp_.metric, prefer_measured=prefer), theirs.value(cmp_.metric, prefer_measured=prefer)
    if v is None or w is None:
        return RuleResult(rule, False, f"{cmp_.metric} missing ({v} vs {w})")
    kind = ("measured" if prefer else "teacher-forced") if cmp_.metric == HEADLINE else cmp_.metric
    detail = f"{kind} {v:.4f} vs {label} {w:.4f} ({v - w:+.4f}); version {ev.summary()}; {label} {theirs.summary()}"
    if cmp_.confidence is not None and cmp_.metric == HEADLINE and prefer:
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
    p = f"{SPEED}/c{rule.concurrency}"
    value, low, high = (ev.metrics.get(f"{p}/{k}") for k in ("speedup", "speedup_low", "speedup_high"))
    if value is None or low is None:
        return RuleResult(name, False, f"the evaluation measured no speed at concurrency {rule.concurrency}: "
                          f"evaluate on vLLM with --speed-concurrency {rule.concurrency}")
    tps = ev.metrics.get(f"{p}/drafted_tokens_per_s"), ev.metrics.get(f"{p}/plain_tokens_per_s")
    ok = low >= rule.value
    return RuleResult(name, ok, f"x{value:.3f} [{low:.3f}, {high:.3f}] ({tps[0]:.1f} vs {tps[1]:.1f} tokens/s); "
                      f"lower bound {low:.3f} {'>=' if ok else '<'} {rule.value}")
