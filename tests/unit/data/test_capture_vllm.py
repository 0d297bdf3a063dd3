"""The vLLM capture backend's client against tests.kit.tiny_server's emulation of vLLM's hidden-state
extraction (speculators' protocol, computed with transformers), where faults are easy to make; real vLLM
capturing is tests/integration/test_kimi.py's."""

import pytest
import torch

from draftline.config import PrepareConfig
from draftline.data.prepare import build_data
from draftline.data.shards import open_prepared
from draftline.errors import ConfigError
from tests.kit.tiny_server import serve_in_thread

from ...conftest import DEMO


def test_vllm_backend_writes_the_same_shards_as_transformers(tiny, tmp_path):
    common = dict(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_length=128, max_samples=6,
                  batch_size=1, shard_tokens=256)
    local = build_data(PrepareConfig(**common), tmp_path / "local", progress=False)
    with serve_in_thread(tiny["verifier"], hidden_states_dir=tmp_path / "server-hs", aux_layer_ids=[2, 4, 5]) as srv:
        remote = build_data(PrepareConfig(**common, capture_backend="vllm", capture_endpoint=srv.url,
                                          capture_model=srv.model), tmp_path / "remote", progress=False)
    assert remote["capture_backend"] == "vllm" and remote["tokens"] == local["tokens"]
    a, b = open_prepared(tmp_path / "local").records(), open_prepared(tmp_path / "remote").records()
    for x, y in zip(a, b, strict=True):
        for key in x:
            assert torch.equal(x[key], y[key]), key
    assert not list((tmp_path / "server-hs").iterdir())  # every file the server wrote was read and removed


def test_vllm_backend_errors_name_the_fix(workspace, tiny, tmp_path):
    """What prepare says, before any run, when vLLM cannot capture: none here for a loopback server, a server
    without hidden-state extraction (asked once: no retries on a server that answered), another served model."""
    from click.testing import CliRunner
    from mlflow import MlflowClient

    from draftline.cli import cli

    flags = ["prepare", "--conversations", str(DEMO), "--verifier", str(tiny["verifier"]), "--max-samples", "2",
             "--capture-backend", "vllm", "--output-dir", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match="vLLM is needed here"):  # no endpoint: a loopback vLLM, switched off
        build_data(PrepareConfig(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_samples=2,
                                 capture_backend="vllm"), tmp_path / "a", progress=False)
    with serve_in_thread(tiny["verifier"]) as srv:  # a server without hidden-state extraction
        for model, said, fix in ((srv.model, "did not return hidden states", "hidden-state extraction"),
                                 ("other-model", "does not serve other-model", "--capture-model")):
            r = CliRunner().invoke(cli, [*flags, "--capture-endpoint", srv.url, "--capture-model", model])
            errors = [line for line in r.output.splitlines() if line.startswith("error")]
            assert r.exit_code != 0 and len(errors) == 1 and said in errors[0] and fix in errors[0], r.output
    client = MlflowClient()
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not (tmp_path / "out").exists()


def test_a_capture_server_extracting_other_layers_is_one_line_exit_2_before_any_run(workspace, tiny, tmp_path):
    from click.testing import CliRunner
    from mlflow import MlflowClient

    from draftline.cli import cli

    # prepare reads the aux layers [2, 4, 5] plus the last; this server extracts [2, 4] plus the last
    with serve_in_thread(tiny["verifier"], hidden_states_dir=tmp_path / "hs", aux_layer_ids=[2, 4]) as srv:
        r = CliRunner().invoke(cli, ["prepare", "--conversations", str(DEMO), "--verifier", str(tiny["verifier"]),
                                     "--max-samples", "4", "--capture-backend", "vllm", "--capture-endpoint",
                                     srv.url, "--capture-model", srv.model, "--output-dir", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "expected [tokens, 4, " in errors[0] and "--aux-layers" in errors[0], r.output
    client = MlflowClient()
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not (tmp_path / "out").exists()


def test_a_verifier_vllm_has_no_implementation_of_is_one_line_exit_2_before_any_run(workspace, tiny, tmp_path,
                                                                                   vllm_python):
    import json
    import shutil

    from click.testing import CliRunner
    from mlflow import MlflowClient

    from draftline.cli import cli

    verifier = shutil.copytree(tiny["verifier"], tmp_path / "mystery")
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "architectures": ["MysteryForCausalLM"]}))
    r = CliRunner().invoke(cli, ["prepare", "--conversations", str(DEMO), "--verifier", str(verifier),
                                 "--max-samples", "4", "--capture-backend", "vllm"])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "vLLM has no implementation of MysteryForCausalLM" in errors[0], r.output
    assert "--capture-backend transformers" in errors[0]
    client = MlflowClient()
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
