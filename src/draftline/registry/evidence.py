"""Evaluation results read back: the ``eval/*`` metrics an evaluation attached to a drafter's LoggedModel, per
evaluation set (name and digest), as export carries them and promotion policies compare them.

``eval/acceptance_length`` is the headline: the measured acceptance length (vLLM's ``1 + accepted/drafts``)
when the evaluation measured it, else the teacher-forced one. Two drafters compare only on the same evaluation
set (same digest), and measured only against measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlflow.exceptions import MlflowException

from draftline import names
from draftline.errors import RegistryError
from draftline.mlflow_errors import absent, raise_failure
from draftline.registry.confidence import read_per_prompt
from draftline.registry.versions import model_id_of, resolve_version


@dataclass
class Evaluation:
    name: str  # the evaluation set's name, as prepare logged it
    digest: str  # the data set digest MLflow keeps (the first 36 hex digits of the shards' sha256)
    metrics: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None  # the evaluate run of the measured figure (its per_prompt.jsonl)
    per_prompt: list[dict] | None = None  # loaded for the policy's set by evidence_for

    def value(self, metric: str, *, prefer_measured: bool = True) -> float | None:
        if metric == names.EVAL_ACCEPTANCE_LENGTH:
            kind = self.headline_kind(prefer_measured)
            return self.metrics.get(names.MEASURED_ACCEPTANCE_LENGTH if kind == "measured" else names.TEACHER_FORCED_ACCEPTANCE_LENGTH)
        return self.metrics.get(metric)

    def headline_kind(self, prefer_measured: bool = True) -> str:
        return "measured" if prefer_measured and names.MEASURED_ACCEPTANCE_LENGTH in self.metrics else "teacher-forced"

    def summary(self) -> str:
        tf, me = self.metrics.get(names.TEACHER_FORCED_ACCEPTANCE_LENGTH), self.metrics.get(names.MEASURED_ACCEPTANCE_LENGTH)
        lo, hi = self.metrics.get(names.MEASURED_LOW), self.metrics.get(names.MEASURED_HIGH)
        band = f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""
        parts = [f"measured {me:.3f}{band}" if me is not None else "measured -",
                 f"teacher-forced {tf:.3f}" if tf is not None else "teacher-forced -"]
        return ", ".join(parts)


@dataclass
class Evidence:
    """The evaluations of the version, of the current Production and of the parent (``None``: random init),
    as :func:`evaluations_of` reads them; hints say how to evaluate each (what a policy's evaluation rules read)."""
    version: list[Evaluation] = field(default_factory=list)
    current: list[Evaluation] = field(default_factory=list)
    parent: list[Evaluation] | None = None
    version_hint: str = ""
    current_hint: str = ""
    parent_hint: str = ""


def evaluations_of(client, model_id: str | None) -> list[Evaluation]:
    """Every evaluation set ``model_id`` was evaluated on; the newest value of each metric. Nothing for a LoggedModel
    that is not there; one this user may not read is said, not taken for none."""
    if not model_id:
        return []
    try:
        model = client.get_logged_model(model_id)
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read the evaluations of LoggedModel {model_id}",
                          f"READ permission on the experiment of LoggedModel {model_id}")
        return []
    by_set: dict[tuple[str, str], tuple[Evaluation, dict[str, int]]] = {}
    for m in model.metrics or []:
        if not m.key.startswith("eval/") or not m.dataset_digest:
            continue
        ev, stamps = by_set.setdefault((m.dataset_name or "", m.dataset_digest),
                                       (Evaluation(m.dataset_name or "", m.dataset_digest), {}))
        if m.timestamp >= stamps.get(m.key, -1):
            ev.metrics[m.key], stamps[m.key] = m.value, m.timestamp
            if m.key == names.MEASURED_ACCEPTANCE_LENGTH:
                ev.run_id = getattr(m, "run_id", None)
    return [ev for ev, _ in by_set.values()]


def on_set(evaluations: list[Evaluation], wanted: str) -> Evaluation | None:
    """The evaluation on the set ``wanted`` names (its name, or a prefix of its digest of 8+ digits). Two sets
    of that name with different digests are ambiguous: refused."""
    hits = [e for e in evaluations if e.name == wanted or (len(wanted) >= 8 and e.digest.startswith(wanted))]
    digests = {e.digest for e in hits}
    if len(digests) > 1:
        raise RegistryError(f"evaluation set {wanted!r} names {len(digests)} data sets (digests "
                            f"{', '.join(sorted(d[:12] for d in digests))}): name it by digest in the policy")
    return hits[0] if hits else None


def on_digest(evaluations: list[Evaluation], digest: str) -> Evaluation | None:
    return next((e for e in evaluations if e.digest == digest), None)


def _parent_evaluations(client, mv) -> tuple[list[Evaluation] | None, str]:
    """The parent's evaluations (``None`` for a random init) and the ``--target`` that evaluates it: none where
    the parent's version or the finetune run is not there (a refusal or any other failure is said)."""
    source = mv.tags.get(names.PARENT_SOURCE, "none")
    if source in ("", "none"):
        return None, ""
    if source.startswith("models:/"):
        try:  # RegistryError: no such version, stage or URI (a refusal or another failure: TrackingError)
            parent = resolve_version(client, source)[1]
        except RegistryError:
            return [], source
        return evaluations_of(client, model_id_of(parent)), source
    target = mv.tags.get(names.INIT) or source
    sha = mv.tags.get(names.PARENT_SHA256, "")
    if not mv.run_id:
        return [], target
    try:
        experiment = client.get_run(mv.run_id).info.experiment_id
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read finetune run {mv.run_id} of models:/{mv.name}/{mv.version}",
                          f"READ permission on the experiment of run {mv.run_id}")
        return [], target
    found = client.search_logged_models([experiment], max_results=1,
                                        filter_string=f"tags.`draftline.parent.sha256` = '{sha}'").to_list()
    return (evaluations_of(client, found[0].model_id) if found else []), target


def evidence_for(client, name: str, mv, current, data: str):
    """What a policy with an evaluation rule compares: the evaluations of ``mv``, of ``current`` (the version
    in Production, or None) and of ``mv``'s parent, with the command that evaluates each."""
    def hint(target: str) -> str:
        return f"run `draftline evaluate --target {target} --data <the {data} set: runs:/<prepare run>/data>`"

    def with_evidence(evaluations: list[Evaluation]) -> list[Evaluation]:
        for ev in evaluations or []:  # the per-prompt evidence of the policy's set, for paired comparisons
            if (ev.name == data or (len(data) >= 8 and ev.digest.startswith(data))) and ev.run_id:
                ev.per_prompt = read_per_prompt(client, ev.run_id, ev.digest)
        return evaluations

    parent, parent_target = _parent_evaluations(client, mv)
    return Evidence(version=with_evidence(evaluations_of(client, model_id_of(mv))),
                    current=with_evidence(evaluations_of(client, model_id_of(current)) if current is not None
                                          else []),
                    parent=with_evidence(parent) if parent is not None else None, version_hint=hint(f"models:/{name}/{mv.version}"),
                    current_hint=hint(f"models:/{name}/{current.version}") if current is not None else "",
                    parent_hint=hint(parent_target) if parent_target else "")
