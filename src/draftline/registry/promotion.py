"""What a change of stage must satisfy: promotion through a policy, and rollback past its comparisons.

Both change a stage the one way ``registry/stages.py`` makes it (under the promotion lock, stages made to follow
their aliases first, then the tags, the alias and the stage); here is the policy each change is evaluated
against, inside the lock and against the holder as it is then, and the rule results as they are printed.
"""

from __future__ import annotations

import getpass
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.exceptions import MlflowException

from draftline import names
from draftline.console import say
from draftline.errors import DraftlineError, RegistryError
from draftline.mlflow_errors import absent, denied, mlflow_error, raise_failure, unavailable
from draftline.registry.evidence import evidence_for
from draftline.registry.policies import evaluate, load_policy, policy_path
from draftline.registry.retry import retrying
from draftline.registry.stages import ALIASES, holders, move_stage, now, promotion_lock, stage_splits, sync_stages
from draftline.registry.versions import resolve_version


def _get_version(client, name: str, version: str):
    try:
        return client.get_model_version(name, str(version))
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read models:/{name}/{version}", f"READ permission on registered model {name}")
        raise RegistryError(f"models:/{name}/{version} does not exist: {mlflow_error(e)}") from None


def _guarded(what: str, name: str, fn):
    """``fn()`` (one whole change, under the lock), tried again while the server is unavailable; MLflow's
    failures become one message."""
    try:
        return retrying(what, fn)
    except DraftlineError:
        raise
    except MlflowException as e:
        if unavailable(e):  # cannot happen (retrying turns it into ServerUnavailable); kept for clarity
            raise
        if denied(e):
            user = os.environ.get("MLFLOW_TRACKING_USERNAME", "this user")
            raise RegistryError(f"permission denied: {user} may read {name} but not change its stages; ask an "
                                f"MLflow admin for EDIT permission on registered model {name}") from None
        raise RegistryError(f"cannot {what}: {mlflow_error(e)}") from None


def _parent_version(client, mv):
    source = mv.tags.get(names.PARENT_SOURCE, "")
    if not source.startswith("models:/"):
        return None
    try:
        return resolve_version(client, source)[1]
    except RegistryError:
        return None


def promote(client, name: str, version: str, stage: str, *, policy_file: str | Path | None = None,
            dry_run: bool = False, demote: bool = False) -> dict:
    """Evaluate the stage's policy; on pass point the stage's alias at ``version`` and move the stage with it
    (archiving the previous holder). Returns ``{"results", "version", "stage", "changed", "message"}``;
    raises :class:`RegistryError` when a rule fails (nothing changes)."""
    stage = stage.capitalize()
    if stage not in ALIASES:
        raise RegistryError(f"stage {stage} is not Staging or Production")
    policy_file = Path(policy_file) if policy_file else policy_path(stage)
    policy = load_policy(policy_file)
    mv = _get_version(client, name, version)
    version = str(mv.version)

    def check(truth):
        if truth[stage] == version:
            return []
        if truth["Production"] == version and not demote:  # Staging -> Production is the usual way up
            raise RegistryError(f"models:/{name}/{version} holds Production; moving it to {stage} would leave "
                                "Production empty. Promote another version to Production first (or roll back), "
                                "or pass --demote")
        current = _get_version(client, name, truth["Production"]) if truth["Production"] else None
        evidence = None
        if policy.evaluation is not None:
            evidence = evidence_for(client, name, mv, current, policy.evaluation.data)
        results = evaluate(policy, mv, current=current, parent=_parent_version(client, mv), evidence=evidence)
        if any(not r.passed for r in results):
            raise RegistryError(f"models:/{name}/{version} does not meet {policy_file.name}; nothing changed:\n"
                                + format_results(results))
        return results

    if dry_run:
        truth = holders(client, name)
        for split in stage_splits(client, name, aliases={ALIASES[s]: v for s, v in truth.items() if v},
                                  versions=client.search_model_versions(f"name='{name}'")):
            say(split.warning())  # a real promotion would put the stage back on its alias first
        results = check(truth)
        message = (f"dry run: models:/{name}/{version} already holds {stage}; nothing would change"
                   if truth[stage] == version else
                   f"dry run: models:/{name}/{version} would move to {stage}; nothing changed")
        return {"results": results, "version": version, "stage": stage, "changed": False, "message": message}

    token, tried = uuid.uuid4().hex, Attempt()  # one lock token for every try

    def change():
        with promotion_lock(client, name, token=token):
            synced = sync_stages(client, name)  # also finishes what a cut-off earlier try had begun
            truth = synced.holders
            results = check(truth)  # against the holder as it is now, with no other promotion in between
            if truth[stage] == version:  # held already (its stage put back on it just now, perhaps)
                return results, tried.began or stage in synced.repaired
            tried.began = True
            key = stage.lower()
            tags = {f"promoted.{key}.by": getpass.getuser(), f"promoted.{key}.at": now(),
                    f"promoted.{key}.policy": policy_file.name,
                    f"promoted.{key}.previous": truth[stage] or "none"}
            vacate = next((s for s, v in truth.items() if v == version and s != stage), None)
            move_stage(client, name, version, stage, tags, vacate=vacate)
            sync_stages(client, name)
            return results, True

    results, changed = _guarded(f"promote models:/{name}/{version} to {stage}", name, change)
    message = (f"models:/{name}/{version} is now {stage} (alias @{stage.lower()})" if changed else
               f"models:/{name}/{version} already holds {stage} (alias @{stage.lower()}); nothing changed")
    return {"results": results, "version": version, "stage": stage, "changed": changed, "message": message}


@dataclass
class Attempt:
    """What an earlier try of the same promotion or rollback began to write. A try cut off by a restarting server
    is run again (:func:`_guarded`); the next one reads the registry afresh and uses this to tell its own change,
    made before the cut, from one nobody made."""

    began: bool = False
    to: str | None = None  # rollback: the version it put in Production
    previous: str | None = None  # rollback: the version that held Production before
    results: list = field(default_factory=list)


def rollback(client, name: str, *, to: str | None = None, reason: str, policy_file: str | Path | None = None
             ) -> dict:
    """Production goes back to the version it held before (or ``to``). The integrity rules of the Production
    policy still apply (lineage tags, pairing, export validated, minimum metrics); "not worse than the current
    Production" does not: that is what a rollback overrides. Recorded as version tags (who, when, why, from)."""
    if not reason.strip():
        raise RegistryError("a rollback needs a reason: pass --reason TEXT (it is recorded on the version)")
    policy_file = Path(policy_file) if policy_file else policy_path("Production")
    policy = load_policy(policy_file)
    # a rollback returns to a version that served before: integrity rules apply, comparisons and evaluation
    # requirements (which a version from before evaluations cannot meet) do not
    parent_rule = policy.not_worse_than_parent
    policy = policy.model_copy(update={
        "not_worse_than_current": None, "evaluation": None,
        "min_metrics": {k: v for k, v in policy.min_metrics.items() if not k.startswith("eval/")},
        "not_worse_than_parent": None if parent_rule and parent_rule.metric.startswith("eval/") else parent_rule})

    token, tried = uuid.uuid4().hex, Attempt()  # one lock token for every try

    def change():
        with promotion_lock(client, name, token=token):
            truth = sync_stages(client, name).holders  # also finishes what a cut-off earlier try had begun
            if tried.began and truth["Production"] == tried.to:  # an earlier try got through before the cut
                return tried.results, tried.to, tried.previous
            current = truth["Production"]
            if current is None:
                raise RegistryError(f"no version of {name} is in Production: nothing to roll back; promote one")
            target = to
            if target is None:
                target = _get_version(client, name, current).tags.get("promoted.production.previous")
                if target in (None, "", "none"):
                    raise RegistryError(f"models:/{name}/{current} records no previous Production version; pass "
                                        "--to VERSION")
            mv = _get_version(client, name, target)
            if str(mv.version) == current:
                raise RegistryError(f"models:/{name}/{current} already holds Production; pass another --to")
            results = evaluate(policy, mv, current=None, parent=_parent_version(client, mv))
            if any(not r.passed for r in results):
                raise RegistryError(f"models:/{name}/{mv.version} does not meet the integrity rules of "
                                    f"{policy_file.name}; nothing changed:\n" + format_results(results))
            tags = {"rolled_back.by": getpass.getuser(), "rolled_back.at": now(), "rolled_back.reason": reason,
                    "rolled_back.from": current, "promoted.production.previous": current}
            vacate = next((s for s, v in truth.items() if v == str(mv.version) and s != "Production"), None)
            tried.began, tried.to, tried.results, tried.previous = True, str(mv.version), results, current
            move_stage(client, name, str(mv.version), "Production", tags, vacate=vacate)
            sync_stages(client, name)
            return results, str(mv.version), current

    results, version, previous = _guarded(f"roll back {name}", name, change)
    return {"results": results, "version": version, "stage": "Production", "changed": True,
            "message": f"models:/{name}/{version} is Production again (alias @production); "
                       f"v{previous} left it: {reason}"}


def format_results(results) -> str:
    if not results:
        return ""
    width = max(len(r.rule) for r in results)
    return "\n".join(f"  {'PASS' if r.passed else 'FAIL'}  {r.rule.ljust(width)}  {r.detail}" for r in results)
