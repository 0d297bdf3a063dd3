"""Checks before launch: a parent, vocabulary or data set that does not fit the drafter is refused by the
launching process in seconds, before any rank starts, with one message naming the key, the shapes and the fix."""

import json
import resource
import struct
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from benchmarks.parent_load import aq_medai_state
from draftline.cli import cli
from draftline.drafter.checkpoints import find_checkpoint
from draftline.drafter.layer_kinds import KIMI_K2
from draftline.drafter.shape import layer_config
from draftline.errors import CheckpointError, DataError
from draftline.train.preflight import preflight

DTYPES = {torch.bfloat16: ("BF16", 2), torch.int64: ("I64", 8), torch.bool: ("BOOL", 1), torch.float32: ("F32", 4)}


def sparse_safetensors(path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Path:
    """A safetensors file whose header is exact and whose data is a hole (zeros, no disk used): enough for
    every check that reads headers only, at any size."""
    header, offset = {}, 0
    for key, (shape, dtype) in layout.items():
        name, size = DTYPES[dtype]
        n = size
        for d in shape:
            n *= d
        header[key] = {"dtype": name, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


@pytest.fixture(scope="module")
def kimi_verifier(tmp_path_factory) -> str:
    """Kimi-K2's config.json (DeepSeek-V3: hidden 7168, vocabulary 163840, 61 layers); no weights."""
    from transformers import DeepseekV3Config

    d = tmp_path_factory.mktemp("kimi-k2")
    DeepseekV3Config(hidden_size=7168, vocab_size=163840, num_hidden_layers=61, num_attention_heads=64,
                     num_key_value_heads=64, v_head_dim=128, intermediate_size=18432,
                     architectures=["DeepseekV3ForCausalLM"]).save_pretrained(d)
    return str(d)


def _aq_medai_parent(root: Path, **changes) -> Path:
    layout = aq_medai_state("real")
    layout.update(changes)
    sparse_safetensors(root / "model.safetensors", layout)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **{
        k: KIMI_K2[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "draft_vocab_size", "rope_theta", "rms_norm_eps",
                                "max_position_embeddings")},
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": KIMI_K2["aux_layer_ids"]}}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def _real_vocab():
    n, v = KIMI_K2["draft_vocab_size"], KIMI_K2["vocab_size"]
    ids = torch.arange(n) * (v // n)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(n), "t2d": t2d}


MANIFEST = {"hidden_size": 7168, "vocab_size": 163840, "aux_layer_ids": [2, 30, 58]}


def _check(kimi_verifier, parent: Path, policy="parent", manifest=MANIFEST):
    files = find_checkpoint(parent)
    layer = layer_config(kimi_verifier, files.config)
    return preflight(verifier=kimi_verifier, layer=layer, manifest=manifest, vocab=_real_vocab(),
                     parent_files=files, vocab_policy=policy)


def test_the_real_aq_medai_shape_is_checked_in_seconds_from_headers_only(kimi_verifier, tmp_path):
    parent = _aq_medai_parent(tmp_path / "aq")
    assert (parent / "model.safetensors").stat().st_size > 2.3e9  # the real size, but a hole on disk
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    took = _check(kimi_verifier, parent)
    wall = time.perf_counter() - t0
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    print(f"preflight at the AQ-MedAI shape: {took['seconds']:.2f} s ({wall:.2f} s with the layer config), peak "
          f"memory +{grew / 1e6:.0f} MB")
    # the drafter on the meta device and the parent's headers: building it for real would take 10 GB (fp32) and
    # tens of seconds here; loading the parent's 2.38 GB would raise the peak by as much
    assert took["seconds"] < 10 and grew < 1e9
    _check(kimi_verifier, parent, policy="rebuild")


def test_a_parent_with_another_head_dim_is_refused_naming_the_key_the_shapes_and_the_fix(kimi_verifier, tmp_path):
    # the shapes a drafter with head_dim 112 (hidden / heads) would have, under a config.json that says 128
    bad = _aq_medai_parent(tmp_path / "aq112", **{
        "midlayer.self_attn.q_proj.weight": ((64 * 112, 2 * 7168), torch.bfloat16),
        "midlayer.self_attn.o_proj.weight": ((7168, 64 * 112), torch.bfloat16)})
    with pytest.raises(CheckpointError) as e:
        _check(kimi_verifier, bad)
    msg = str(e.value)
    assert "midlayer.self_attn.q_proj.weight: parent [7168, 14336], model [8192, 14336]" in msg
    assert "midlayer.self_attn.o_proj.weight: parent [7168, 7168], model [7168, 8192]" in msg
    assert "Choose a parent made for this verifier" in msg


def test_rebuild_refuses_a_head_of_another_width_and_data_of_other_aux_layers(kimi_verifier, tmp_path):
    bad = _aq_medai_parent(tmp_path / "narrow", **{"lm_head.weight": ((32000, 4096), torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"lm_head.weight: parent \[32000, 4096\], model \[\*, 7168\]"):
        _check(kimi_verifier, bad, policy="rebuild")
    with pytest.raises(DataError, match=r"aux layers \[1, 30, 58\] but the drafter reads \[2, 30, 58\]"):
        _check(kimi_verifier, _aq_medai_parent(tmp_path / "ok"), manifest={**MANIFEST, "aux_layer_ids": [1, 30, 58]})


def test_finetune_refuses_a_mis_shaped_parent_before_any_rank_starts(workspace, prepared, tiny, tmp_path):
    bad = tmp_path / "bad-parent"
    bad.mkdir()
    state = load_file(str(tiny["parent"] / "model.safetensors"))
    state["midlayer.mlp.up_proj.weight"] = torch.zeros(300, 128, dtype=torch.bfloat16)
    save_file(state, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((tiny["parent"] / "config.json").read_text())
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", str(bad), "--gpus", "2"],
                           catch_exceptions=False)
    took = time.perf_counter() - t0
    print(f"mis-shaped parent refused in {took:.1f} s")
    assert r.exit_code == 2, r.output  # the parent is the user's choice: a usage error
    assert "midlayer.mlp.up_proj.weight: parent [300, 128], model [256, 128]" in r.output
    assert "Traceback" not in r.output
    assert not list((workspace / "work").glob("*/worker_spec.json"))  # no rank was launched (timings: a benchmark)



def test_a_parent_made_for_a_verifier_of_another_hidden_size_is_one_line_exit_2_and_no_run(workspace, prepared,
                                                                                         tmp_path):
    # AQ-MedAI's Kimi-K2 drafter (hidden 7168, sparse on disk) as the parent of a drafter for the tiny verifier
    parent = _aq_medai_parent(tmp_path / "aq")
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", str(parent), "--gpus", "1"],
                           catch_exceptions=False)
    assert r.exit_code == 2, r.output
    error = [line for line in r.output.splitlines() if line.startswith("error")]
    assert len(error) == 1 and "hidden size 7168" in error[0] and "hidden size 128" in error[0], r.output
    assert "choose a parent made for this verifier" in error[0]
    assert "Traceback" not in r.output
    assert _runs(workspace) == 0


def _runs(workspace: Path) -> int:
    from mlflow import MlflowClient

    client = MlflowClient()
    return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))


ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("change,said", [
    (lambda c: c.pop("train_micro_batch_size_per_gpu"),
     "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
    (lambda c: c.update(train_micro_batch_size_per_gpu="four"),
     "'>' not supported between instances of 'str' and 'int' (TypeError in DeepSpeed's _batch_assertion)"),
    (lambda c: c["zero_optimization"].update(reduce_bucket_size="big"),
     "zero_optimization.reduce_bucket_size: Input should be a valid integer, unable to parse string as an integer, "
     "got 'big'"),
    (lambda c: c["zero_optimization"].update(overlap_com=False),
     "zero_optimization.overlap_com: Extra inputs are not permitted"),
], ids=["no-micro-batch", "micro-batch-a-string", "zero-key-of-a-wrong-type", "unknown-zero-key"])
def test_a_ds_config_deepspeed_refuses_is_refused_in_one_line_before_the_run_exists(workspace, prepared, tmp_path,
                                                                                    change, said):
    """DeepSpeed's own config class judges the resolved config in the launching process: before this, such a
    config passed, failed ~27 s later inside every rank with a 22-line traceback and left a FAILED run."""
    import mlflow

    conf = json.loads((ROOT / "configs" / "zero2.json").read_text())
    change(conf)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(conf))
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", "random", "--precision", "fp32",
                                 "--steps", "2", "--ds-config", str(path)])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: DeepSpeed config {path}: {said}; fix it (configs/zero2.json is "
                                             "a config DeepSpeed accepts), or leave out --ds-config"]
    client = mlflow.MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])  # no run, FAILED or other
    assert not (workspace / "work").exists() or not list((workspace / "work").glob("*/worker_spec.json"))


def test_whose_layers_a_parents_ids_name_is_known_or_asked_and_the_data_must_hold_those(workspace, prepared, tiny,
                                                                                         tmp_path):
    """A parent whose config does not say its ids' convention is refused until told; told sglang (the output of
    layer i), the data must hold the inputs of the next layers, as vLLM captures them; an id moved past the
    verifier's last layer is refused. Each in one line, before any run."""
    unmarked = tmp_path / "unmarked"
    unmarked.mkdir()
    (unmarked / "model.safetensors").symlink_to(tiny["parent"] / "model.safetensors")
    config = json.loads((tiny["parent"] / "config.json").read_text())
    config.pop("aux_layer_convention")
    (unmarked / "config.json").write_text(json.dumps(config))
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]

    def finetune(*extra):
        return CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", str(unmarked), "--gpus", "1",
                                        *extra], catch_exceptions=False)

    asked = finetune()
    assert asked.exit_code == 2 and "do not say whose layers they name" in asked.output, asked.output
    assert "pass --parent-aux-convention vllm or sglang" in asked.output
    shifted = finetune("--parent-aux-convention", "sglang")
    moved = [i + 1 for i in ids]
    assert shifted.exit_code == 1, shifted.output
    assert f"reads {moved}: prepare the data with --aux-layers {','.join(map(str, moved))}" in shifted.output
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [*ids[:-1], 8]  # the tiny verifier's 8 layers
    (unmarked / "config.json").write_text(json.dumps(config))
    past = finetune("--parent-aux-convention", "sglang")
    assert past.exit_code == 2 and "past the verifier's 8" in past.output, past.output
    assert "Traceback" not in asked.output + shifted.output + past.output
    assert _runs(workspace) == 0
