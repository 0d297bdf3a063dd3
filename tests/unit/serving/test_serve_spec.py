"""What every vLLM draftline starts is told: the verifier's dtype, --trust-remote-code only when trusted, the
flags of DRAFTLINE_VLLM_ARGS, and for capture the extraction with draftline's connector; and what a directory
that ships custom code gets without the flag."""

import json
from pathlib import Path

import pytest

from draftline import names
from draftline.errors import ConfigError, UsageError
from draftline.registry.lineage import environment_tags
from draftline.serving import hf_model
from draftline.serving.engine import PLUGINS, ServeSpec

MLA = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512,
       "qk_rope_head_dim": 64, "hidden_size": 256}


def verifier(tmp_path: Path, config: dict, tokenizer: dict | None = None) -> Path:
    d = tmp_path / "v"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return d


def test_an_mla_verifier_is_served_in_bf16_and_a_llama_in_float32(tmp_path):
    assert ServeSpec(model=str(verifier(tmp_path, MLA))).dtype == "bfloat16"
    k25 = {"model_type": "kimi_k25", "text_config": MLA}
    assert ServeSpec(model=str(verifier(tmp_path, k25))).dtype == "bfloat16"
    assert ServeSpec(model=str(verifier(tmp_path, {"model_type": "llama"}))).dtype == "float32"


def test_custom_code_is_refused_in_one_line_naming_the_flag_until_trusted(tmp_path, monkeypatch):
    d = verifier(tmp_path, {**MLA, "model_type": "kimi_k2", "auto_map": {"AutoConfig": "configuration_kimi.C"}},
                 {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.T", None]}})
    needs = hf_model.custom_code(d)
    assert any("configuration_kimi.py" in n for n in needs) and any("tokenization_kimi.py" in n for n in needs)
    with pytest.raises(UsageError, match="ships its model or tokenizer as custom code .* pass --trust-remote-code"):
        hf_model.check_custom_code(d)
    assert "--trust-remote-code" not in ServeSpec(model=str(d)).argv(Path("python"), 1)
    monkeypatch.delenv(hf_model.TRUST_ENV, raising=False)
    hf_model.trust_as_recorded(d, "True")  # as a later stage reads it back from MLflow
    hf_model.check_custom_code(d)
    assert "--trust-remote-code" in ServeSpec(model=str(d)).argv(Path("python"), 1)


def test_a_natively_read_directory_needs_no_flag(tmp_path):
    d = verifier(tmp_path, {"model_type": "kimi_k25", "auto_map": {"AutoConfig": "configuration_kimi_k25.C"}},
                 {"tokenizer_class": "PreTrainedTokenizerFast"})
    assert hf_model.custom_code(d) == []


def test_vllm_args_reach_every_server_and_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_VLLM_ARGS", "--tensor-parallel-size 8 --gpu-memory-utilization 0.92")
    argv = ServeSpec(model=str(verifier(tmp_path, {"model_type": "llama"}))).argv(Path("python"), 1)
    assert argv[-4:] == ["--tensor-parallel-size", "8", "--gpu-memory-utilization", "0.92"]
    assert environment_tags()[names.VLLM_ARGS] == "--tensor-parallel-size 8 --gpu-memory-utilization 0.92"
    monkeypatch.setenv("DRAFTLINE_VLLM_ARGS", "--bad 'quote")
    with pytest.raises(ConfigError, match="DRAFTLINE_VLLM_ARGS is not a valid shell-quoted list"):
        ServeSpec(model=str(verifier(tmp_path, {"model_type": "llama"})))


def test_capture_extracts_the_aux_layers_and_the_last_with_draftlines_connector(tmp_path):
    spec = ServeSpec(model=str(verifier(tmp_path, MLA)), extract_layers=[2, 4, 5, 8], hidden_states_dir="/hs")
    argv = spec.argv(Path("python"), 1)
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    assert transfer["kv_connector_module_path"] == "draftline_hs_connector"
    assert (PLUGINS / f"{transfer['kv_connector_module_path']}.py").is_file()
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == "/hs"


def test_the_pulled_serve_line_trusts_the_code_only_where_the_data_was_prepared_trusting_it():
    from draftline.registry.versions import vllm_command

    trusted, _ = vllm_command(Path("/srv/d"), "moonshotai/Kimi-K2.5", 3, trust_remote_code=True)
    plain, spec = vllm_command(Path("/srv/d"), "org/llama", 3)
    assert trusted.startswith("vllm serve moonshotai/Kimi-K2.5 --trust-remote-code --speculative-config ")
    assert "--trust-remote-code" not in plain and spec["num_speculative_tokens"] == 3


def test_the_layers_vllm_captured_are_read_from_its_log_and_an_export_fed_others_is_refused(tmp_path):
    """The lines vLLM 0.32 writes (the V1 runner's, as a CPU server logged it; Model Runner V2's two, from
    ``eagle3_utils.py``); the V1 runner says nothing when it falls back to the verifier's default layers."""
    from draftline.drafter.aux_ids import served_aux_fields
    from draftline.errors import CheckpointError
    from draftline.export.validate import layers_as_trained
    from draftline.serving.checks import captured_aux_layers

    v1 = ("(Worker pid=20497) INFO 12-07 21:37:09 [gpu_model_runner.py:5243] Using auxiliary layers from "
          "speculative config: (2, 4, 5)")
    assert captured_aux_layers(f"INFO:     Started server\n{v1}\n") == ([2, 4, 5], "config")
    assert captured_aux_layers("INFO x [eagle3_utils.py:27] Using Eagle3 auxiliary layers from config: [2, 30, 58]") \
        == ([2, 30, 58], "config")
    assert captured_aux_layers("INFO x Using Eagle3 auxiliary layers from model: (2, 30, 58)") == ([2, 30, 58],
                                                                                                   "default")
    assert captured_aux_layers("(Worker pid=1) INFO 12-07 21:37:02 [default_loader.py:291] Loading weights took "
                               "0.05 seconds") == (None, "default")  # V1's silent fallback: INFO, no line
    assert captured_aux_layers("WARNING 12-07 21:37:02 [x.py:1] only warnings") == (None, "unknown")
    assert captured_aux_layers("INFO:     Uvicorn running on http://127.0.0.1:8000") == (None, "unknown")  # not vLLM

    (tmp_path / "config.json").write_text(json.dumps(served_aux_fields([2, 4, 5])))
    assert layers_as_trained(tmp_path, {"aux_layers": [2, 4, 5], "aux_from": "config"}) == \
        "vLLM captured layers [2, 4, 5], as trained"
    assert "did not say" in layers_as_trained(tmp_path, {"aux_layers": None, "aux_from": "unknown"})
    for found, said in (({"aux_layers": [2, 3, 5], "aux_from": "config"}, "layers [2, 3, 5] for this drafter (config)"),
                        ({"aux_layers": None, "aux_from": "default"}, "the verifier's default layers")):
        with pytest.raises(CheckpointError, match=r"vLLM captured .*not the layers \[2, 4, 5\] it was trained on; "
                                                  "nothing was registered") as e:
            layers_as_trained(tmp_path, found)
        assert said in str(e.value)
