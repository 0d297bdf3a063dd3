"""Promotion policies (``registry_policies/*.yaml``): load them strictly, evaluate them against a version."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftline.errors import ConfigError


class Comparison(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str
    margin: float = Field(0.0, ge=0.0)


class TagValue(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str
    why: str = Field("", description="shown when the tag is missing or differs: why the value matters, the fix")


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stage: str = Field(pattern="^(Staging|Production)$")
    require_tags: list[str] = Field(default_factory=list)
    require_tag_values: dict[str, TagValue] = Field(default_factory=dict)
    export_validated: bool = True
    min_metrics: dict[str, float] = Field(default_factory=dict)
    not_worse_than_current: Comparison | None = None
    not_worse_than_parent: Comparison | None = None
    same_verifier_as_current: bool = False


@dataclass
class RuleResult:
    rule: str
    passed: bool
    detail: str


def policy_path(stage: str) -> Path:
    from draftline.config import shipped

    return shipped("registry_policies", f"{stage.lower()}.yaml")


def load_policy(path: Path | str) -> Policy:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"policy file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"policy file {path} is not valid YAML: {e}") from None
    try:
        return Policy(**(raw or {}))
    except (ValidationError, TypeError) as e:
        detail = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()) \
            if isinstance(e, ValidationError) else str(e)
        raise ConfigError(f"policy file {path} is invalid: {detail}") from None


def _metric(mv, key: str) -> float | None:
    value = mv.tags.get(f"metric.{key}")
    return float(value) if value not in (None, "") else None


def evaluate(policy: Policy, mv, *, current=None, parent=None) -> list[RuleResult]:
    """Every rule with pass/fail and its numbers. ``current``/``parent`` are model versions or None."""
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
    for key, floor in policy.min_metrics.items():
        v = _metric(mv, key)
        out.append(RuleResult(f"{key} >= {floor}", v is not None and v >= floor,
                              f"{key}={v}" if v is not None else f"{key} not recorded"))
    for label, cmp_, other in (("current Production", policy.not_worse_than_current, current),
                               ("parent", policy.not_worse_than_parent, parent)):
        if cmp_ is None:
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
