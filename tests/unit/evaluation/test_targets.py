"""evaluate's target: a parent whose aux-layer ids name layer outputs (SpecForge's, TorchSpec's) is measured on the
layers it was trained on, as vLLM counts them; one whose convention nothing tells is refused, as finetune
refuses it."""

import json

import mlflow
import pytest

from draftline.drafter.aux_ids import aux_ids_by_runner
from draftline.errors import ParentMismatch
from draftline.evaluation.targets import resolve_target


def _parent(tmp_path, tiny, ids):
    parent = tmp_path / "sglang-trained"
    parent.mkdir()
    (parent / "model.safetensors").symlink_to(tiny["parent"] / "model.safetensors")
    config = json.loads((tiny["parent"] / "config.json").read_text())
    config.pop("aux_layer_convention")
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (parent / "config.json").write_text(json.dumps(config))
    return parent


def test_a_parent_in_the_sglang_convention_is_served_with_the_ids_vllm_captures_for_its_layers(workspace, tiny,
                                                                                               tmp_path):
    parent = _parent(tmp_path, tiny, [1, 3, 4])
    exp = mlflow.set_experiment("targets").experiment_id
    with pytest.raises(ParentMismatch, match="do not say whose layers they name.*--parent-aux-convention"):
        resolve_target(str(parent), cache=tmp_path / "cache", checkpoint="best", experiment_id=exp,
                       verifier_layers=8)
    target = resolve_target(str(parent), cache=tmp_path / "cache", checkpoint="best", experiment_id=exp,
                            aux_convention="sglang", verifier_layers=8)
    config = json.loads((target.path / "config.json").read_text())
    assert aux_ids_by_runner(config) == {"v1": (2, 4, 5), "v2": (2, 4, 5)}  # both vLLM runners read the moved ids
    assert (target.path / "model.safetensors").resolve() == (tiny["parent"] / "model.safetensors").resolve()
    assert json.loads((parent / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [1, 3, 4]  # the parent itself is left as it is
    same = resolve_target(str(parent), cache=tmp_path / "cache", checkpoint="best", experiment_id=exp,
                          aux_convention="vllm", verifier_layers=8)
    assert same.path == parent and same.sha256 == target.sha256  # the same weights, the same lineage


def test_evaluations_of_one_parent_share_its_moved_copy_and_never_see_a_half_made_one(workspace, tiny, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    parent = _parent(tmp_path, tiny, [1, 3, 4])
    exp = mlflow.set_experiment("targets").experiment_id

    def resolve(_):
        return resolve_target(str(parent), cache=tmp_path / "cache", checkpoint="best", experiment_id=exp,
                              aux_convention="sglang", verifier_layers=8).path

    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(resolve, range(8)))
    assert len(paths) == 1
    (path,) = paths
    assert path.name.endswith("-aux2-4-5") and sorted(f.name for f in path.iterdir()) == ["config.json",
                                                                                           "model.safetensors"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no copy left half-made beside it
    (tmp_path / "other").mkdir()  # the same weights read at other layers: a copy of their own
    moved = _parent(tmp_path / "other", tiny, [0, 2, 3])
    other = resolve_target(str(moved), cache=tmp_path / "cache", checkpoint="best", experiment_id=exp,
                           aux_convention="sglang", verifier_layers=8).path
    assert other != path and aux_ids_by_runner(json.loads((other / "config.json").read_text()))["v1"] == (1, 3, 4)
