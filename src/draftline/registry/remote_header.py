"""Read a few bytes of stored artifacts without downloading them whole: small files (config, checksums) and the
header of a safetensors file (8 bytes of length, then the JSON header), counting every byte that arrives.

Through MLflow's own artifact repositories: a local store is read in place; a tracking server's proxied
artifacts (``mlflow-artifacts:``, ``http(s)``) with HTTP range requests (a server that ignores the range is
cut off after the bytes asked for); any other store (S3, GCS, ...) by downloading the file, counted whole.
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile
from pathlib import Path

from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
from mlflow.utils.rest_utils import augmented_raise_for_status, http_request

from draftline.errors import CheckpointError
from draftline.safetensors_header import parse_safetensors_header


class ArtifactDir:
    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.repo = get_artifact_repository(self.uri)
        self.downloaded = 0

    def list(self, path: str | None = None) -> list[tuple[str, bool]]:
        """``[(relative path, is_dir)]`` directly under ``path``."""
        return [(f.path, f.is_dir) for f in self.repo.list_artifacts(path)]

    def read(self, name: str, length: int | None = None, offset: int = 0) -> bytes:
        """``length`` bytes of ``name`` from ``offset`` (all of it from ``offset`` when None)."""
        if isinstance(self.repo, LocalArtifactRepository):
            with open(os.path.join(self.repo.artifact_dir, name), "rb") as f:
                f.seek(offset)
                data = f.read() if length is None else f.read(length)
        elif isinstance(self.repo, HttpArtifactRepository):
            data, arrived = self._http_read(self.repo, name, length, offset)
            self.downloaded += arrived
            return data
        else:
            with tempfile.TemporaryDirectory(prefix="draftline-inspect-") as tmp:
                local = Path(self.repo.download_artifacts(name, tmp))
                self.downloaded += local.stat().st_size
                with open(local, "rb") as f:
                    f.seek(offset)
                    return f.read() if length is None else f.read(length)
        self.downloaded += len(data)
        return data

    def _http_read(self, repo: HttpArtifactRepository, name: str, length: int | None, offset: int) -> tuple[bytes, int]:
        headers = {"Range": f"bytes={offset}-" + ("" if length is None else str(offset + length - 1))}
        resp = http_request(repo._host_creds, posixpath.join("/", name), "GET", stream=True,  # noqa: SLF001
                            extra_headers=headers)
        try:
            augmented_raise_for_status(resp)
            skip = offset if resp.status_code == 200 else 0  # the range was ignored: the file from its start
            want = None if length is None else skip + length
            got = bytearray()
            for chunk in resp.raw.stream(64 << 10, decode_content=True):
                got += chunk
                if want is not None and len(got) >= want:
                    break
            return bytes(got[skip:want]), len(got)
        finally:
            resp.close()

    def read_json(self, name: str) -> dict:
        try:
            return json.loads(self.read(name))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.uri}/{name} is unreadable ({e})") from None

    def safetensors_header(self, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype)}`` of a safetensors file, from its first 8 + N bytes."""
        return parse_safetensors_header(lambda length, offset: self.read(name, length, offset), f"{self.uri}/{name}")
