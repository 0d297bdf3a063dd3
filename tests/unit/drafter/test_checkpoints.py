"""Strict parent loading: every key lands, every shape matches, or one error names each problem."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline.drafter.checkpoints import detect_layout, find_checkpoint, load_into_model, read_tensors
from draftline.drafter.model import build_draft_model
from draftline.errors import CheckpointError


def _model_for(parent_dir, verifier):
    vocab = read_tensors(find_checkpoint(parent_dir), {"d2t", "t2d"})
    return build_draft_model(str(verifier), d2t=vocab["d2t"], t2d=vocab["t2d"], aux_layer_ids=[2, 4, 5],
                             draft_vocab_size=int(vocab["d2t"].numel()))


def _edit_parent(src, dst, edit):
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_midlayer_parent_lands_exactly_in_layers_0(tiny):
    model = _model_for(tiny["parent"], tiny["verifier"])
    report = load_into_model(model, find_checkpoint(tiny["parent"]))
    parent = load_file(str(tiny["parent"] / "model.safetensors"))
    state = model.state_dict()
    assert report.layout == "midlayer" and report.key_remap == "midlayer.->layers.0."
    assert sorted(report.loaded) == sorted(parent)
    for key, value in parent.items():
        assert torch.equal(state[key.replace("midlayer.", "layers.0.")], value), key
    assert state["fc.weight"].dtype == torch.bfloat16  # loaded into the bf16 model, not beside it


def test_shape_mismatch_names_each_key_with_both_shapes(tiny, tmp_path):
    def widen(state):
        state["fc.weight"] = torch.zeros(128, 512, dtype=torch.bfloat16)
        state["midlayer.mlp.up_proj.weight"] = torch.zeros(300, 128, dtype=torch.bfloat16)
    bad = _edit_parent(tiny["parent"], tmp_path / "bad", widen)
    with pytest.raises(CheckpointError) as e:
        load_into_model(_model_for(tiny["parent"], tiny["verifier"]), find_checkpoint(bad))
    msg = str(e.value)
    assert "2 problems" in msg
    assert "fc.weight: parent [128, 512], model [128, 384] — parent trained for another verifier?" in msg
    assert "midlayer.mlp.up_proj.weight: parent [300, 128], model [256, 128]" in msg


def test_missing_and_unexpected_keys_are_refused(tiny, tmp_path):
    def edit(state):
        del state["midlayer.hidden_norm.weight"]
        state["midlayer.self_attn.rotary.weight"] = torch.zeros(4)
    bad = _edit_parent(tiny["parent"], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        load_into_model(_model_for(tiny["parent"], tiny["verifier"]), find_checkpoint(bad))
    assert "layers.0.hidden_norm.weight: missing from the parent" in str(e.value)
    assert "midlayer.self_attn.rotary.weight: unexpected key" in str(e.value)


def test_verifier_owned_keys_are_skipped_and_reported(tiny, tmp_path):
    extra = _edit_parent(tiny["parent"], tmp_path / "extra",
                         lambda s: s.__setitem__("embed_tokens.weight", torch.ones(518, 128, dtype=torch.bfloat16)))
    model = _model_for(tiny["parent"], tiny["verifier"])
    before = model.embed_tokens.weight.clone()
    report = load_into_model(model, find_checkpoint(extra))
    assert report.skipped == ["embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, before)  # the verifier's embeddings stay


def test_truncated_safetensors_is_a_clear_error(tiny, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(tiny["parent"], bad)
    raw = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="truncated or not safetensors"):
        load_into_model(_model_for(tiny["parent"], tiny["verifier"]), find_checkpoint(bad))


def test_pickle_only_checkpoint_is_refused_unless_allowed(tiny, tmp_path):
    pick = tmp_path / "pickled"
    pick.mkdir()
    state = load_file(str(tiny["parent"] / "model.safetensors"))
    torch.save(state, pick / "pytorch_model.bin")
    (pick / "config.json").write_text((tiny["parent"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="pickles can run code.*--allow-pickle"):
        find_checkpoint(pick)
    files = find_checkpoint(pick, allow_pickle=True)
    model = _model_for(tiny["parent"], tiny["verifier"])
    assert load_into_model(model, files).layout == "midlayer"


def test_sharded_checkpoint_with_index(tiny, tmp_path):
    state = load_file(str(tiny["parent"] / "model.safetensors"))
    keys = sorted(state)
    out = tmp_path / "sharded"
    out.mkdir()
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        save_file({k: state[k] for k in ks}, str(out / name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: n for n, ks in halves.items() for k in ks}}))
    model = _model_for(tiny["parent"], tiny["verifier"])
    assert sorted(load_into_model(model, find_checkpoint(out)).loaded) == keys


def test_layout_detection():
    assert detect_layout(["midlayer.mlp.up_proj.weight", "fc.weight"]) == "midlayer"
    assert detect_layout(["layers.0.mlp.up_proj.weight"]) == "speculators"
    with pytest.raises(CheckpointError, match="not an EAGLE-3 drafter"):
        detect_layout(["model.embed_tokens.weight"])
