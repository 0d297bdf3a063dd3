"""A promotion policy file (``registry_policies/<stage>.yaml``) read strictly: its rules as typed models, an
unknown key answered with the key it was probably meant to be. Light (yaml and pydantic only), so ``promote``
refuses a bad policy before MLflow loads; :mod:`draftline.registry.policies` evaluates the rules."""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from draftline import environment
from draftline.config import shipped
from draftline.errors import ConfigError

__all__ = ["POLICIES_ENV", "Comparison", "EvaluationRule", "Policy", "SpeedRule", "TagValue", "load_policy",
           "policy_path", "policy_set"]


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


POLICIES_ENV = environment.REGISTRY_POLICIES.name  # a folder of <stage>.yaml kept by the team


def shipped_sets() -> list[str]:
    """The policy sets draftline ships beside its default one (``gpu``: a deployment on GPUs)."""
    return sorted(p.name for p in shipped("registry_policies").iterdir() if p.is_dir())


def _set_folder(value: str) -> Path:
    """A folder of ``<stage>.yaml``: a shipped set by name (``gpu``), else the folder the value names."""
    if "/" not in value and value in shipped_sets() and not Path(value).is_dir():
        return shipped("registry_policies", value)
    return Path(value)


def policy_path(stage: str, policy: str | None = None) -> Path:
    """The policy file for ``stage``: ``policy`` as given (a YAML file, or a shipped set's name such as ``gpu``),
    else ``$DRAFTLINE_REGISTRY_POLICIES`` (a folder, or a shipped set's name), else the default set."""
    if policy:
        return _set_folder(policy) / f"{stage.lower()}.yaml" if not policy.endswith((".yaml", ".yml")) \
            else Path(policy)
    folder = environment.REGISTRY_POLICIES.get()
    return _set_folder(folder) / f"{stage.lower()}.yaml" if folder else \
        shipped("registry_policies", f"{stage.lower()}.yaml")


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
