"""`init` resolution: random, catalog names, directories, the local Hugging Face cache, and the download of a
parent that is in none of them (faked: no network here), config and safetensors only, never a pickle."""

import fnmatch
import hashlib
import os
import shutil
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects, hf_raise_for_status

from draftline.drafter import parents
from draftline.drafter.parents import load_catalog, resolve_init
from draftline.errors import ConfigError, ParentNotFound

try:  # the listing the real hub client caches beside a snapshot (huggingface_hub >= 2): it knows every repo file
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
except ImportError:  # older clients keep no listing, and judge no snapshot incomplete
    write_tree_cache = None

AQ = "AQ-MedAI/Kimi-K2-Instruct-eagle3"
COMMIT = "3f1c" + "0" * 36
# A SpecForge parent as it lies on the Hub: the weights, and the optimizer state as a pickle beside them
REMOTE = {"config.json": b'{"architectures": ["LlamaForCausalLMEagle3"]}', "model.safetensors": b"weights",
          "training_state.pt": b"\x80\x04pickle", "README.md": b"# card"}


def hub_snapshot(cache, repo_id, files, commit=COMMIT, ref="main"):
    """Lay ``files`` out as huggingface_hub does: blobs by hash, the snapshot's files linked to them, the ref."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


class FakeHub:
    """``snapshot_download`` against a repo that holds ``files``: cache look-ups go to the real client (over the
    fake cache); a download writes what ``allow_patterns`` lets through, as the real client would, or raises
    ``error``."""

    def __init__(self, files=REMOTE, error=None):
        self.files, self.error, self.downloads = files, error, []

    def __call__(self, repo_id, *, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None,
                 **kw):
        if local_files_only:
            return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                     local_files_only=True, allow_patterns=allow_patterns, **kw)
        self.downloads.append({"repo_id": repo_id, "revision": revision, "allow_patterns": allow_patterns,
                               "cache_dir": cache_dir})
        if self.error is not None:
            raise self.error
        wanted = set(filter_repo_objects(list(self.files), allow_patterns=allow_patterns))
        snap = hub_snapshot(Path(cache_dir), repo_id, {k: v for k, v in self.files.items() if k in wanted},
                            ref=revision or "main")
        if write_tree_cache is not None:
            write_tree_cache(str(snap.parents[1]), COMMIT,
                             {k: TreeCacheEntry(size=len(v), blob_id=hashlib.sha1(v).hexdigest())
                              for k, v in self.files.items()})
        return str(snap)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty hub cache, no parent directory on this machine, the host online, and the fake hub."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the catalog's ~/models/... candidate: absent
    for var in ("DRAFTLINE_PARENTS_DIR", "DRAFTLINE_PARENTS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    fake = FakeHub()
    monkeypatch.setattr(parents, "snapshot_download", fake)
    return fake


@pytest.fixture
def parent_dir(tmp_path):
    """A parent directory as `make-tiny` writes one (`<dir>/parent`): resolution looks at where it lies, never
    inside the weights."""
    parent = tmp_path / "tiny" / "parent"
    parent.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (parent / name).write_bytes(REMOTE[name])
    return parent


def test_random_and_directory(parent_dir):
    assert resolve_init("random").is_random
    p = resolve_init(str(parent_dir))
    assert (p.path, p.source, p.revision) == (parent_dir.resolve(), str(parent_dir.resolve()), "local")


def test_catalog_entry_found_through_its_environment_variable(parent_dir, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_TINY_DIR", str(parent_dir.parent))
    p = resolve_init("tiny")
    assert (p.name, p.source, p.path) == ("tiny", "draftline/tiny-parent", parent_dir.resolve())


def test_repo_id_from_the_local_hf_cache(parent_dir, tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--drafter" / "snapshots" / ("0" * 40)
    shutil.copytree(parent_dir, snap)
    (tmp_path / "hub" / "models--acme--drafter" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--drafter" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = resolve_init("acme/drafter")
    assert p.path == snap and p.source == "acme/drafter" and p.revision == "0" * 40


def test_a_cached_catalog_parent_resolves_offline_at_its_commit(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    revision = load_catalog()["aq-medai"].revision
    snap = hub_snapshot(tmp_path / "hub", AQ, {k: v for k, v in REMOTE.items() if k != "training_state.pt"},
                        ref=revision)
    p = resolve_init("aq-medai")
    assert (p.name, p.source, p.path, p.revision) == ("aq-medai", AQ, snap, COMMIT)
    assert hub.downloads == []


def test_an_absent_catalog_parent_is_downloaded_without_its_pickle(hub, tmp_path, monkeypatch, capsys):
    revision = load_catalog()["aq-medai"].revision
    p = resolve_init("aq-medai")
    snap = tmp_path / "hub" / "models--AQ-MedAI--Kimi-K2-Instruct-eagle3" / "snapshots" / COMMIT
    assert (p.source, p.path, p.revision) == (AQ, snap, COMMIT)  # lineage records the commit, not "main"
    assert [(d["repo_id"], d["revision"], d["cache_dir"]) for d in hub.downloads] == [(AQ, revision,
                                                                                        str(tmp_path / "hub"))]
    patterns = hub.downloads[0]["allow_patterns"]
    for pickle in ("training_state.pt", "pytorch_model.bin", "state.pth", "x.pkl"):
        assert not any(fnmatch.fnmatch(pickle, pat) for pat in patterns), pickle
    assert sorted(f.name for f in snap.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    err = capsys.readouterr().err
    assert f"downloading parent 'aq-medai': https://huggingface.co/{AQ} at revision {revision}" in err
    # once there, it is found again with the host offline, though the cached listing names training_state.pt
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_init("aq-medai").path == snap and len(hub.downloads) == 1


def test_an_absent_repo_id_is_downloaded_at_main(hub, tmp_path):
    p = resolve_init("acme/drafter")
    assert (p.source, p.revision, p.path.parent.parent.name) == ("acme/drafter", COMMIT, "models--acme--drafter")
    assert hub.downloads[0]["revision"] == "main"


def test_a_pinned_revision_is_what_is_downloaded_and_what_the_message_names(hub, tmp_path, monkeypatch):
    catalog = tmp_path / "parents.yaml"
    catalog.write_text(f"parents:\n  pinned: {{source: {AQ}, revision: {COMMIT}}}\n")
    monkeypatch.setenv("DRAFTLINE_PARENTS", str(catalog))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ParentNotFound, match=f"`huggingface-cli download {AQ} --revision {COMMIT} --local-dir"):
        resolve_init("pinned")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_init("pinned").revision == COMMIT and hub.downloads[0]["revision"] == COMMIT


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_nothing_is_downloaded_and_the_message_says_what_to_download(hub, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    with pytest.raises(ParentNotFound) as e:
        resolve_init("aq-medai")
    msg = str(e.value)
    assert f"Download it first, e.g. `huggingface-cli download {AQ}" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ParentNotFound, match="HF_HUB_OFFLINE is set"):
        resolve_init("acme/drafter")
    assert hub.downloads == []


def test_the_tiny_parent_names_no_hub_repo_and_is_never_downloaded(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DRAFTLINE_TINY_DIR", raising=False)
    with pytest.raises(ParentNotFound, match="parent 'tiny' .* is not on this machine\\. Download it first"):
        resolve_init("tiny")
    assert hub.downloads == []


def hub_error(status, headers):
    """The error the real client raises for the Hub's answer (status and X-Error-* headers)."""
    response = httpx2.Response(status, headers=headers,
                               request=httpx2.Request("GET", f"https://huggingface.co/api/models/{AQ}"))
    with pytest.raises(Exception) as e:
        hf_raise_for_status(response)
    return e.value


def connection_lost():
    """What snapshot_download raises when the Hub cannot be reached and the cache has nothing."""
    try:
        raise httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")
    except httpx2.ConnectError as cause:
        try:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub") from cause
        except LocalEntryNotFoundError as e:
            return e


@pytest.mark.parametrize("error, says", [
    (lambda: hub_error(404, {"X-Error-Code": "RepoNotFound"}), "the Hub has no such repo, or it is private"),
    (lambda: hub_error(401, {}), "the Hub has no such repo, or it is private or gated and needs a token"),
    (lambda: hub_error(403, {"X-Error-Code": "GatedRepo"}), f"the repo is gated .* accept its terms at "
                                                             f"https://huggingface.co/{AQ}, then log in"),
    (lambda: hub_error(404, {"X-Error-Code": "RevisionNotFound"}), "the repo has no revision 'main': fix its "
                                                                    "`revision:` in"),
    (lambda: hub_error(401, {"X-Error-Message": "Invalid credentials in Authorization header"}),
     "the Hub refused access \\(HTTP 401\\): check the token"),
    (connection_lost, "ConnectError: \\[Errno -3\\] Temporary failure in name resolution\\. Check the network"),
])
def test_a_failed_download_is_one_line_naming_repo_revision_cause_and_fix(hub, error, says):
    hub.error = error()
    with pytest.raises(ParentNotFound, match=f"could not download parent 'aq-medai' \\({AQ} at revision main\\): "
                                             f"{says}") as e:
        resolve_init("aq-medai")
    assert "\n" not in str(e.value)


def test_a_repo_without_safetensors_is_refused(hub, tmp_path):
    hub.files = {"config.json": REMOTE["config.json"], "pytorch_model.bin": b"\x80\x04pickle"}
    with pytest.raises(ParentNotFound, match="has no safetensors weights .* draftline never loads pickles"):
        resolve_init("acme/drafter")


def test_unknown_parent_and_bad_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ParentNotFound, match="catalog name \\(aq-medai, kimi-k25-mla, kimi-k26-mla31, kimi-k26-nvidia, tiny, tiny-kimi, tiny-kimi-mla, tiny-kimi-mla31\\)"):
        resolve_init("acme/not-cached")
    bad = tmp_path / "parents.yaml"
    bad.write_text("parents:\n  x: {source: a/b, layuot: midlayer}\n")
    with pytest.raises(ConfigError, match="invalid"):
        load_catalog(bad)
