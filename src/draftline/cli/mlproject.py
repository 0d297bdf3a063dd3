"""The MLproject file, generated from the stages' typed settings so that every setting is an entry-point
parameter and every default comes from the settings (an empty value means "unset").

``python -m draftline.cli.mlproject > MLproject`` rewrites it; ``tests/unit/cli/test_mlproject.py`` fails when the
committed file and the settings disagree.
"""

from __future__ import annotations

from pydantic import BaseModel

from draftline.config import EvaluateConfig, ExportConfig, FinetuneConfig, PrepareConfig

HEADER = """\
# Generated from src/draftline/config.py by `python -m draftline.cli.mlproject > MLproject`: do not edit by hand.
name: draftline

# `mlflow run . -e finetune -P data=runs:/<prepare run>/data -P init=aq-medai`
# With the venv from ./setup.sh activated, add `--env-manager local`. Every setting of every stage is a
# parameter, with the setting's own default (`draftline <stage> --help` describes them); empty means unset.
conda_env: conda.yaml

entry_points:
"""
def default_of(field) -> str | None:
    """The MLproject default of a setting: its own default as a string (MLflow logs every entry-point
    parameter as a run param, and draftline logs some under the same names: they must agree), "" for an unset
    optional one, None for a required one."""
    if field.is_required():
        return None
    value = field.default
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


STAGES: dict[str, type[BaseModel]] = {"prepare": PrepareConfig, "finetune": FinetuneConfig, "evaluate": EvaluateConfig,
                                      "export": ExportConfig}
# `main` chains the three; `--set STEP.KEY=VALUE` reaches any other setting.
MAIN = {"conversations": None, "verifier": None, "init": default_of(FinetuneConfig.model_fields["init"]),
        "registered_model": default_of(ExportConfig.model_fields["registered_model"])}


def _entry(name: str, params: dict[str, str | None]) -> str:
    lines = [f"  {name}:", "    parameters:"]
    for key, default in params.items():
        lines.append(f"      {key}: {{type: string}}" if default is None else
                     f"      {key}: {{type: string, default: \"{default}\"}}")
    flags = " ".join(f"--{k.replace('_', '-')} {{{k}}}" for k in params)
    lines += ["    command: >-", f"      python entrypoints/{name}.py {flags}", ""]
    return "\n".join(lines)


def render() -> str:
    out = [HEADER.rstrip("\n")]
    for name, model in STAGES.items():
        out.append(_entry(name, {k: default_of(f) for k, f in model.model_fields.items()}))
    out.append(_entry("main", MAIN))
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
