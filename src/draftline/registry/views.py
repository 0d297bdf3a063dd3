"""What the registry holds, for people: ``draftline list`` (models, versions, stages, aliases, headline
metrics, parents) and ``draftline compare`` (versions side by side, their parents included)."""

from __future__ import annotations

from mlflow.exceptions import MlflowException

from draftline import names
from draftline.console import say
from draftline.errors import RegistryError
from draftline.mlflow_errors import absent, mlflow_error, raise_failure, registry_uri, unknown_model_hint
from draftline.registry.evidence import evaluations_of, on_set
from draftline.registry.policies import policy_set
from draftline.registry.stages import LOCK_SUFFIX, stage_splits
from draftline.registry.versions import model_id_of, resolve_version


def _aliases_of(model) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for alias, version in (model.aliases or {}).items():
        out.setdefault(str(version), []).append(alias)
    return out


def list_models(client) -> list[dict]:
    rows = []
    for m in client.search_registered_models():
        if m.name.endswith(LOCK_SUFFIX):
            continue
        versions = client.search_model_versions(f"name='{m.name}'")
        for split in stage_splits(client, m.name, aliases=m.aliases or {}, versions=versions):
            say(split.warning())
        rows.append({"name": m.name, "versions": len(versions),
                     "latest": max((int(v.version) for v in versions), default=None),
                     "aliases": {a: str(v) for a, v in (m.aliases or {}).items()}})
    return sorted(rows, key=lambda r: r["name"])


def measured_on_policy_set(client, mv) -> str | None:
    """``measured 1.59 [1.48, 1.70] on 32`` for ``mv`` on the Production policy's evaluation set, if evaluated."""
    wanted = policy_set()
    if not wanted:
        return None
    try:
        ev = on_set(evaluations_of(client, model_id_of(mv)), wanted)
    except RegistryError:
        return None
    if ev is None or names.MEASURED_ACCEPTANCE_LENGTH not in ev.metrics:
        return None
    lo, hi = (ev.metrics.get(k) for k in (names.MEASURED_LOW, names.MEASURED_HIGH))
    band = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
    n = ev.metrics.get(names.MEASURED_PROMPTS)
    return f"{ev.metrics[names.MEASURED_ACCEPTANCE_LENGTH]:.2f}{band}" + (f" on {int(n)}" if n else "")


def list_versions(client, name: str) -> list[dict]:
    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"list the versions of {name}", f"READ permission on registered model {name}")
        hint = unknown_model_hint(client, name) or "; `draftline list` shows the models there are"
        raise RegistryError(f"registered model {name} does not exist on {registry_uri()}: {mlflow_error(e)}"
                            + hint) from None
    aliases = _aliases_of(model)
    versions = client.search_model_versions(f"name='{name}'")
    for split in stage_splits(client, name, aliases=model.aliases or {}, versions=versions):
        say(split.warning())
    rows = []
    for v in sorted(versions, key=lambda v: int(v.version)):
        tags = v.tags
        rows.append({"version": str(v.version), "stage": v.current_stage, "aliases": aliases.get(str(v.version), []),
                     "metrics": {k: float(tags[f"metric.{k}"]) for k in names.HEADLINE_METRICS if f"metric.{k}" in tags},
                     "parent": tags.get(names.PARENT_SOURCE), "pairing": tags.get(names.TRAIN_PAIRING),
                     "model_id": model_id_of(v), "created": v.creation_timestamp,
                     "measured": measured_on_policy_set(client, v)})
    return rows


def render_models(rows: list[dict]) -> str:
    if not rows:
        return "no registered models"
    lines = [f"{'model':<32} {'versions':>8} {'latest':>6}  aliases"]
    for r in rows:
        aliases = ", ".join(f"@{a}=v{v}" for a, v in sorted(r["aliases"].items())) or "-"
        lines.append(f"{r['name']:<32} {r['versions']:>8} {str(r['latest']):>6}  {aliases}")
    return "\n".join(lines)


def render_versions(name: str, rows: list[dict]) -> str:
    if not rows:
        return f"{name} has no versions"
    lines = [f"{'version':>7}  {'stage':<10} {'aliases':<22} {names.VAL_ACCEPTANCE_LENGTH:>22}  {'measured [95% interval]':<26} parent"]
    for r in rows:
        metric = r["metrics"].get(names.VAL_ACCEPTANCE_LENGTH)
        lines.append(f"{r['version']:>7}  {r['stage']:<10} {', '.join('@' + a for a in r['aliases']) or '-':<22} "
                     f"{'-' if metric is None else f'{metric:.4f}':>22}  {r.get('measured') or '-':<26} "
                     f"{r['parent'] or '-'}")
    return "\n".join(lines)


def compare(client, name: str, versions: list[str]) -> dict:
    """``{"columns": [...], "rows": {key: [value per column]}}``: the versions asked for, then each one's
    registered parent not already among them; lineage first, then headline metrics, then where each stands."""
    columns, mvs = [], []
    for v in versions:
        _, mv = resolve_version(client, v if v.startswith("models:/") else f"models:/{name}/{v}")
        columns.append(f"v{mv.version}")
        mvs.append(mv)
    for mv in list(mvs):
        source = mv.tags.get(names.PARENT_SOURCE, "")
        if source.startswith("models:/"):
            with_name, parent = resolve_version(client, source)
            label = f"parent v{parent.version}" if with_name == name else f"parent {with_name}/v{parent.version}"
            if with_name != name or f"v{parent.version}" not in columns:
                if label not in columns:
                    columns.append(label)
                    mvs.append(parent)
    keys = [*names.VERSION_TAG_PARAMS, names.FINETUNE_RUN_ID, names.EXPORT_SHA256, *(f"metric.{k}" for k in names.HEADLINE_METRICS)]
    rows = {k.removeprefix("metric."): [mv.tags.get(k) for mv in mvs] for k in keys}
    rows["eval/measured (policy set)"] = [measured_on_policy_set(client, mv) for mv in mvs]
    rows["stage"] = [mv.current_stage for mv in mvs]
    return {"name": name, "columns": columns, "rows": rows}


def render_compare(table: dict) -> str:
    cols = table["columns"]
    width = max(len(k) for k in table["rows"])
    cell = max(14, *(len(c) for c in cols))

    def short(v):
        s = "-" if v in (None, "") else str(v)
        return s if len(s) <= cell else s[: cell - 1] + "…"

    lines = [f"{'':<{width}}  " + "  ".join(f"{c:<{cell}}" for c in cols)]
    for k, values in table["rows"].items():
        differs = len({str(v) for v in values}) > 1
        label = k + ("*" if differs else "")
        lines.append(f"{label:<{width + 1}} " + "  ".join(f"{short(v):<{cell}}" for v in values))
    lines.append(f"(* the versions differ; {table['name']})")
    return "\n".join(lines)
