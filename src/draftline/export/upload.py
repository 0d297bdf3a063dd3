"""The export uploaded as the LoggedModel's artifacts, then its ``checksums.json`` (sha256 of every other
file, computed on a second thread while MLflow uploads, so checksumming costs no extra pass)."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftline import tracking
from draftline.registry.transfer import CHECKSUMS  # one name for the manifest, in exports and pulls
from draftline.util import file_manifest


def sha256_manifest(directory: Path) -> dict[str, str]:
    """``checksums.json`` of an export directory: every file but itself."""
    return file_manifest(p for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS)


def upload_with_checksums(out: Path, model_id: str) -> dict[str, str]:
    """Upload ``out`` as the LoggedModel's artifacts, then its ``checksums.json``; the digests are computed on
    a second thread while MLflow uploads the files (both read them from the page cache)."""
    client = tracking.client()
    with ThreadPoolExecutor(1, thread_name_prefix="draftline-sha256") as pool:
        digests = pool.submit(sha256_manifest, out)
        client.log_model_artifacts(model_id, str(out))
        manifest = digests.result()
    with tempfile.TemporaryDirectory(prefix="draftline-checksums-") as one:  # the API uploads folders only
        (Path(one) / CHECKSUMS).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        client.log_model_artifacts(model_id, one)  # last: a model with checksums.json is complete
    return manifest
