"""The MLflow Model Registry, through ``MlflowClient`` only: register versions, resolve URIs, pull.

A version is created from the drafter's LoggedModel with all its lineage tags in one call, so it exists whole
or not at all; if waiting for it fails, it is deleted again. A ``models:/NAME/STAGE`` URI is read the one way
``registry/stages.py`` reads a stage (through its alias; a pull refuses a stage its alias disagrees with), and
where versions stand, and how that changes, is that module's; what a change must satisfy is
``registry/promotion.py``'s; what the registry holds, listed and compared, is ``registry/views.py``'s.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS
from mlflow.utils.validation import MAX_MODEL_REGISTRY_TAG_VALUE_LENGTH

from draftline import names
from draftline.errors import RegistryError, VerificationError
from draftline.kinds import layer_kind
from draftline.mlflow_errors import (
    absent,
    alias_unset,
    denied,
    exists,
    mlflow_error,
    raise_failure,
    refusal,
    registry_uri,
    unknown_model_hint,
)
from draftline.registry.blobcache import BlobCache
from draftline.registry.retry import retrying
from draftline.registry.stages import STAGES, resolve_stage
from draftline.registry.transfer import fetch_directory
from draftline.util import manifest_digest

log = logging.getLogger(__name__)
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<ref>[^/@]+)|@(?P<alias>[^/@]+))/?$")


def resolve_version(client, uri: str, *, refuse_split: bool = False):
    """``models:/NAME/VERSION``, ``models:/NAME/STAGE`` or ``models:/NAME@alias`` -> ``(name, ModelVersion)``. A
    stage goes through :func:`~draftline.registry.stages.resolve_stage` (``refuse_split``: refuse a stage its alias disagrees with)."""
    m = _URI.match(uri)
    if not m:
        raise RegistryError(f"{uri} is not a registry URI: use models:/NAME/VERSION, models:/NAME/STAGE or "
                            "models:/NAME@alias")
    name, ref, alias = m["name"], m["ref"], m["alias"]
    stage = None if alias or ref.isdigit() else ref.capitalize()
    if stage is not None and stage not in STAGES:
        near = difflib.get_close_matches(stage, STAGES, n=1, cutoff=0.5)
        raise RegistryError(f"{uri} does not resolve: {ref!r} is not a version number or a stage "
                            f"({', '.join(STAGES)})" + (f"; did you mean {near[0]!r}?" if near else ""))
    if stage is not None:
        return name, resolve_stage(client, name, stage, refuse=refuse_split)
    try:
        return name, (client.get_model_version_by_alias(name, alias) if alias else
                      client.get_model_version(name, ref))
    except MlflowException as e:
        if not (alias_unset(e) if alias else absent(e)):
            raise_failure(e, f"resolve {uri}", f"READ permission on registered model {name}")
        raise RegistryError(f"{uri} does not resolve on {registry_uri()}: {mlflow_error(e)}"
                            + unknown_model_hint(client, name)) from None


def model_id_of(mv) -> str | None:
    """The LoggedModel a version was created from. MLflow's open-source stores keep it only in the version's
    ``source`` (``models:/<model_id>``), not in ``model_id``."""
    found = getattr(mv, "model_id", None)
    if found:
        return found
    source = mv.source or ""
    return source.removeprefix("models:/") if source.startswith("models:/m-") else None


def describe(lineage: dict) -> str:
    parent = lineage.get(names.PARENT_SOURCE, "none")
    origin = "random init" if parent in ("none", None) else f"parent {parent} (sha256 {lineage.get(names.PARENT_SHA256, '?')[:12]})"
    return (f"EAGLE-3 drafter for {lineage.get(names.VERIFIER_NAME_OR_PATH)}, finetuned from {origin} on data "
            f"{lineage.get(names.DATA_DIGEST, '?')[:12]} (vocab {lineage.get(names.VOCAB_POLICY)}); finetune run "
            f"{lineage.get(names.FINETUNE_RUN_ID)}.")


def check_may_register(client, name: str) -> None:
    """Refuse, before an export does any work, a user who may not add a version to ``name``. A model that does
    not exist yet is any user's to create. One that exists is written with its own description again: MLflow's
    basic-auth asks the same EDIT permission for that as for a new version, and it has no way to ask for a
    permission without using it (only the model's last-updated time moves)."""
    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if absent(e):
            return
        raise_failure(e, f"register a version of {name}", f"READ and EDIT permission on registered model {name}")
    try:
        client.update_registered_model(name, description=model.description or "")
    except MlflowException as e:
        if denied(e):
            raise refusal(e, f"register a version of {name}", f"EDIT permission on registered model {name}") \
                from None
        raise_failure(e, f"register a version of {name}", f"EDIT permission on registered model {name}")


def register(client, name: str, *, model_id: str, run_id: str, tags: dict[str, str], description: str,
             timeout_s: float = 300):
    """Create version K of ``name`` from the LoggedModel ``model_id`` (creating the registered model if
    needed: only when MLflow says it is absent), with every tag at once."""
    try:
        client.get_registered_model(name)
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"register a version of {name}", f"READ permission on registered model {name}")
        _create_registered_model(client, name)
    try:
        version = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id,
                                              tags={k: str(v) for k, v in tags.items()}, description=description)
    except MlflowException as e:  # not retried (a version whose reply was lost would be made twice): said at once
        if denied(e):
            raise refusal(e, f"register a version of {name}", f"EDIT permission on registered model {name}") \
                from None
        raise RegistryError(f"cannot register a version of {name}: {mlflow_error(e)}") from None
    deadline = time.monotonic() + timeout_s
    while version.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
        time.sleep(0.5)
        version = client.get_model_version(name, version.version)
    if version.status != "READY":
        client.delete_model_version(name, version.version)
        raise RegistryError(f"version {version.version} of {name} did not become READY ({version.status}); "
                            "it was removed")
    _link_version(client, model_id, name, str(version.version))
    return version


def _link_version(client, model_id: str, name: str, version: str) -> None:
    """What ``mlflow.register_model`` records beside the version (tracking/_model_registry/fluent.py): the
    version on its LoggedModel's ``mlflow.modelVersions`` tag, so the model's page in the UI lists it. MLflow
    3.17's stores already do it when the version names its model; a store that did not gets it here, once."""
    try:
        linked = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
        if any(v.get("name") == name and str(v.get("version")) == version for v in linked):
            return
        client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
            [*linked, {"name": name, "version": version}])})
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"link version {version} of {name} to its model {model_id}",
                          f"EDIT permission on the experiment of model {model_id}")


def _create_registered_model(client, name: str) -> None:
    """Create the registered model ``name``; a concurrent creator that won is fine."""
    try:
        client.create_registered_model(name, description="EAGLE-3 drafters registered by draftline")
    except MlflowException as e:
        if not exists(e):
            raise_failure(e, f"create registered model {name}", "permission to create registered models")


def vllm_command(directory: Path, verifier: str, num_speculative_tokens: int = 3, *,
                 trust_remote_code: bool = False, dtype: str | None = None) -> tuple[str, dict]:
    """The ``vllm serve`` line for the pulled drafter; ``--trust-remote-code`` where the verifier's data was
    prepared with it (its config or tokenizer ships as code, as Kimi-K2's does); ``--dtype`` where the pair needs
    one (an MLA drafter beside its MLA verifier: bfloat16, the only dtype vLLM's CPU MLA serves)."""
    spec = {"model": str(directory), "method": "eagle3", "num_speculative_tokens": num_speculative_tokens}
    trust = " --trust-remote-code" if trust_remote_code else ""
    tail = f" --dtype {dtype}" if dtype else ""
    return (f"vllm serve {shlex.quote(verifier)}{trust} --speculative-config {shlex.quote(json.dumps(spec))}"
            f"{tail}", spec)


def exported_k(config: dict, tags: dict) -> int:
    """The num_speculative_tokens the export wrote into its config (what ``vllm serve <dir>`` uses), so the
    printed command and the short form agree."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    return int(k if k else tags.get(names.EVAL_RECOMMENDED_K) or tags.get(names.TTT_STEPS, 3))


def pull(client, name: str, *, stage: str | None, alias: str | None, version: str | None, dest: Path,
         verifier: str | None = None, use_cache: bool | None = None,
         check: Callable[[Path], None] | None = None, if_changed: bool = False) -> dict:
    """Download a version into ``dest``, every file verified against its sha256 while it arrives; returns
    ``{"version", "path", "command", "speculative_config", "downloaded_bytes", "cached_bytes"}``. Files the
    local content-addressed cache holds are cloned or copied from it; ``use_cache`` None keeps what the pull
    downloads in the cache where that pays (:meth:`BlobCache.fills`), True always, False skips the cache.
    ``check`` refuses the verified directory before it replaces ``dest`` (the CLI passes
    :func:`draftline.drafter.servable.require_servable`, which this layer may not import).

    A pull asks the tracking server for as little as it can (a fleet restarting together pays per request):
    the version (a stage: the newest version in it, which carries its alias when the two agree), the
    LoggedModel's artifact location, and one GET per file not in the cache. The file list and digests come
    from the version's ``export.checksums`` tag, checked against ``export.sha256``; older versions, without
    the tag, read ``checksums.json`` from the store."""
    chosen = [x for x in (stage, alias, version) if x]
    if len(chosen) != 1:
        raise RegistryError("pass exactly one of --stage, --alias or --version")
    uri = f"models:/{name}/{stage.capitalize()}" if stage else f"models:/{name}@{alias}" if alias else \
        f"models:/{name}/{version}"
    # the version is resolved once: every file below comes from that one version, whatever moves meanwhile; a
    # stage its alias disagrees with is refused (nothing is downloaded), not guessed
    _, mv = retrying(f"resolve {uri}", lambda: resolve_version(client, uri, refuse_split=True))
    want = mv.tags.get(names.VERIFIER_NAME_OR_PATH)
    if verifier and verifier != want:  # before anything is downloaded: DEST stays as it was
        raise VerificationError(f"models:/{name}/{mv.version} was trained for verifier {want}, not {verifier}; "
                                "nothing was downloaded")
    local = Path(dest)
    if if_changed and holds(local, mv.tags.get(names.EXPORT_SHA256)):  # what DEST holds is what the stage names
        return {"version": mv.version, "path": str(local.absolute()), "unchanged": True}
    source = retrying(f"locate the files of models:/{name}/{mv.version}", lambda: _files_of(client, name, mv))
    stats = fetch_directory(source, local,
                            cache=None if use_cache is False else BlobCache(fill=use_cache),
                            expected_digest=mv.tags.get(names.EXPORT_SHA256),
                            manifest=_tagged_manifest(mv.tags.get(CHECKSUMS_TAG)), check=check)
    config = json.loads((local / "config.json").read_text())
    # speculators' format names its verifier; an MLA drafter's flat config names none: the version's lineage does
    served = (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or want
    steps = exported_k(config, mv.tags)
    cmd, spec = vllm_command(local.absolute(), verifier or served, steps,
                             trust_remote_code=mv.tags.get(names.VERIFIER_TRUST_REMOTE_CODE) == "True",
                             dtype=layer_kind(mv.tags.get(names.DRAFTER_LAYER)).served_dtype)
    return {"version": mv.version, "path": str(local.absolute()), "command": cmd, "speculative_config": spec,
            "verifier": served, "downloaded_bytes": stats["downloaded_bytes"], "cached_bytes": stats["cached_bytes"]}


def holds(directory: Path, digest: str | None) -> bool:
    """Whether ``directory`` is a pulled version whose checksums.json is the one ``digest`` (a version's
    ``export.sha256``) names (its files are re-hashed by ``pull --verify-only``)."""
    try:
        manifest = json.loads((Path(directory) / "checksums.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(digest) and isinstance(manifest, dict) and manifest_digest(manifest) == digest


CHECKSUMS_TAG = names.EXPORT_CHECKSUMS  # the export's checksums.json, as a version tag: a pull needs no listing


def _files_of(client, name: str, mv) -> str:
    """Where the version's files are: its LoggedModel's artifact location (one request), the artifact URI a
    version made from stored artifacts names as its source (none), or what the registry resolves ``runs:/``
    to."""
    model_id = model_id_of(mv)
    if model_id:
        return client.get_logged_model(model_id).artifact_location
    source = mv.source or ""
    if "://" in source or source.startswith("mlflow-artifacts:/") or source.startswith("/"):
        return source
    return client.get_model_version_download_uri(name, mv.version)


def checksums_tag(manifest: dict[str, str]) -> dict[str, str]:
    """The ``export.checksums`` tag for a version (nothing when the manifest is too long for a tag)."""
    value = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return {CHECKSUMS_TAG: value} if len(value) <= MAX_MODEL_REGISTRY_TAG_VALUE_LENGTH else {}


def _tagged_manifest(value: str | None) -> dict | None:
    try:
        manifest = json.loads(value) if value else None
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) else None
