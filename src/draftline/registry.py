"""The MLflow Model Registry, through ``MlflowClient`` only: register versions, resolve URIs, promote, pull.

A version is created with all its lineage tags in one call, so it exists whole or not at all; if waiting for
it fails, it is deleted again. Promotion sets the stage (archiving the previous holder, so
``models:/NAME/Production`` resolves) and the lower-case alias (``models:/NAME@production``).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import random
import re
import shlex
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from draftline.errors import RegistryError, VerificationError

log = logging.getLogger(__name__)
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<ref>[^/@]+)|@(?P<alias>[^/@]+))/?$")


def _mlflow_error(e: Exception) -> str:
    return getattr(e, "message", None) or str(e).splitlines()[0]


def _denied(e: Exception) -> bool:
    return getattr(e, "error_code", "") in ("PERMISSION_DENIED", "UNAUTHENTICATED") or "403" in str(e)[:200]


def resolve_version(client, uri: str):
    """``models:/NAME/VERSION``, ``models:/NAME/STAGE`` or ``models:/NAME@alias`` -> ``(name, ModelVersion)``."""
    m = _URI.match(uri)
    if not m:
        raise RegistryError(f"{uri} is not a registry URI: use models:/NAME/VERSION, models:/NAME/STAGE or "
                            "models:/NAME@alias")
    name, ref, alias = m["name"], m["ref"], m["alias"]
    try:
        if alias:
            return name, client.get_model_version_by_alias(name, alias)
        if ref.isdigit():
            return name, client.get_model_version(name, ref)
        stage = ref.capitalize()
        latest = client.get_latest_versions(name, stages=[stage])
    except Exception as e:  # noqa: BLE001
        raise RegistryError(f"{uri} does not resolve: {_mlflow_error(e)}") from None
    if not latest:
        raise RegistryError(f"{uri} does not resolve: no version of {name} is in stage {stage}")
    return name, latest[0]


def describe(lineage: dict) -> str:
    parent = lineage.get("parent.source", "none")
    origin = "random init" if parent in ("none", None) else f"parent {parent} (sha256 {lineage.get('parent.sha256', '?')[:12]})"
    return (f"EAGLE-3 drafter for {lineage.get('verifier.name_or_path')}, finetuned from {origin} on data "
            f"{lineage.get('data.digest', '?')[:12]} (vocab {lineage.get('vocab.policy')}); finetune run "
            f"{lineage.get('finetune.run_id')}.")


def register(client, name: str, *, source: str, run_id: str, tags: dict[str, str], description: str,
             timeout_s: float = 300):
    """Create version K of ``name`` (creating the registered model if needed), with every tag at once."""
    try:
        client.get_registered_model(name)
    except Exception:  # noqa: BLE001
        try:
            client.create_registered_model(name, description="EAGLE-3 drafters registered by draftline")
        except Exception as e:  # noqa: BLE001  (a concurrent creator may have won: fine if it exists now)
            try:
                client.get_registered_model(name)
            except Exception:  # noqa: BLE001
                raise RegistryError(f"cannot create registered model {name}: {_mlflow_error(e)}") from None
    try:
        version = client.create_model_version(name, source=source, run_id=run_id,
                                              tags={k: str(v) for k, v in tags.items()}, description=description)
    except Exception as e:  # noqa: BLE001
        raise RegistryError(f"cannot register a version of {name}: {_mlflow_error(e)}") from None
    deadline = time.monotonic() + timeout_s
    while version.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
        time.sleep(0.5)
        version = client.get_model_version(name, version.version)
    if version.status != "READY":
        client.delete_model_version(name, version.version)
        raise RegistryError(f"version {version.version} of {name} did not become READY ({version.status}); "
                            "it was removed")
    return version


def _holder(client, name: str, stage: str):
    latest = client.get_latest_versions(name, stages=[stage])
    return latest[0] if latest else None


def _parent_version(client, mv):
    source = mv.tags.get("parent.source", "")
    if not source.startswith("models:/"):
        return None
    try:
        return resolve_version(client, source)[1]
    except RegistryError:
        return None


def promote(client, name: str, version: str, stage: str, *, policy_file: str | Path | None = None,
            dry_run: bool = False):
    """Evaluate the stage's policy; on pass move ``version`` to ``stage`` (archiving the current holder) and
    point the lower-case alias at it. Returns ``(results, model_version)``; raises if a rule fails."""
    from draftline.policies import evaluate, load_policy, policy_path

    stage = stage.capitalize()
    if stage not in ("Staging", "Production"):
        raise RegistryError(f"stage {stage} is not Staging or Production")
    policy_file = Path(policy_file) if policy_file else policy_path(stage)
    policy = load_policy(policy_file)
    try:
        mv = client.get_model_version(name, version)
    except Exception as e:  # noqa: BLE001
        raise RegistryError(f"models:/{name}/{version} does not exist: {_mlflow_error(e)}") from None

    def check():
        results = evaluate(policy, mv, current=_holder(client, name, "Production"),
                           parent=_parent_version(client, mv))
        if any(not r.passed for r in results):
            raise RegistryError(f"models:/{name}/{version} does not meet {policy_file.name}; nothing changed:\n"
                                + format_results(results))
        return results

    if dry_run:
        return check(), mv
    try:
        with promotion_lock(client, name):
            results = check()  # against the holder as it is now, with no other promotion in between
            # tags first: the transition must be this version's newest update (see _converge)
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            for k, v in {f"promoted.{stage.lower()}.by": getpass.getuser(), f"promoted.{stage.lower()}.at": now,
                         f"promoted.{stage.lower()}.policy": policy_file.name}.items():
                client.set_model_version_tag(name, version, k, v)
            client.transition_model_version_stage(name, version, stage, archive_existing_versions=True)
            _converge(client, name, stage)
            mv = client.get_model_version(name, version)  # as this promotion left it (a later one may follow)
    except RegistryError:
        raise
    except Exception as e:  # noqa: BLE001
        if _denied(e):
            user = os.environ.get("MLFLOW_TRACKING_USERNAME", "this user")
            raise RegistryError(f"permission denied: {user} may read {name} but not change its stages; ask an "
                                f"MLflow admin for EDIT permission on registered model {name}") from None
        raise RegistryError(f"cannot promote models:/{name}/{version} to {stage}: {_mlflow_error(e)}") from None
    return results, mv


LOCK_SUFFIX = "--draftline-promotion-lock"


@contextlib.contextmanager
def promotion_lock(client, name: str, timeout_s: float = 120.0):
    """Serialise promotions of ``name``: the registry's own unique names are the mutex (creating the
    registered model ``<name>--draftline-promotion-lock`` succeeds for exactly one promoter at a time; it is
    deleted when the promotion ends). MLflow applies one transition (archive the old holder, set the new one)
    in one database transaction, so with promotions serialised no reader ever sees two holders."""
    lock = name + LOCK_SUFFIX
    owner = f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while True:
        try:
            client.create_registered_model(lock, tags={"owner": owner, "since": datetime.now(timezone.utc).isoformat(
                timespec="seconds")}, description=f"draftline: a promotion of {name} is in progress")
            break
        except Exception as e:  # noqa: BLE001
            if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            if time.monotonic() > deadline:
                try:
                    held = client.get_registered_model(lock).tags
                except Exception:  # noqa: BLE001
                    held = {}
                raise RegistryError(
                    f"another promotion of {name} has held {lock} since {held.get('since', '?')} "
                    f"({held.get('owner', '?')}); if none is running (a promoter was killed), delete the "
                    f"registered model {lock} and promote again") from None
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
    try:
        yield
    finally:
        try:
            client.delete_registered_model(lock)
        except Exception as e:  # noqa: BLE001
            log.warning("could not delete the promotion lock %s (%s); delete it before the next promotion",
                        lock, _mlflow_error(e))


def _converge(client, name: str, stage: str, rounds: int = 20):
    """Leave exactly one holder of ``stage`` and point its alias at it.

    MLflow's transition archives the previous holder, but two transitions racing can both see the other as
    not yet promoted and leave two holders. Every promoter therefore applies the same rule afterwards: the
    holder whose transition came last (newest ``last_updated_timestamp``, then highest version) keeps the
    stage, the others are archived. Transitions only ever add newer holders, so racers agree on the winner.
    """
    for _ in range(rounds):
        holders = [v for v in client.search_model_versions(f"name='{name}'") if v.current_stage == stage]
        if not holders:
            return None
        winner = max(holders, key=lambda v: (int(v.last_updated_timestamp or 0), int(v.version)))
        for v in holders:
            if str(v.version) != str(winner.version):
                client.transition_model_version_stage(name, str(v.version), "Archived")
        client.set_registered_model_alias(name, stage.lower(), str(winner.version))
        again = [v for v in client.search_model_versions(f"name='{name}'") if v.current_stage == stage]
        if len(again) == 1 and str(again[0].version) == str(winner.version):
            return winner
    raise RegistryError(f"{stage} of {name} kept moving; promote again when other promotions end")


def format_results(results) -> str:
    width = max(len(r.rule) for r in results)
    return "\n".join(f"  {'PASS' if r.passed else 'FAIL'}  {r.rule.ljust(width)}  {r.detail}" for r in results)


def vllm_command(directory: Path, verifier: str, num_speculative_tokens: int = 3) -> tuple[str, dict]:
    spec = {"model": str(directory), "method": "eagle3", "num_speculative_tokens": num_speculative_tokens}
    return f"vllm serve {shlex.quote(verifier)} --speculative-config {shlex.quote(json.dumps(spec))}", spec


def pull(client, name: str, *, stage: str | None, alias: str | None, version: str | None, dest: Path,
         verifier: str | None = None, use_cache: bool = True) -> dict:
    """Download a version into ``dest``, every file verified against its sha256 while it arrives (files
    already in the local content-addressed cache are linked, not downloaded); returns ``{"version", "path",
    "command", "speculative_config", "downloaded_bytes", "cached_bytes"}``."""
    from draftline.transfer import BlobCache, fetch_directory

    chosen = [x for x in (stage, alias, version) if x]
    if len(chosen) != 1:
        raise RegistryError("pass exactly one of --stage, --alias or --version")
    uri = f"models:/{name}/{stage.capitalize()}" if stage else f"models:/{name}@{alias}" if alias else \
        f"models:/{name}/{version}"
    _, mv = resolve_version(client, uri)
    local = Path(dest)
    stats = fetch_directory(client.get_model_version_download_uri(name, mv.version), local,
                            cache=BlobCache() if use_cache else None,
                            manifest_digest=mv.tags.get("export.sha256"))
    config = json.loads((local / "config.json").read_text())
    want = config["speculators_config"]["verifier"]["name_or_path"]
    if verifier and verifier != want:
        raise VerificationError(f"models:/{name}/{mv.version} was trained for verifier {want}, not {verifier}")
    steps = int(mv.tags.get("ttt_steps", 3))
    cmd, spec = vllm_command(local.absolute(), verifier or want, steps)
    return {"version": mv.version, "path": str(local.absolute()), "command": cmd, "speculative_config": spec,
            "downloaded_bytes": stats["downloaded_bytes"], "cached_bytes": stats["cached_bytes"]}
