"""A fleet of deployments pulling by stage while the registry moves: for the fleet test and benchmark.

``publish`` registers versions whose files differ (and one file they share), ``Mover`` promotes and rolls
back Production on a thread and records when each change began and ended, ``start_pullers`` starts
``draftline pull NAME --stage Production`` processes, and ``check_pull`` / ``check_cache`` say what is wrong
with a pulled directory or a shared cache (an empty list when nothing is).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlflow

from draftline import names
from draftline.config import CACHE_ENV
from draftline.drafter.aux_ids import served_aux_fields
from draftline.registry.promotion import promote, rollback
from draftline.registry.stages import holders
from draftline.registry.transfer import CHECKSUMS
from draftline.registry.versions import checksums_tag
from draftline.util import file_sha256, manifest_digest

TAGS = {"init": "tiny", names.PARENT_SOURCE: "draftline/tiny-parent", names.PARENT_SHA256: "ab" * 32,
        names.PARENT_LAYOUT: "midlayer", names.VOCAB_POLICY: "parent", names.VERIFIER_NAME_OR_PATH: "org/verifier",
        names.VERIFIER_AUX_LAYERS: "[2, 4, 5]", names.DATA_DIGEST: "cd" * 32, names.FINETUNE_RUN_ID: "r1",
        names.EXPORT_VALIDATED: "true", names.TRAIN_PAIRING: "vllm-shifted", "metric.val/acceptance_length": "1.5",
        "metric.train/acceptance_length": "1.5"}


def publish(client, name: str, versions: int, mib: int, root: Path) -> dict[str, dict[str, str]]:
    """Register ``versions`` versions of ``name``, each an export of its own ``model.safetensors`` (``mib``
    MiB of distinct bytes) and ``config.json`` beside a ``README.md`` they all share; returns ``{version:
    checksums manifest}``."""
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001  (it exists)
        pass
    out = {}
    for k in range(versions):
        d = root / f"{name}-export-{k}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"export": k, "speculators_config": {
            "verifier": {"name_or_path": TAGS[names.VERIFIER_NAME_OR_PATH]}}, **served_aux_fields([2, 4, 5])}))
        (d / "README.md").write_text("# a drafter of the fleet test\n")
        (d / "model.safetensors").write_bytes(random.Random(k).randbytes(mib << 20))
        manifest = {p.name: file_sha256(p) for p in sorted(d.iterdir())}
        (d / CHECKSUMS).write_text(json.dumps(manifest))
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(d), "drafter")
        mv = client.create_model_version(name, f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id,
                                         tags={**TAGS, names.EXPORT_SHA256: manifest_digest(manifest),
                                               **checksums_tag(manifest)})
        out[str(mv.version)] = manifest
    return out


@dataclass
class Mover:
    """Promotes a random other version to Production every ``every_s`` seconds, every third change a
    rollback, until stopped; ``changes`` holds ``(began, ended, holder after)`` per change."""

    client: object
    name: str
    versions: list[str]
    every_s: float = 0.5
    changes: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def __post_init__(self):
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, daemon=True)

    def start(self) -> Mover:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        rng = random.Random(0)
        while not self._stop.wait(self.every_s):
            began = time.time()
            try:
                current = holders(self.client, self.name)["Production"]
                if len(self.changes) % 3 == 2:
                    done = rollback(self.client, self.name, reason="fleet test")["version"]
                else:
                    done = promote(self.client, self.name, rng.choice([v for v in self.versions if v != current]),
                                   "Production")["version"]
            except Exception as e:  # noqa: BLE001
                self.errors.append(repr(e))
                continue
            self.changes.append((began, time.time(), done))

    def held_during(self, first: str, version: str, start: float, end: float) -> bool:
        """Could ``version`` have held Production at some moment in ``[start, end]``? Production held
        ``first`` before the first change; a change's new holder took over somewhere between its start and end,
        and held until the end of the next change at the latest."""
        spans, since = [], float("-inf")
        holder = first
        for began, ended, after in self.changes:
            spans.append((holder, since, ended))
            holder, since = after, began
        spans.append((holder, since, float("inf")))
        return any(v == version and lo <= end and hi >= start for v, lo, hi in spans)


@dataclass
class Pull:
    dest: Path
    cache: Path
    proc: subprocess.Popen
    started: float
    ended: float | None = None
    out: str = ""
    err: str = ""

    @property
    def seconds(self) -> float:
        return (self.ended or time.time()) - self.started

    def result(self) -> dict | None:
        try:
            return json.loads(self.out) if self.proc.returncode == 0 else None
        except ValueError:
            return None


def start_pullers(n: int, name: str, root: Path, env: dict, *, shared: int, argv=None) -> list[Pull]:
    """``n`` processes of ``draftline pull NAME --stage Production --json`` (or of ``argv(name, dest)``, with
    the working directory's modules importable): the first ``shared`` share one cache (pods on one node), the
    others have a cache each."""
    pulls = []
    for i in range(n):
        cache = root / "cache-shared" if i < shared else root / f"cache-{i}"
        dest = root / f"pod-{i}" / "drafter"
        cmd = argv(name, dest) if argv else [sys.executable, "-m", "draftline.cli", "pull", name, "--stage",
                                             "Production", "--dest", str(dest), "--json"]
        proc = subprocess.Popen(cmd, env={**env, CACHE_ENV: str(cache)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pulls.append(Pull(dest, cache, proc, time.time()))
    return pulls


def wait_all(pulls: list[Pull], timeout_s: float = 900) -> None:
    def wait(p: Pull):
        p.out, p.err = p.proc.communicate(timeout=timeout_s)
        p.ended = time.time()

    threads = [threading.Thread(target=wait, args=(p,)) for p in pulls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_pull(dest: Path, version: str, manifests: dict[str, dict[str, str]]) -> list[str]:
    """What is wrong with ``dest`` as the complete directory of ``version`` (and of no other)."""
    want = manifests[version]
    problems = []
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    if files != sorted([*want, CHECKSUMS]):
        problems.append(f"{dest}: files {files}, not those of v{version}")
    for fname, digest in want.items():
        if (dest / fname).is_file() and _sha256(dest / fname) != digest:
            owner = [v for v, m in manifests.items() if m.get(fname) == _sha256(dest / fname)]
            problems.append(f"{dest}/{fname} is not v{version}'s (it is {owner or 'no version'}'s)")
    if (dest / CHECKSUMS).is_file() and json.loads((dest / CHECKSUMS).read_text()) != want:
        problems.append(f"{dest}/{CHECKSUMS} is not v{version}'s")
    return problems


def check_cache(cache: Path) -> list[str]:
    """What is wrong in a content-addressed cache: a blob whose bytes are not its name, a stray file, a
    scratch folder left behind."""
    problems = []
    root = cache / "blobs" / "sha256"
    for p in sorted(root.rglob("*")) if root.exists() else []:
        if p.name.startswith(".incoming-"):
            problems.append(f"scratch left behind: {p}")
        elif p.is_file() and p.suffix == ".stat":
            continue
        elif p.is_file() and (p.parent.parent != root or _sha256(p) != p.name):
            problems.append(f"partial or foreign blob: {p}")
    return problems


def pull_env(uri: str, user: str | None = None, password: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DRAFTLINE_"))}
    env["MLFLOW_TRACKING_URI"] = uri
    if user:
        env.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password or "")
    return env
