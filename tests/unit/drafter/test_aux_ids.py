"""vLLM reads an EAGLE-3 drafter's aux-layer ids in two places that disagree (Model Runner V2, the GPU default, and
the V1 runner, the CPU's): every export writes them where both read them, vLLM 0.32's own readers read the exports
alike, and `pull` and `observe` refuse a directory whose ids one runner would read otherwise."""

import json
import os

import mlflow
import pytest
import torch
from click.testing import CliRunner

from draftline import names
from draftline.cli import cli
from draftline.drafter.aux_ids import aux_ids_by_runner, fc_aux_count, require_served_ids, served_ids_problem
from draftline.drafter.model import build_draft_model
from draftline.drafter.shape import layer_config
from draftline.errors import CheckpointError
from draftline.export.directory import write_drafter
from draftline.export.midlayer import write_midlayer
from draftline.export.upload import CHECKSUMS, sha256_manifest
from draftline.registry.blobcache import BlobCache
from draftline.registry.transfer import fetch_directory
from tests.kit.vllm_readers import vllm_reads

AUX = [1, 2, 4, 5]  # four, not EAGLE-3's usual three: vLLM's fc width is then read from num_aux_hidden_states
VOCAB, DRAFT = 1024, 256
IDS = "eagle_aux_hidden_state_layer_ids"


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """The three configs export writes, for tiny drafters: speculators' format (a Llama layer), vLLM's flat
    ``Eagle3DeepseekV2ForCausalLM`` (an MLA layer), and SpecForge's ``midlayer`` layout beside the first."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("aux-ids")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=6, vocab_size=VOCAB)).save_pretrained(root / "llama-verifier")
    DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=VOCAB, num_hidden_layers=6, n_routed_experts=2, num_experts_per_tok=1,
        first_k_dense_replace=1)).save_pretrained(root / "mla-verifier")
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT] = True
    out = {}
    for kind in ("llama", "mla"):
        verifier = str(root / f"{kind}-verifier")
        model = build_draft_model(verifier, d2t=torch.zeros(DRAFT, dtype=torch.long), t2d=t2d, aux_layer_ids=AUX,
                                  draft_vocab_size=DRAFT, dtype=torch.float32, layer=layer_config(verifier, None, kind))
        write_drafter(model, root / kind, {names.VERIFIER_NAME_OR_PATH: "org/verifier"}, {})
        out[kind] = root / kind
        if kind == "llama":
            write_midlayer(model, root / "midlayer", {names.VERIFIER_AUX_LAYERS: json.dumps(AUX)})
            out["midlayer"] = root / "midlayer"
    return out


def _config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def nested_only(config: dict) -> dict:
    """A flat config as draftline wrote it before: the ids under ``eagle_config.eagle_aux_hidden_state_layer_ids``
    only (lightseekorg/kimi-k2.5-eagle3-mla's form)."""
    config = {k: v for k, v in config.items() if k not in (IDS, "num_aux_hidden_states")}
    config["eagle_config"] = {IDS: AUX, "use_aux_hidden_state": True}
    return config


def test_every_export_has_its_ids_read_alike_by_both_runners_and_fc_sized_for_them(exports):
    for kind, directory in exports.items():
        cfg = _config(directory)
        assert aux_ids_by_runner(cfg) == {"v1": tuple(AUX), "v2": tuple(AUX)}, kind
        assert fc_aux_count(cfg) == len(AUX), kind
        require_served_ids(directory)
    llama = _config(exports["llama"])  # speculators' format: vLLM copies the top-level ids, takes the layer config
    assert llama[IDS] == AUX and llama["transformer_layer_config"]["num_aux_hidden_states"] == len(AUX)
    for flat in ("mla", "midlayer"):
        cfg = _config(exports[flat])
        assert (cfg[IDS], cfg["num_aux_hidden_states"]) == (AUX, len(AUX))
        assert cfg["eagle_config"] == {IDS: AUX, "layer_ids": AUX, "use_aux_hidden_state": True}


def test_the_readers_follow_vllms_branches():
    top, old = {IDS: AUX, "num_aux_hidden_states": 4}, nested_only({})
    assert aux_ids_by_runner(top) == {"v1": tuple(AUX), "v2": tuple(AUX)}
    assert aux_ids_by_runner(old) == {"v1": tuple(AUX), "v2": None}  # V2 never reads the nested key
    assert aux_ids_by_runner({"eagle_config": {"layer_ids": AUX}}) == {"v1": None, "v2": tuple(AUX)}
    assert aux_ids_by_runner({}) == {"v1": None, "v2": None}
    assert fc_aux_count(old) == 4 and fc_aux_count({IDS: AUX}) == 3  # llama/deepseek: nested ids or 3
    # speculators' format: vLLM copies the top-level ids onto the layer config; fc by the layer's count, else 3
    speculators = {"speculators_config": {}, "speculators_model_type": "eagle3", IDS: AUX,
                   "transformer_layer_config": {"model_type": "llama"}}
    assert aux_ids_by_runner(speculators) == {"v1": tuple(AUX), "v2": tuple(AUX)}
    assert "sizes the drafter's fc for 3 aux hidden states" in served_ids_problem(speculators)
    assert fc_aux_count({**speculators, "transformer_layer_config": {"model_type": "qwen3"}}) == 4  # qwen3: top ids
    assert served_ids_problem({**speculators, IDS: [2, 3, 4]}) is None  # three ids: the default width fits


def test_vllms_own_readers_read_every_export_alike(exports, vllm_python, tmp_path):
    """vLLM 0.32's own readers (:mod:`tests.kit.vllm_readers`: V2's, the GPU default, and V1's, the CPU's) on each
    exported directory. A nested-only config beside them shows the check is not vacuous: V2 reads nothing from
    it."""
    old = tmp_path / "nested-only"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(nested_only(_config(exports["mla"]))))
    dirs = {**{k: str(v) for k, v in exports.items()}, "nested-only": str(old)}
    read = vllm_reads(vllm_python, dirs)
    for kind in exports:
        assert read[kind] == {"v1": AUX, "v2": AUX, "num_aux_hidden_states": len(AUX)}, (kind, read)
    assert read["nested-only"] == {"v1": AUX, "v2": None, "num_aux_hidden_states": None}
    for name, d in dirs.items():  # draftline's reader says what vLLM's say
        mine = aux_ids_by_runner(json.loads(open(os.path.join(d, "config.json")).read()))
        assert {r: list(v) if v else None for r, v in mine.items()} == {r: read[name][r] for r in ("v1", "v2")}


def test_a_directory_with_nested_only_ids_is_refused_in_one_line_naming_the_file_and_the_fix(exports, tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(nested_only(_config(exports["mla"]))))
    with pytest.raises(CheckpointError) as e:
        require_served_ids(d)
    said = str(e.value)
    assert len(said.splitlines()) == 1 and said.startswith(f"{d / 'config.json'}: vLLM's runners read different")
    assert "Model Runner V2 (the GPU default) reads none" in said and "re-export it with this draftline" in said


def _publish(tmp_path, config: dict) -> str:
    d = tmp_path / "export"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"weights")
    (d / CHECKSUMS).write_text(json.dumps(sha256_manifest(d)))
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(d), "drafter")
    return f"{run.info.artifact_uri}/drafter"


def test_pull_refuses_a_version_whose_ids_a_runner_would_ignore_and_leaves_dest_alone(exports, workspace, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))
    mlflow.set_experiment("aux-ids")
    source = _publish(tmp_path, nested_only(_config(exports["mla"])))
    client = mlflow.MlflowClient()
    client.create_registered_model("old-drafter")
    client.create_model_version("old-drafter", source, run_id=mlflow.last_active_run().info.run_id)
    dest = tmp_path / "pod"
    r = CliRunner().invoke(cli, ["pull", "old-drafter", "--version", "1", "--dest", str(dest)])
    assert r.exit_code == 1, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and "config.json: vLLM's runners read different aux layers" in line
    assert "re-export it with this draftline" in line
    assert not dest.exists()  # refused before the directory went into place

    fetch_directory(source, tmp_path / "kept", cache=BlobCache())  # without the check (a parent's fetch): pulled
    r = CliRunner().invoke(cli, ["pull", "--verify-only", str(tmp_path / "kept")])  # every sha256 fine, ids not
    assert r.exit_code == 1 and "re-export it with this draftline" in r.output


def test_a_parents_convention_is_asked_read_or_refused_and_its_ids_moved_for_vllm():
    from draftline.drafter.aux_ids import as_vllm_reads, parent_convention
    from draftline.errors import ParentMismatch

    specforge = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert parent_convention("sglang", catalog="vllm", config={}, registry=False, parent="p")[0] == "sglang"
    assert parent_convention("auto", catalog="sglang", config=specforge, registry=False, parent="p") == (
        "sglang", "the parent catalog")
    assert parent_convention("auto", catalog=None, config={}, registry=True, parent="p")[0] == "vllm"
    assert parent_convention("auto", catalog=None, config={"aux_layer_convention": "vllm"}, registry=False,
                             parent="p")[0] == "vllm"
    assert parent_convention("auto", catalog=None, config={"speculators_model_type": "eagle3"}, registry=False,
                             parent="p")[0] == "vllm"
    with pytest.raises(ParentMismatch, match=r"parent p's aux-layer ids \[1, 29, 57\] do not say whose layers"):
        parent_convention("auto", catalog=None, config=specforge, registry=False, parent="p")
    # Kimi-K2.5's 61 layers: SpecForge's default names the inputs of layers 2, 30, 58 as vLLM counts them
    assert as_vllm_reads([1, 29, 57], "sglang", 61, "p") == [2, 30, 58]
    assert as_vllm_reads([2, 30, 58], "vllm", 61, "p") == [2, 30, 58]
    assert as_vllm_reads([2, 30, 61], "vllm", 61, "p") == [2, 30, 61]  # 61: the last layer's output
    with pytest.raises(ParentMismatch, match=r"inputs of layers \[3, 31, 62\], past the verifier's 61"):
        as_vllm_reads([2, 30, 61], "sglang", 61, "p")
