"""Which version holds each stage and alias, and the one way they change: the rule that keeps them equal, the
promotion lock, and the move of a stage.

The aliases (``@production``, ``@staging``) are the truth: setting one is a single atomic write. The stage is
kept equal to its alias, because ``models:/NAME/Production`` (what deployments pull) resolves through stages.
A stage is read here, in one place (:func:`resolve_stage`): through its alias, and where MLflow's stage says
otherwise (its UI and ``transition_model_version_stage`` move only the stage) every command says so in one line
naming both versions and the command that reconciles them, and a pull refuses. Every change writes the alias
first, then the stage (:func:`move_stage`); :func:`sync_stages` makes the stages follow the aliases and runs
before and after every change, so a promoter killed between its two writes is repaired by the next command.
Changes to one model are serialised by a short-lived registry lock (:func:`promotion_lock`). What a change must
satisfy (a policy) is ``registry/promotion.py``'s.
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
from dataclasses import dataclass
from datetime import datetime, timezone

from mlflow.exceptions import MlflowException

from draftline import environment
from draftline.console import say
from draftline.errors import RegistryError
from draftline.mlflow_errors import (
    absent,
    alias_unset,
    error_code,
    mlflow_error,
    raise_failure,
    registry_uri,
    unknown_model_hint,
)

log = logging.getLogger(__name__)
STAGES = ("Staging", "Production", "Archived", "None")
ALIASES = {"Production": "production", "Staging": "staging"}  # the alias each stage follows
LOCK_SUFFIX = "--draftline-promotion-lock"  # the registered model that serialises NAME's promotions
STALE_LOCK_S = 30.0  # a promotion's writes take about a second: a lock this old belongs to a killed promoter
WAIT_ENV = environment.PROMOTION_WAIT_S.name  # how long a promoter waits for the lock
# MLflow's answers to creating a lock that exists: its SQL store reads the holder back after a name clash, and
# when the holder let go in between, the clash reads as RESOURCE_DOES_NOT_EXIST (the lock is free for the next try)
LOCK_HELD = ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST")


@dataclass(frozen=True)
class StageSplit:
    """A stage and its alias naming different versions: the stage moved without the alias (MLflow's UI, or
    ``MlflowClient.transition_model_version_stage``), or the alias moved and the stage did not follow."""

    name: str
    stage: str
    alias: str  # the version @alias names: draftline's truth
    held: str | None  # the version MLflow resolves models:/NAME/STAGE to (the newest in the stage), if any

    def _state(self, tense: str = "is") -> str:
        held = f"v{self.held}" if self.held else "no version"
        return f"stage {self.stage} of {self.name} {tense} on {held} but @{ALIASES[self.stage]} on v{self.alias}"

    def _command(self, version: str) -> str:
        return f"`draftline promote {self.name} {version} --to {self.stage}`"

    def _fixes(self) -> str:
        back = f"{self._command(self.alias)} puts the stage back on v{self.alias}"
        return back if self.held is None else f"{self._command(self.held)} makes v{self.held} both, {back}"

    def warning(self) -> str:
        """What a command that reads the stage says (it goes on with the alias's version)."""
        return f"{self._state()} (moved outside draftline, as MLflow's UI does); draftline reads v{self.alias}: " \
               f"{self._fixes()}"

    def refusal(self) -> str:
        """What a pull of the stage says instead of choosing one of the two."""
        return f"models:/{self.name}/{self.stage} is ambiguous: {self._state()}; nothing was pulled: " \
               f"{self._fixes()} (or pull --version)"

    def repaired(self) -> str:
        """What a promotion or rollback says after making the stage follow its alias."""
        if_meant = f"; {self._command(self.held)} if v{self.held} was meant" if self.held else ""
        return f"{self._state('was')}: moved the stage to v{self.alias}, as draftline follows the alias{if_meant}"


def stage_split(name: str, stage: str, alias: str | None, held: str | None) -> StageSplit | None:
    """The one rule: the stage and its alias disagree when the alias exists and MLflow's stage resolves to
    another version (or none). No alias: a registry from before the aliases; the stage is all there is."""
    if alias is None or stage not in ALIASES or (held is not None and str(held) == str(alias)):
        return None
    return StageSplit(name, stage, str(alias), None if held is None else str(held))


def promotion_in_progress(client, name: str) -> bool:
    """A draftline promotion of ``name`` holds its lock: it writes the alias, then the stage, so the two differ
    for a moment; that is a change in flight (the alias is already the truth), not a disagreement. Only an
    absent lock says there is none: a lock this user may not read is said, not taken for no promotion."""
    return _lock_tags(client, name + LOCK_SUFFIX) is not None


def _lock_tags(client, lock: str) -> dict | None:
    """The tags of the promotion lock ``lock``; None when there is none (its holder let go)."""
    try:
        return client.get_registered_model(lock).tags
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read the promotion lock {lock}", f"READ permission on registered model {lock}")
        return None


def resolve_stage(client, name: str, stage: str, *, refuse: bool = False):
    """``models:/NAME/STAGE`` as draftline reads it: the version the stage's alias names (the truth). Where
    MLflow's stage names another version, say so in one line naming both and the commands that reconcile them,
    and go on with the alias's, or, with ``refuse`` (a pull installs what it resolves), raise instead of
    choosing. A registry without the alias: the newest version in the stage. One request when they agree.

    The stage and the alias are two reads: a promotion that begins and ends between them (alias, stage, lock
    released) leaves a split that was never in the registry at any one moment. A split with no promotion in
    flight is therefore read again, and said only when every one of ``SPLIT_READS`` readings shows it."""
    for attempt in range(SPLIT_READS):
        named, split = _read_stage(client, name, stage)
        if split is None or promotion_in_progress(client, name):
            break
        if attempt + 1 < SPLIT_READS:
            time.sleep(0.2 * (attempt + 1))
            continue
        if refuse:
            raise RegistryError(split.refusal())
        say(split.warning())
    if named is None:
        raise RegistryError(f"models:/{name}/{stage} does not resolve on {registry_uri()}: "
                            f"no version of {name} is in stage {stage}")
    return named


SPLIT_READS = 3  # readings of a stage/alias split before it is taken for a real one (not a promotion in passing)


def _read_stage(client, name: str, stage: str):
    """One reading of ``stage``: (the version draftline takes, the split between stage and alias or None)."""
    uri = f"models:/{name}/{stage}"
    try:
        # what MLflow resolves the stage to; its registry client's call, one request: MlflowClient's own first
        # asks whether NAME is a prompt (a second request per pull, paid by every pod of a fleet)
        latest = client._get_registry_client().get_latest_versions(name, [stage])  # noqa: SLF001
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"resolve {uri}", f"READ permission on registered model {name}")
        raise RegistryError(f"{uri} does not resolve on {registry_uri()}: {mlflow_error(e)}"
                            + unknown_model_hint(client, name)) from None
    held = latest[0] if latest else None
    alias = ALIASES.get(stage)
    if alias is None or (held is not None and alias in (held.aliases or [])):
        return held, None
    try:
        named = client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if not alias_unset(e):
            raise_failure(e, f"read @{alias} of {name}", f"READ permission on registered model {name}")
        return held, None  # no such alias: a registry from before the aliases
    return named, stage_split(name, stage, str(named.version), held and str(held.version))


def stage_splits(client, name: str, *, aliases: dict, versions) -> list[StageSplit]:
    """Every stage of ``name`` whose alias names another version than MLflow's stage (``aliases``: the
    registered model's, ``versions``: all its versions, as ``list`` reads them), a promotion in flight aside."""
    found = []
    for stage, alias in ALIASES.items():
        holding = [int(v.version) for v in versions if v.current_stage == stage]
        split = stage_split(name, stage, aliases.get(alias), str(max(holding)) if holding else None)
        if split:
            found.append(split)
    return [] if not found or promotion_in_progress(client, name) else found


def holders(client, name: str) -> dict[str, str | None]:
    """``{stage: version}`` as the aliases say (the truth)."""
    try:
        aliases = client.get_registered_model(name).aliases or {}
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read the aliases of {name}", f"READ permission on registered model {name}")
        raise RegistryError(f"registered model {name} does not exist: {mlflow_error(e)}") from None
    return {stage: (str(aliases[alias]) if alias in aliases else None) for stage, alias in ALIASES.items()}


@dataclass(frozen=True)
class Synced:
    """What :func:`sync_stages` leaves: ``holders`` ``{stage: version}`` as the aliases say (the truth), and the
    stages it put back on their alias (each said in one line)."""

    holders: dict[str, str | None]
    repaired: tuple[str, ...] = ()


def sync_stages(client, name: str) -> Synced:
    """Make every stage hold exactly the version its alias names (and nothing when there is no alias). A
    registry from before the aliases (a stage holder, no alias) gets the alias of its newest holder. A stage
    that named another version than its alias (moved in MLflow's UI, or a promoter killed between its two
    writes) is said in one line, and listed in the answer's ``repaired``."""
    repaired: list[str] = []
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
                repaired.append(stage)
    return Synced(truth, tuple(repaired))


def now() -> str:
    """The time a lock and a change record: UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
            client.create_registered_model(lock, tags={"owner": _owner(), "since": now(), "token": token},
                                           description=f"draftline: a promotion of {name} is in progress")
            break
        except MlflowException as e:
            if error_code(e) not in LOCK_HELD:
                raise
            held = _lock_tags(client, lock)  # None: let go in between, free for the next try
            if held is not None and held.get("token") == token:
                break
            if held is not None and _stale(held):
                _take_over(client, name, lock, held)
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
        except Exception as e:  # noqa: BLE001  (any failure to let go is only said: the change's own outcome stands)
            log.warning("could not delete the promotion lock %s (%s); the next promotion takes it over once "
                        "stale", lock, mlflow_error(e))


def _take_over(client, name: str, lock: str, held: dict) -> None:
    """Delete the stale lock ``held`` read, unless another promoter took it over meanwhile: it is read again just
    before deleting, as its fresh lock must not go (MLflow has no conditional delete; this narrows the window to
    one request). A lock gone meanwhile is fine: the next try creates it."""
    again = _lock_tags(client, lock)
    if again is None or again.get("token") != held.get("token"):
        return
    log.warning("taking over a stale promotion lock of %s (held by %s since %s)", name, held.get("owner"),
                held.get("since"))
    try:
        client.delete_registered_model(lock)
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"take over the stale promotion lock {lock}",
                          f"MANAGE permission on registered model {lock}")


def move_stage(client, name: str, version: str, stage: str, tags: dict[str, str], *,
               vacate: str | None = None) -> None:
    """The write path of every change: version tags, then the alias (the truth), then the stage."""
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    if vacate:  # --demote: the version leaves ``vacate`` empty
        client.delete_registered_model_alias(name, ALIASES[vacate])
    client.set_registered_model_alias(name, ALIASES[stage], version)
    client.transition_model_version_stage(name, version, stage, archive_existing_versions=True)
