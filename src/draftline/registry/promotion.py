"""Where a version stands: promotion through a policy, rollback, and the rule that keeps stage and alias equal.

The aliases (``@production``, ``@staging``) are the truth: setting one is a single atomic write. The stage is
kept equal to its alias, because ``models:/NAME/Production`` (what deployments pull) resolves through stages.
Every change writes the alias first, then the stage; :func:`sync_stages` makes the stages follow the aliases
and runs before and after every change, so a promoter killed between its two writes is repaired by the next
command. Promotions of one model are serialised by a short-lived registry lock (see :func:`promotion_lock`).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from draftline import environment
from draftline.console import say
from draftline.errors import DraftlineError, RegistryError
from draftline.registry.evidence import evidence_for
from draftline.registry.policies import evaluate, load_policy, policy_path
from draftline.registry.retry import retrying, unavailable
from draftline.registry.versions import (
    ALIASES,
    LOCK_SUFFIX,
    denied,
    mlflow_error,
    resolve_version,
    stage_split,
    stage_splits,
)

log = logging.getLogger(__name__)
STALE_LOCK_S = 30.0  # a promotion's writes take about a second: a lock this old belongs to a killed promoter
WAIT_ENV = environment.PROMOTION_WAIT_S.name  # how long a promoter waits for the lock


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _get_version(client, name: str, version: str):
    try:
        return client.get_model_version(name, str(version))
    except Exception as e:  # noqa: BLE001
        if unavailable(e):
            raise
        raise RegistryError(f"models:/{name}/{version} does not exist: {mlflow_error(e)}") from None


def holders(client, name: str) -> dict[str, str | None]:
    """``{stage: version}`` as the aliases say (the truth)."""
    try:
        aliases = client.get_registered_model(name).aliases or {}
    except Exception as e:  # noqa: BLE001
        if unavailable(e):
            raise
        raise RegistryError(f"registered model {name} does not exist: {mlflow_error(e)}") from None
    return {stage: (str(aliases[alias]) if alias in aliases else None) for stage, alias in ALIASES.items()}


def sync_stages(client, name: str, repaired: list[str] | None = None) -> dict[str, str | None]:
    """Make every stage hold exactly the version its alias names (and nothing when there is no alias). A
    registry from before the aliases (a stage holder, no alias) gets the alias of its newest holder. A stage
    that named another version than its alias (moved in MLflow's UI, or a promoter killed between its two
    writes) is said in one line, and noted in ``repaired``."""
    versions = client.search_model_versions(f"name='{name}'")
    truth = holders(client, name)
    if truth["Production"] is not None and truth["Production"] == truth["Staging"]:  # one version, one stage:
        client.delete_registered_model_alias(name, ALIASES["Staging"])  # keep serving it
        truth["Staging"] = None
    named = {v for v in truth.values() if v is not None}
    for stage, alias in ALIASES.items():
        holding = [v for v in versions if v.current_stage == stage]
        target = truth[stage]
        legacy = [v for v in holding if str(v.version) not in named]  # held, but no alias names it
        if target is None and legacy:
            target = str(max(legacy, key=lambda v: (int(v.last_updated_timestamp or 0), int(v.version))).version)
            client.set_registered_model_alias(name, alias, target)
            truth[stage] = target
            named.add(target)
        if target is not None and [str(v.version) for v in holding] != [target]:
            held = max((int(v.version) for v in holding), default=None)
            client.transition_model_version_stage(name, target, stage, archive_existing_versions=True)
            split = stage_split(name, stage, target, None if held is None else str(held))
            if split:
                say(split.repaired())
                if repaired is not None:
                    repaired.append(stage)
    return truth


def _owner() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"


def _stale(tags: dict) -> bool:
    """A lock whose promoter is gone: older than :data:`STALE_LOCK_S`, or held by a dead process here."""
    try:
        age = (datetime.now(timezone.utc) - datetime.fromisoformat(tags.get("since", ""))).total_seconds()
    except ValueError:
        return True
    host_pid = tags.get("owner", "").rpartition("@")[2]
    host, _, pid = host_pid.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    return age > STALE_LOCK_S


@contextlib.contextmanager
def promotion_lock(client, name: str, timeout_s: float | None = None, token: str | None = None):
    """Serialise changes to ``name``'s stages: creating the registered model ``<name>--draftline-promotion-lock``
    succeeds for exactly one promoter at a time, and it is deleted when the change ends. A lock left by a
    killed promoter is taken over once stale (its process is gone, or it is older than STALE_LOCK_S); one
    carrying our own ``token`` is ours (an earlier try of this change that the server dropped, or whose reply
    was lost) and is simply kept."""
    lock = name + LOCK_SUFFIX
    token = token or uuid.uuid4().hex
    timeout_s = environment.PROMOTION_WAIT_S.get() if timeout_s is None else timeout_s
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while True:
        try:
            client.create_registered_model(lock, tags={"owner": _owner(), "since": _now(), "token": token},
                                           description=f"draftline: a promotion of {name} is in progress")
            break
        except Exception as e:  # noqa: BLE001
            code = getattr(e, "error_code", "")
            # MLflow's SQL store answers a name clash by reading the holder back: when the holder let go in
            # between, the clash reads as RESOURCE_DOES_NOT_EXIST, and the lock is free for the next try
            if code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                raise
            with contextlib.suppress(Exception):
                held = client.get_registered_model(lock).tags
                if held.get("token") == token:
                    break
                if _stale(held):
                    # read again just before deleting: another promoter may have taken the stale lock over
                    # in between, and its fresh lock must not go (MLflow has no conditional delete; this
                    # narrows the window to one request)
                    if client.get_registered_model(lock).tags.get("token") == held.get("token"):
                        log.warning("taking over a stale promotion lock of %s (held by %s since %s)", name,
                                    held.get("owner"), held.get("since"))
                        client.delete_registered_model(lock)
                    continue
            if time.monotonic() > deadline:
                raise RegistryError(f"another promotion of {name} has held {lock} for {timeout_s:.0f} s; wait "
                                    f"for it to end, then promote again (or wait longer: {WAIT_ENV})") from None
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
    try:
        yield
    finally:
        try:
            client.delete_registered_model(lock)
        except Exception as e:  # noqa: BLE001
            log.warning("could not delete the promotion lock %s (%s); the next promotion takes it over once "
                        "stale", lock, mlflow_error(e))


def _move(client, name: str, version: str, stage: str, tags: dict[str, str], *, vacate: str | None = None):
    """The write path of every change: version tags, then the alias (the truth), then the stage."""
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    if vacate:  # --demote: the version leaves ``vacate`` empty
        client.delete_registered_model_alias(name, ALIASES[vacate])
    client.set_registered_model_alias(name, ALIASES[stage], version)
    client.transition_model_version_stage(name, version, stage, archive_existing_versions=True)


def _guarded(what: str, name: str, fn):
    """``fn()`` (one whole change, under the lock), tried again while the server is unavailable; MLflow's
    failures become one message."""
    try:
        return retrying(what, fn)
    except DraftlineError:
        raise
    except Exception as e:  # noqa: BLE001
        if unavailable(e):  # cannot happen (retrying turns it into ServerUnavailable); kept for clarity
            raise
        if denied(e):
            user = os.environ.get("MLFLOW_TRACKING_USERNAME", "this user")
            raise RegistryError(f"permission denied: {user} may read {name} but not change its stages; ask an "
                                f"MLflow admin for EDIT permission on registered model {name}") from None
        raise RegistryError(f"cannot {what}: {mlflow_error(e)}") from None


def _parent_version(client, mv):
    source = mv.tags.get("parent.source", "")
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
            repaired = list[str]()
            truth = sync_stages(client, name, repaired)  # also finishes what a cut-off earlier try had begun
            results = check(truth)  # against the holder as it is now, with no other promotion in between
            if truth[stage] == version:  # held already (its stage put back on it just now, perhaps)
                return results, tried.began or stage in repaired
            tried.began = True
            key = stage.lower()
            tags = {f"promoted.{key}.by": getpass.getuser(), f"promoted.{key}.at": _now(),
                    f"promoted.{key}.policy": policy_file.name,
                    f"promoted.{key}.previous": truth[stage] or "none"}
            vacate = next((s for s, v in truth.items() if v == version and s != stage), None)
            _move(client, name, version, stage, tags, vacate=vacate)
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
            truth = sync_stages(client, name)  # also finishes what a cut-off earlier try had begun
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
            tags = {"rolled_back.by": getpass.getuser(), "rolled_back.at": _now(), "rolled_back.reason": reason,
                    "rolled_back.from": current, "promoted.production.previous": current}
            vacate = next((s for s, v in truth.items() if v == str(mv.version) and s != "Production"), None)
            tried.began, tried.to, tried.results, tried.previous = True, str(mv.version), results, current
            _move(client, name, str(mv.version), "Production", tags, vacate=vacate)
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
