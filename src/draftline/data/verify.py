"""Shards checked against their manifest's sha256 as training reads them, once each, not in a pass before step 1.

During finetune every rank hashes its share of the shards (shard *i* on rank *i* mod *world*, in manifest
order) on a background thread while it trains; the loop calls :meth:`ShardVerifier.check` each step, so a
shard that changed after prepare stops the run with one :class:`DataError` naming it, and the run does not
end successfully before every shard was checked. ``draftline verify-data`` / ``finetune --verify-data`` do a
full pass up front.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from draftline.errors import DataError
from draftline.util import file_sha256


def _mismatch(path: Path) -> DataError:
    return DataError(f"shard {path.name} in {path.parent} does not match the sha256 in its manifest: it changed "
                     "after prepare (a bad disk or copy?); prepare the data again or copy it again")


def shard_paths(data) -> list[tuple[Path, str]]:
    root = data.shard_root or data.root
    return [(Path(root) / e["file"], e["sha256"]) for e in data.manifest["shards"]]


def verify_all(data) -> dict[str, float]:
    """Every shard against the manifest, now. Returns ``{"shards", "bytes", "seconds"}``."""
    t0, size = time.perf_counter(), 0
    for path, want in shard_paths(data):
        if not path.is_file():
            raise DataError(f"shard {path} is missing; prepare the data again or download it whole")
        if file_sha256(path) != want:
            raise _mismatch(path)
        size += path.stat().st_size
    return {"shards": len(data.manifest["shards"]), "bytes": size, "seconds": time.perf_counter() - t0}


class ShardVerifier:
    """This rank's share of the shards, hashed on a background thread."""

    def __init__(self, data, rank: int = 0, world_size: int = 1):
        self.todo = [s for i, s in enumerate(shard_paths(data)) if i % max(world_size, 1) == rank]
        self.error: DataError | None = None
        self.checked = 0
        self._thread = threading.Thread(target=self._run, name="draftline-shard-verify", daemon=True)

    def start(self) -> ShardVerifier:
        self._thread.start()
        return self

    def _run(self) -> None:
        for path, want in self.todo:
            try:
                ok = file_sha256(path) == want
            except OSError as e:
                self.error = DataError(f"cannot read shard {path}: {e}")
                return
            if not ok:
                self.error = _mismatch(path)
                return
            self.checked += 1

    def check(self) -> None:
        """Raise the first mismatch found so far."""
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """Wait for the rest of this rank's shards (at the end of a run), then :meth:`check`."""
        self._thread.join()
        self.check()
