"""The MLflow Model Registry, through ``MlflowClient`` only: register versions, resolve URIs, promote, pull.

A version is created from the drafter's LoggedModel with all its lineage tags in one call, so it exists whole
or not at all; if waiting for it fails, it is deleted again. A stage is resolved here, in one place
(:func:`resolve_stage`): through its alias, draftline's truth, and where MLflow's stage says otherwise (its UI
and ``transition_model_version_stage`` move only the stage) every command says so in one line naming both
versions and the command that reconciles them, and a pull refuses. Changing where versions stand is
``registry/promotion.py``'s; what the registry holds, listed and compared, is ``registry/views.py``'s.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.utils.validation import MAX_MODEL_REGISTRY_TAG_VALUE_LENGTH

from draftline.console import say
from draftline.errors import RegistryError, VerificationError
from draftline.registry.blobcache import BlobCache
from draftline.registry.retry import retrying, unavailable
from draftline.registry.transfer import fetch_directory

log = logging.getLogger(__name__)
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<ref>[^/@]+)|@(?P<alias>[^/@]+))/?$")


def mlflow_error(e: Exception) -> str:
    return getattr(e, "message", None) or str(e).splitlines()[0]


DENIED = ("PERMISSION_DENIED", "UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED")  # MLflow's codes for HTTP 403 and 401


def denied(e: Exception) -> bool:
    """The server refused this user (MLflow names a 403 or 401 by its error code, JSON body or not)."""
    return getattr(e, "error_code", "") in DENIED


def resolve_version(client, uri: str, *, refuse_split: bool = False):
    """``models:/NAME/VERSION``, ``models:/NAME/STAGE`` or ``models:/NAME@alias`` -> ``(name, ModelVersion)``. A
    stage goes through :func:`resolve_stage` (``refuse_split``: refuse a stage its alias disagrees with)."""
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
    except Exception as e:  # noqa: BLE001
        if unavailable(e):
            raise
        raise RegistryError(f"{uri} does not resolve on {registry_uri()}: {mlflow_error(e)}"
                            + unknown_model_hint(client, name)) from None


STAGES = ("Staging", "Production", "Archived", "None")
ALIASES = {"Production": "production", "Staging": "staging"}  # the alias each stage follows (registry/promotion.py)
LOCK_SUFFIX = "--draftline-promotion-lock"  # the registered model that serialises NAME's promotions (promotion.py)


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
    for a moment; that is a change in flight (the alias is already the truth), not a disagreement."""
    try:
        client.get_registered_model(name + LOCK_SUFFIX)
        return True
    except Exception as e:  # noqa: BLE001
        if unavailable(e):
            raise
        return False


def resolve_stage(client, name: str, stage: str, *, refuse: bool = False):
    """``models:/NAME/STAGE`` as draftline reads it: the version the stage's alias names (the truth). Where
    MLflow's stage names another version, say so in one line naming both and the commands that reconcile them,
    and go on with the alias's, or, with ``refuse`` (a pull installs what it resolves), raise instead of
    choosing. A registry without the alias: the newest version in the stage. One request when they agree."""
    uri = f"models:/{name}/{stage}"
    try:
        # what MLflow resolves the stage to; its registry client's call, one request: MlflowClient's own first
        # asks whether NAME is a prompt (a second request per pull, paid by every pod of a fleet)
        latest = client._get_registry_client().get_latest_versions(name, [stage])  # noqa: SLF001
    except Exception as e:  # noqa: BLE001
        if unavailable(e):
            raise
        raise RegistryError(f"{uri} does not resolve on {registry_uri()}: {mlflow_error(e)}"
                            + unknown_model_hint(client, name)) from None
    held = latest[0] if latest else None
    alias = ALIASES.get(stage)
    named = held
    if alias is not None and (held is None or alias not in (held.aliases or [])):
        try:
            named = client.get_model_version_by_alias(name, alias)
        except Exception as e:  # noqa: BLE001  (no such alias: a registry from before the aliases)
            if unavailable(e):
                raise
            named = held
        split = stage_split(name, stage, named and str(named.version), held and str(held.version))
        if split and not promotion_in_progress(client, name):
            if refuse:
                raise RegistryError(split.refusal())
            say(split.warning())
    if named is None:
        raise RegistryError(f"{uri} does not resolve on {registry_uri()}: no version of {name} is in stage {stage}")
    return named


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


def registry_uri() -> str:
    return mlflow.get_registry_uri()


def unknown_model_hint(client, name: str) -> str:
    """``; did you mean 'x'?`` when ``name`` is not a registered model and one is close; else ``""``."""
    try:
        client.get_registered_model(name)
        return ""
    except Exception:  # noqa: BLE001
        pass
    try:
        names = [m.name for m in client.search_registered_models()]
    except Exception:  # noqa: BLE001
        return ""
    near = difflib.get_close_matches(name, names, n=1)
    if near:
        return f"; did you mean {near[0]!r}?"
    return "; `draftline list` shows the registered models there" if names else "; it holds no registered models"


def model_id_of(mv) -> str | None:
    """The LoggedModel a version was created from. MLflow's open-source stores keep it only in the version's
    ``source`` (``models:/<model_id>``), not in ``model_id``."""
    found = getattr(mv, "model_id", None)
    if found:
        return found
    source = mv.source or ""
    return source.removeprefix("models:/") if source.startswith("models:/m-") else None


def describe(lineage: dict) -> str:
    parent = lineage.get("parent.source", "none")
    origin = "random init" if parent in ("none", None) else f"parent {parent} (sha256 {lineage.get('parent.sha256', '?')[:12]})"
    return (f"EAGLE-3 drafter for {lineage.get('verifier.name_or_path')}, finetuned from {origin} on data "
            f"{lineage.get('data.digest', '?')[:12]} (vocab {lineage.get('vocab.policy')}); finetune run "
            f"{lineage.get('finetune.run_id')}.")


def register(client, name: str, *, model_id: str, run_id: str, tags: dict[str, str], description: str,
             timeout_s: float = 300):
    """Create version K of ``name`` from the LoggedModel ``model_id`` (creating the registered model if
    needed), with every tag at once."""
    try:
        client.get_registered_model(name)
    except Exception:  # noqa: BLE001
        try:
            client.create_registered_model(name, description="EAGLE-3 drafters registered by draftline")
        except Exception as e:  # noqa: BLE001  (a concurrent creator may have won: fine if it exists now)
            try:
                client.get_registered_model(name)
            except Exception:  # noqa: BLE001
                raise RegistryError(f"cannot create registered model {name}: {mlflow_error(e)}") from None
    try:
        version = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id,
                                              tags={k: str(v) for k, v in tags.items()}, description=description)
    except Exception as e:  # noqa: BLE001
        raise RegistryError(f"cannot register a version of {name}: {mlflow_error(e)}") from None
    deadline = time.monotonic() + timeout_s
    while version.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
        time.sleep(0.5)
        version = client.get_model_version(name, version.version)
    if version.status != "READY":
        client.delete_model_version(name, version.version)
        raise RegistryError(f"version {version.version} of {name} did not become READY ({version.status}); "
                            "it was removed")
    return version


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
    return int(k if k else tags.get("eval.recommended_num_speculative_tokens") or tags.get("ttt_steps", 3))


def pull(client, name: str, *, stage: str | None, alias: str | None, version: str | None, dest: Path,
         verifier: str | None = None, use_cache: bool | None = None) -> dict:
    """Download a version into ``dest``, every file verified against its sha256 while it arrives; returns
    ``{"version", "path", "command", "speculative_config", "downloaded_bytes", "cached_bytes"}``. Files the
    local content-addressed cache holds are cloned or copied from it; ``use_cache`` None keeps what the pull
    downloads in the cache where that pays (:meth:`BlobCache.fills`), True always, False skips the cache.

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
    want = mv.tags.get("verifier.name_or_path")
    if verifier and verifier != want:  # before anything is downloaded: DEST stays as it was
        raise VerificationError(f"models:/{name}/{mv.version} was trained for verifier {want}, not {verifier}; "
                                "nothing was downloaded")
    local = Path(dest)
    source = retrying(f"locate the files of models:/{name}/{mv.version}", lambda: _files_of(client, name, mv))
    stats = fetch_directory(source, local,
                            cache=None if use_cache is False else BlobCache(fill=use_cache),
                            expected_digest=mv.tags.get("export.sha256"),
                            manifest=_tagged_manifest(mv.tags.get(CHECKSUMS_TAG)))
    config = json.loads((local / "config.json").read_text())
    # speculators' format names its verifier; an MLA drafter's flat config names none: the version's lineage does
    served = (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or want
    steps = exported_k(config, mv.tags)
    cmd, spec = vllm_command(local.absolute(), verifier or served, steps,
                             trust_remote_code=mv.tags.get("verifier.trust_remote_code") == "True",
                             dtype="bfloat16" if mv.tags.get("drafter.layer") == "mla" else None)
    return {"version": mv.version, "path": str(local.absolute()), "command": cmd, "speculative_config": spec,
            "verifier": served, "downloaded_bytes": stats["downloaded_bytes"], "cached_bytes": stats["cached_bytes"]}


CHECKSUMS_TAG = "export.checksums"  # the export's checksums.json, as a version tag: a pull needs no listing


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
