"""The lineage contract (docs/design.md): what every run and model version records about what it was made from."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import warnings
from importlib import metadata
from pathlib import Path

from draftline import environment, names
from draftline.config import project_root

LINEAGE_FILE = "lineage.json"
METADATA_FILE = "training_metadata.json"
# What a verifier built by draftline (`draftline make-verifier`) was built from: package, version, GGUF sha256
VERIFIER_IDENTITY_FILE = "draftline_verifier.json"



def versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "speculators", "deepspeed", "transformers", "mlflow", "safetensors", "draftline"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    out["python"] = platform.python_version()
    return out


def git_commit(root: Path | None = None) -> str:
    root = root or project_root()
    if root is None:  # an installed wheel: its version is recorded instead
        return "unknown"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_HF_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[^/]+)/?$")
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def verifier_identity(path: str, name: str | None = None, explicit: str | None = None) -> tuple[str | None, str | None]:
    """``(repo id, revision)`` a serving host knows the verifier by, never a path on this machine: ``explicit``;
    a Hugging Face cache snapshot's repo and revision; the repo id the user named (``name``); the
    ``_name_or_path`` its config.json records when that is a repo id, with, for a verifier draftline built
    (``draftline make-verifier``), the package and GGUF digest it was built from as the revision.
    ``(None, None)`` when none says."""
    if explicit:
        return explicit, None
    m = _HF_SNAPSHOT.search(str(path))
    if m:
        return f"{m['org']}/{m['name']}", m["rev"]
    if name and _REPO_ID.fullmatch(name) and not Path(name).exists():
        return name, None
    try:
        recorded = json.loads((Path(path) / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError):
        recorded = ""
    if _REPO_ID.fullmatch(recorded) and not Path(recorded).exists():
        return recorded, _built_revision(path)
    return None, None


def _built_revision(path: str) -> str | None:
    try:
        return json.loads((Path(path) / VERIFIER_IDENTITY_FILE).read_text()).get("revision") or None
    except (OSError, ValueError):
        return None


def vllm_tags() -> dict[str, str]:
    """The flags ``$DRAFTLINE_VLLM_ARGS`` gave every vLLM this run started, where it was set."""
    args = environment.VLLM_ARGS.get()
    return {names.VLLM_ARGS: args} if args else {}


def environment_tags() -> dict[str, str]:
    tags = {f"draftline.version.{k}": v for k, v in versions().items()}
    tags.update(vllm_tags())
    tags["draftline.git_commit"] = git_commit()
    if tags["draftline.git_commit"] != "unknown":  # MLflow's own tag: the UI shows and links it
        tags["mlflow.source.git.commit"] = tags["draftline.git_commit"].removesuffix("-dirty")
    return tags


def verifier_params(manifest: dict) -> dict[str, object]:
    """The ``verifier.*`` params of every stage's run, from a prepared set's manifest: the id serving hosts load
    the verifier by, where it lay on the host that prepared the data, its revision, the aux layers captured."""
    return {names.VERIFIER_NAME_OR_PATH: manifest.get("verifier_id") or manifest["verifier"],
            names.VERIFIER_PATH: manifest["verifier"],
            names.VERIFIER_REVISION: manifest.get("verifier_revision") or "none",
            names.VERIFIER_AUX_LAYERS: manifest["aux_layer_ids"],
            names.VERIFIER_TRUST_REMOTE_CODE: bool(manifest.get("verifier_trust_remote_code", False)),
            names.VERIFIER_MODEL_TYPE: manifest.get("verifier_model_type") or "unknown",
            names.VERIFIER_ARCHITECTURE: manifest.get("verifier_architecture") or "unknown"}


def parent_params(parent, *, sha256: str, layout: str, key_remap: str) -> dict[str, str]:
    return {
        "init": parent.init,
        names.PARENT_NAME: parent.name,
        names.PARENT_SOURCE: parent.source,
        names.PARENT_REVISION: parent.revision,
        names.PARENT_SHA256: sha256,
        names.PARENT_LAYOUT: layout,
        names.PARENT_KEY_REMAP: key_remap,
    }


def parent_tags(parent, data_run_id: str | None) -> dict[str, str]:
    tags: dict[str, str] = {}
    if parent.model_version:
        tags[names.PARENT_MODEL_VERSION] = parent.model_version
    if parent.run_id:
        tags[names.PARENT_RUN] = parent.run_id
    if data_run_id:
        tags[names.DATA_RUN] = data_run_id
    return tags


def training_metadata(params: dict[str, object], vocab_counts: dict[str, int], extra: dict | None = None) -> dict:
    return {
        "lineage": {k: params[k] for k in params if k.split(".")[0] in
                    ("init", "parent", "vocab", "verifier", "data")},
        "vocab_counts": vocab_counts,
        "training": {k: params[k] for k in params if k.split(".")[0] in
                     ("zero", "world_size", "ttt_steps", "optimizer", "train")},
        "versions": versions(),
        "git_commit": git_commit(),
        **(extra or {}),
    }


def write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    return path


def data_set(manifest: dict, name: str = "prepared"):
    """The prepared data as an MLflow data set: what prepare logs as its output and finetune as its input
    (same source, same digest, so the UI links them)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source  # noqa: PLC0415 (CLI start-up: serving.verifiers imports lineage; mlflow stays lazy)
    from mlflow.data.meta_dataset import MetaDataset  # noqa: PLC0415 (CLI start-up: serving.verifiers imports lineage; mlflow stays lazy)

    with warnings.catch_warnings():  # two registered local-path sources both match: MLflow warns, picks one
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
        source = resolve_dataset_source(manifest["source"])
    # mlflow's typing marks Dataset.profile abstract; MetaDataset, its class for a data set known by its metadata
    # alone, does not define it, and Dataset is no ABC at run time: it is instantiated as MLflow's docs show
    return MetaDataset(source=source, name=name, digest=manifest["digest"][:36])  # type: ignore[abstract]


def data_set_tags(manifest: dict) -> dict[str, str]:
    return {"samples": str(manifest["samples"]), "tokens": str(manifest["tokens"]), "sha256": manifest["digest"],
            "location": manifest["location"]}


def logged_model_name(name: str) -> str:
    """``name`` as MLflow takes it for a LoggedModel (it refuses '/', ':', '.', '%' and quotes)."""
    return re.sub(r"[/:.%\"']", "-", name)


def parent_model_id(client, parent, *, sha256: str, layout: str, experiment_id: str) -> str | None:
    """The LoggedModel that stands for the parent: a registered parent's own model, or, for a parent outside
    MLflow (AQ-MedAI, a directory, an HF cache id), an external model recorded once per sha256."""
    if parent.is_random:
        return None
    if parent.model_version:
        from draftline.registry.versions import model_id_of  # noqa: PLC0415 (CLI start-up: versions imports mlflow)

        name, _, version = parent.model_version.removeprefix("models:/").rpartition("/")
        return model_id_of(client.get_model_version(name, version))
    found = client.search_logged_models([experiment_id], filter_string=f"tags.`draftline.parent.sha256` = '{sha256}'",
                                        max_results=1).to_list()
    if found:
        return found[0].model_id
    import mlflow  # noqa: PLC0415 (CLI start-up: serving.verifiers imports lineage; mlflow stays lazy)

    model = mlflow.create_external_model(
        name=logged_model_name(parent.name), experiment_id=experiment_id, model_type="eagle3-drafter",
        params={"source": parent.source, "revision": parent.revision, "layout": layout, "sha256": sha256},
        tags={names.KIND: "parent", names.PARENT_SHA256_TAG: sha256, names.PARENT_SOURCE: parent.source})
    return model.model_id


def record_inputs(run_id: str, *, manifest: dict, data_name: str, parent_model: str | None) -> None:
    """The finetune run's inputs: the data set it trained on and the parent model it started from."""
    from mlflow.entities import DatasetInput, InputTag, LoggedModelInput  # noqa: PLC0415 (CLI start-up: serving.verifiers imports lineage; mlflow stays lazy)

    from draftline import tracking  # noqa: PLC0415 (CLI start-up: serving.verifiers imports lineage; mlflow stays lazy)

    entity = data_set(manifest, data_name)._to_mlflow_entity()  # noqa: SLF001 (what mlflow.log_input does)
    tags = [InputTag("mlflow.data.context", "training"), *(InputTag(k, v) for k, v in data_set_tags(manifest).items())]
    tracking.client().log_inputs(run_id, datasets=[DatasetInput(entity, tags)],
                              models=[LoggedModelInput(parent_model)] if parent_model else None)
