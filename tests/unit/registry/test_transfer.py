"""Verified pulls through the content-addressed cache, on the embedded store and a real `mlflow server`."""

import json
import os
import tempfile
from pathlib import Path

import mlflow
import pytest

from draftline import names
from draftline.errors import VerificationError
from draftline.export.upload import CHECKSUMS, sha256_manifest
from draftline.registry.blobcache import BlobCache
from draftline.registry.transfer import fetch_directory


@pytest.fixture(params=["sqlite", "server"])
def store(request, workspace, monkeypatch, tmp_path):
    if request.param == "server":
        uri = request.getfixturevalue("mlflow_server")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(f"transfer-{request.node.name}")
    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))
    return request.param


def _publish(tmp_path: Path, files: dict[str, bytes], manifest: dict | None = None) -> str:
    d = tmp_path / "export"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / CHECKSUMS).write_text(json.dumps(manifest if manifest is not None else sha256_manifest(d)))
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(d), "drafter")
    return f"{run.info.artifact_uri}/drafter"


FILES = {"model.safetensors": os.urandom(3 << 20), "config.json": b'{"a": 1}', "README.md": b"# card\n"}


def test_cold_then_warm_pull_and_no_destination_shares_bytes_with_the_cache(store, tmp_path):
    uri = _publish(tmp_path, FILES)
    cold = fetch_directory(uri, tmp_path / "a", cache=BlobCache())
    assert cold["downloaded_bytes"] == sum(len(b) for b in FILES.values()) and cold["cached_bytes"] == 0
    assert {n: (tmp_path / "a" / n).read_bytes() for n in FILES} == FILES

    warm = fetch_directory(uri, tmp_path / "b", cache=BlobCache())  # a restarted pod: nothing downloaded
    assert warm["downloaded_bytes"] == 0 and warm["cached_bytes"] == cold["downloaded_bytes"]
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    blob = BlobCache().get(sha256_manifest_of(FILES)["model.safetensors"])
    assert (tmp_path / "b" / "model.safetensors").stat().st_ino != blob.stat().st_ino

    # someone writes into a pulled file: neither the cache nor another destination changes with it
    with open(tmp_path / "b" / "model.safetensors", "r+b") as f:
        f.write(b"\0" * 16)
    again = fetch_directory(uri, tmp_path / "c", cache=BlobCache())
    assert again["downloaded_bytes"] == 0
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_a_cached_blob_edited_in_place_with_its_size_and_mtime_kept_is_evicted_and_fetched_again(store, tmp_path,
                                                                                              capsys):
    """`dd conv=notrunc; touch -r`: size and mtime are as they were, the change time is not (no call sets it
    back). The warm pull says so in one line, downloads the file afresh, and an earlier DEST keeps its bytes."""
    uri = _publish(tmp_path, FILES)
    fetch_directory(uri, tmp_path / "a", cache=BlobCache())
    digest = sha256_manifest_of(FILES)["model.safetensors"]
    blob = BlobCache().get(digest)
    st = blob.stat()
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 8)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (blob.stat().st_size, blob.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    capsys.readouterr()
    again = fetch_directory(uri, tmp_path / "b", cache=BlobCache())
    assert "the cached copy of model.safetensors" in capsys.readouterr().err
    assert again["downloaded_bytes"] == len(FILES["model.safetensors"])
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert BlobCache().get(digest).read_bytes() == FILES["model.safetensors"]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)  # the cache is local: the store does not matter
def test_a_blob_changed_while_it_is_copied_is_refused_and_evicted(store, tmp_path, monkeypatch):
    from draftline.registry import blobcache

    uri = _publish(tmp_path, FILES)
    fetch_directory(uri, tmp_path / "a", cache=BlobCache())
    digest = sha256_manifest_of(FILES)["model.safetensors"]
    real_copy = blobcache.shutil.copyfile

    def copy_while_someone_writes(src, dst, **kwargs):
        real_copy(src, dst, **kwargs)
        if Path(src).name == digest:
            Path(src).chmod(0o644)  # a writer opening it: its change time moves

    monkeypatch.setattr(blobcache.shutil, "copyfile", copy_while_someone_writes)
    with pytest.raises(VerificationError, match=r"cached copy of model\.safetensors .* changed while it was copied"):
        fetch_directory(uri, tmp_path / "b", cache=BlobCache())
    assert not (tmp_path / "b").exists() and BlobCache().get(digest) is None
    monkeypatch.setattr(blobcache.shutil, "copyfile", real_copy)  # not undo(): that would drop the test's cache dir too
    assert fetch_directory(uri, tmp_path / "b", cache=BlobCache())["downloaded_bytes"] == len(FILES["model.safetensors"])


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)  # the cache is local: the store does not matter
def test_a_cached_blob_whose_mtime_changed_is_evicted_and_downloaded_again_saying_so(store, tmp_path, capsys):
    uri = _publish(tmp_path, FILES)
    fetch_directory(uri, tmp_path / "a", cache=BlobCache())
    digest = sha256_manifest_of(FILES)["model.safetensors"]
    blob = BlobCache().get(digest)
    os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 10**9))  # touched, bytes as they were
    capsys.readouterr()
    again = fetch_directory(uri, tmp_path / "b", cache=BlobCache())
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said == [f"[draftline] the cached copy of model.safetensors ({blob}) changed on disk since it was "
                    "verified (its size, modification or change time): evicted it from the cache; downloading it again"], said
    assert again["downloaded_bytes"] == len(FILES["model.safetensors"])  # fetched again, the others from the cache
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert BlobCache().get(digest) == blob  # the fresh download is the cached copy now, recorded as verified
    capsys.readouterr()
    assert fetch_directory(uri, tmp_path / "c", cache=BlobCache())["downloaded_bytes"] == 0
    assert capsys.readouterr().err.strip() == ""  # said once: the next pull finds nothing to say


def test_verify_only_rehashes_a_pulled_directory(tmp_path, store):
    from draftline.errors import VerificationError
    from draftline.registry.transfer import verify_directory

    uri = _publish(tmp_path, FILES)
    fetch_directory(uri, tmp_path / "pod", cache=BlobCache())
    assert verify_directory(tmp_path / "pod")["files"] == len(FILES)
    with open(tmp_path / "pod" / "config.json", "r+b") as f:
        f.write(b"[")
    with pytest.raises(VerificationError, match=r"config\.json does not have the sha256"):
        verify_directory(tmp_path / "pod")
    (tmp_path / "pod" / "README.md").unlink()
    with pytest.raises(VerificationError, match="README.md is missing|config.json"):
        verify_directory(tmp_path / "pod")


def test_an_altered_stored_file_is_refused_and_the_destination_is_left_alone(store, tmp_path):
    good = sha256_manifest_of(FILES)
    uri = _publish(tmp_path, {**FILES, "model.safetensors": b"not the weights"}, manifest=good)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(VerificationError, match="model.safetensors arrived with sha256 .* refusing it"):
        fetch_directory(uri, dest, cache=BlobCache())
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"]  # nothing half-pulled
    assert not any(p.name.startswith(".dest.partial") for p in tmp_path.iterdir())
    assert BlobCache().get(good["model.safetensors"]) is None  # nor cached


def test_names_escaping_the_destination_are_refused_before_any_download(store, tmp_path):
    uri = _publish(tmp_path, FILES, manifest={"../../evil.sh": "0" * 64})
    with pytest.raises(VerificationError, match="escapes the destination"):
        fetch_directory(uri, tmp_path / "d", cache=None)
    assert not (tmp_path / "d").exists() and not (tmp_path.parent / "evil.sh").exists()


def sha256_manifest_of(files: dict[str, bytes]) -> dict[str, str]:
    import hashlib

    return {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}


def test_a_file_rewritten_together_with_its_checksum_is_caught_by_the_registry_digest(store, tmp_path):
    from draftline.util import manifest_digest

    recorded = manifest_digest(sha256_manifest_of(FILES))  # what export tagged the version with
    forged = {**FILES, "model.safetensors": b"other weights"}
    uri = _publish(tmp_path, forged, manifest=sha256_manifest_of(forged))  # consistent, but not what was exported
    with pytest.raises(VerificationError, match="does not match the export.sha256 the registry recorded"):
        fetch_directory(uri, tmp_path / "d", cache=None, expected_digest=recorded)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)  # sweeping is local: the store does not matter
def test_scratch_left_by_a_killed_puller_is_swept_by_the_next_pull(store, tmp_path):
    """A puller killed with -9 cleans nothing up; the next pull on this host removes its scratch folders (cache
    and destination side), and leaves alone those of a puller still running."""
    import socket
    import subprocess
    import sys

    from tests.kit.fleet import check_cache

    uri = _publish(tmp_path, FILES)
    cache, dest = BlobCache(), tmp_path / "pod" / "drafter"
    cache.root.mkdir(parents=True)
    dest.parent.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    try:
        left = [cache.root / f".incoming-{dead.pid}@{host}-abc123_x",
                dest.parent / f".drafter.partial-{dead.pid}@{host}-q1w2e3r4"]
        running = cache.root / f".incoming-{alive.pid}@{host}-zzzzzzzz"
        for d in [*left, running]:
            (d / "sub").mkdir(parents=True)
            (d / "sub" / "model.safetensors").write_bytes(b"half a file")
        fetch_directory(uri, dest, cache=cache, progress=False)
        assert not any(d.exists() for d in left)
        assert running.exists()
        problems = check_cache(cache.root.parent.parent)  # only the running puller's scratch is left
        assert f"scratch left behind: {running}" in problems and all(str(running) in p for p in problems)
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in dest.iterdir()) == sorted([*FILES, CHECKSUMS])


@pytest.mark.parametrize("store", ["server"], indirect=True)
@pytest.mark.parametrize("tagged", [True, False], ids=["today", "before-the-checksums-tag"])
def test_a_pull_by_stage_asks_the_server_for_little_and_an_older_version_still_pulls(store, tmp_path, monkeypatch,
                                                                                      tagged):
    """A fleet restarting together pays per request: the alias, then one GET per file (the file list comes from
    the version's tag). A version exported before that tag reads checksums.json from the store instead."""
    import requests
    from mlflow import MlflowClient

    from draftline.registry import versions
    from draftline.registry.promotion import promote
    from draftline.util import manifest_digest

    monkeypatch.setenv("DRAFTLINE_REGISTRY_POLICIES", str(tmp_path / "policies"))
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "production.yaml").write_text("stage: Production\nexport_validated: false\n")
    files = {**FILES, "config.json": b'{"speculators_config": {"verifier": {"name_or_path": "org/v"}}}'}
    manifest = sha256_manifest_of(files)
    client, name = MlflowClient(), f"few-{tagged}"
    client.create_registered_model(name)
    tags = {names.EXPORT_SHA256: manifest_digest(manifest), **(versions.checksums_tag(manifest) if tagged else {})}
    source = _publish(tmp_path, files)
    run_id = mlflow.last_active_run().info.run_id  # the run _publish logged the files in
    mv = client.create_model_version(name, source, run_id=run_id, tags=tags)
    promote(client, name, mv.version, "Production")

    sent = []
    send = requests.Session.send
    monkeypatch.setattr(requests.Session, "send", lambda self, r, **kw: sent.append(r.path_url) or send(self, r, **kw))
    out = versions.pull(client, name, stage="Production", alias=None, version=None, dest=tmp_path / "pod")
    assert out["version"] == mv.version and out["downloaded_bytes"] == sum(map(len, files.values()))
    assert json.loads((tmp_path / "pod" / CHECKSUMS).read_text()) == manifest
    downloads = [p for p in sent if "/mlflow-artifacts/artifacts/" in p]
    if tagged:
        assert sorted(p.rsplit("/", 1)[1] for p in downloads) == sorted(files), sent
        assert len(sent) - len(downloads) <= 2, sent  # the alias and MLflow's server-info, nothing else
    else:
        assert sorted(p.rsplit("/", 1)[1] for p in downloads) == sorted([*files, CHECKSUMS]), sent


def _shares_extents(path: Path) -> bool:
    import subprocess

    return "shared" in subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True).stdout


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)  # the cache is local: the store does not matter
def test_where_copies_cost_a_write_a_cold_pull_writes_once_unless_the_cache_was_asked_for(store, tmp_path,
                                                                                         monkeypatch):
    from draftline.registry.blobcache import clones

    if clones(tmp_path, tmp_path):
        pytest.skip(f"{tmp_path} clones: the cache fills there by default")
    monkeypatch.delenv("DRAFTLINE_CACHE_DIR")
    uri = _publish(tmp_path, FILES)
    total = sum(map(len, FILES.values()))
    cache = tmp_path / "node-cache"
    assert fetch_directory(uri, tmp_path / "a", cache=BlobCache(cache))["downloaded_bytes"] == total
    assert not list((cache / "blobs" / "sha256").rglob("*.stat"))  # nothing kept: the pull wrote each byte once
    assert fetch_directory(uri, tmp_path / "b", cache=BlobCache(cache))["downloaded_bytes"] == total
    fetch_directory(uri, tmp_path / "c", cache=BlobCache(cache, fill=True))  # `pull --cache`
    assert fetch_directory(uri, tmp_path / "d", cache=BlobCache(cache))["downloaded_bytes"] == 0  # read by default
    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "operator-cache"))  # a node's operator set one up
    fetch_directory(uri, tmp_path / "e", cache=BlobCache())
    assert fetch_directory(uri, tmp_path / "f", cache=BlobCache())["downloaded_bytes"] == 0


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_where_the_file_system_clones_the_cache_fills_and_a_warm_pull_writes_no_bytes(store, tmp_path, monkeypatch,
                                                                                       reflink_dir, capsys):
    """On XFS with reflink: the cache's copy and the warm pull's file are clones of the download (shared
    extents, copy-on-write), so neither costs a write, and a write into a pulled file changes only that file."""
    monkeypatch.delenv("DRAFTLINE_CACHE_DIR")
    node = Path(tempfile.mkdtemp(dir=reflink_dir))
    uri = _publish(tmp_path, FILES)
    cache = BlobCache(node / "cache")
    fetch_directory(uri, node / "a", cache=cache)
    digest = sha256_manifest_of(FILES)["model.safetensors"]
    blob = BlobCache(node / "cache").get(digest)
    assert blob is not None and _shares_extents(blob)  # kept, as a clone of DEST's file
    warm = fetch_directory(uri, node / "b", cache=BlobCache(node / "cache"))
    pulled = node / "b" / "model.safetensors"
    assert warm["downloaded_bytes"] == 0 and _shares_extents(pulled)
    assert pulled.stat().st_ino != blob.stat().st_ino
    with open(pulled, "r+b") as f:
        f.write(b"\0" * 16)
    capsys.readouterr()
    again = fetch_directory(uri, node / "c", cache=BlobCache(node / "cache"))
    assert again["downloaded_bytes"] == 0 and capsys.readouterr().err.strip() == ""  # the blob's witness held
    assert (node / "c" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
