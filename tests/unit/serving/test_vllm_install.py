"""Which vLLM a serving host's command runs, told without importing it, and a version that vLLM has no model for
refused before anything is downloaded or started."""

from __future__ import annotations

import stat
import sys

import mlflow
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.kinds import KINDS, MLA
from draftline.serving import vllm_install

from ...conftest import VLLM_PYTHON
from ..registry.test_registry import _version


def _old_vllm(root, version="0.6.3"):
    """A vLLM install from before MLA drafters (its registry has the Llama drafter only), whose package must not
    be imported to be told (importing it fails), and a `python` that runs with it."""
    site = root / "site"
    models = site / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('vllm was imported')\n")
    (models / "registry.py").write_text('_SPECULATIVE = {"Eagle3LlamaForCausalLM": ("llama_eagle3", "x")}\n')
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    python = root / "bin" / "python3"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_a_vllm_without_the_mla_drafters_model_is_refused_before_the_pull(workspace, tmp_path):
    old = _old_vllm(tmp_path / "old")
    found = vllm_install.find([str(old), "-m", "vllm.entrypoints.openai.api_server"])
    assert found.version == "0.6.3" and not found.serves(MLA.vllm_architecture)
    mlflow.set_experiment("serve")
    _version(MlflowClient(), "kimi-drafter", 1.5, **{names.DRAFTER_LAYER: "mla"})
    dest = tmp_path / "drafters"
    r = CliRunner().invoke(cli, ["serve", "kimi-drafter", "--version", "1", "--dest", str(dest), "--vllm",
                                 f"{old} -m vllm.entrypoints.openai.api_server"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: models:/kimi-drafter/1 is a drafter with an MLA (DeepSeek-V3) layer, which vLLM serves as "
        f"Eagle3DeepseekV2ForCausalLM; vLLM 0.6.3 at {tmp_path / 'old' / 'site'} has no such model: upgrade this "
        "host's vLLM (draftline's exports are tested with vLLM 0.32), or serve a version with another drafter layer"]
    assert not dest.exists()


def test_a_command_whose_python_has_no_vllm_is_named(tmp_path):
    with pytest.raises(Exception, match="which has no vllm package: pass --vllm"):
        vllm_install.find([sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
    wrapper = tmp_path / "serve.sh"  # a container's wrapper: its vLLM cannot be told, so it is not checked
    wrapper.write_text("#!/bin/sh\nexec vllm serve \"$@\"\n")
    wrapper.chmod(0o755)
    assert vllm_install.find([str(wrapper)]) is None


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM venv (.venv-vllm): ./setup.sh --vllm builds it")
def test_the_real_vllm_serves_every_kind_of_drafter_found_from_its_script_or_its_python():
    script = VLLM_PYTHON.parent / "vllm"
    for prefix in ([str(script), "serve"], [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]):
        found = vllm_install.find(prefix)
        assert found.version.startswith("0.32") and found.python.endswith("python"), found
        assert all(found.serves(kind.vllm_architecture) for kind in KINDS.values())
