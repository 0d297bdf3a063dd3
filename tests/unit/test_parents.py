"""`init` resolution: random, catalog names, directories, the local Hugging Face cache (offline)."""

import pytest

from draftline.drafter.parents import load_catalog, resolve_init
from draftline.errors import ConfigError, ParentNotFound


def test_random_and_directory(tiny):
    assert resolve_init("random").is_random
    p = resolve_init(str(tiny["parent"]))
    assert p.path == tiny["parent"].resolve() and p.source == str(tiny["parent"].resolve())


def test_catalog_entry_found_through_its_environment_variable(tiny, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_TINY_DIR", str(tiny["parent"].parent))
    p = resolve_init("tiny")
    assert (p.name, p.source, p.path) == ("tiny", "draftline/tiny-parent", tiny["parent"].resolve())


def test_repo_id_from_the_local_hf_cache(tiny, tmp_path, monkeypatch):
    import shutil

    snap = tmp_path / "hub" / "models--acme--drafter" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny["parent"], snap)
    (tmp_path / "hub" / "models--acme--drafter" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--drafter" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = resolve_init("acme/drafter")
    assert p.path == snap and p.source == "acme/drafter" and p.revision == "0" * 40


def test_unknown_parent_and_bad_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ParentNotFound, match="catalog name \\(aq-medai, tiny\\)"):
        resolve_init("acme/not-cached")
    bad = tmp_path / "parents.yaml"
    bad.write_text("parents:\n  x: {source: a/b, layuot: midlayer}\n")
    with pytest.raises(ConfigError, match="invalid"):
        load_catalog(bad)
