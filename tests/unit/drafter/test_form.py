"""EAGLE 3.1 (``fc_norm``, ``norm_output``): decided once, from a parent's config and tensors or the run's
settings; built, trained and written as vLLM and SGLang read it, for the Llama layer and the MLA one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftline.drafter.form import EagleForm, check_tensors, choose, split, with_form
from draftline.drafter.loading import load_drafter
from draftline.drafter.model import build_draft_model
from draftline.drafter.served import save_served
from draftline.drafter.shape import layer_config, load_config, specforge_config
from draftline.drafter.vocab import build_vocab
from draftline.errors import CheckpointError, ParentMismatch
from draftline.serving import hf_model

V31 = EagleForm(fc_norm=True, norm_output=True)
NORMS = [f"fc_norm.{i}.weight" for i in range(3)]


def test_names_and_the_form_a_layer_carries():
    assert (EagleForm().name, V31.name, EagleForm(fc_norm=True).name) == ("3.0", "3.1", "3.0+fc_norm")
    layer = with_form({"model_type": "llama"}, V31)
    assert split(layer) == ({"model_type": "llama"}, V31)
    assert split({"model_type": "llama"})[1] == EagleForm()  # a hand-off from before 3.1: 3.0
    assert EagleForm.of_config({"fc_norm": True, "norm_output": True}) == V31


def test_the_parents_form_is_the_runs_and_its_tensors_must_agree_with_its_config():
    assert choose(fc_norm=None, norm_output=None, parent=None, parent_config=None) == EagleForm()
    assert choose(fc_norm=True, norm_output=True, parent=None, parent_config=None) == V31
    three_one = {"fc_norm": True, "norm_output": True}
    assert choose(fc_norm=None, norm_output=None, parent="p", parent_config=three_one, parent_keys=NORMS) == V31
    # lightseek's config may not say: the tensors do
    assert choose(fc_norm=None, norm_output=True, parent="p", parent_config={"norm_output": True},
                  parent_keys=NORMS).fc_norm

    with pytest.raises(ParentMismatch, match=r"parent p is EAGLE 3.1 \(fc_norm true, norm_output true\); "
                                             r"--fc-norm false would train its weights in another form"):
        choose(fc_norm=False, norm_output=None, parent="p", parent_config=three_one, parent_keys=NORMS)
    with pytest.raises(ParentMismatch, match="parent p is EAGLE 3.0 .*--fc-norm true and --norm-output true"):
        choose(fc_norm=True, norm_output=True, parent="p", parent_config={}, parent_keys=[])
    with pytest.raises(CheckpointError, match="says fc_norm .* holds 2 fc_norm.\\*.weight tensors for 3 aux"):
        choose(fc_norm=None, norm_output=None, parent="p", parent_config=three_one, parent_keys=NORMS[:2])
    with pytest.raises(CheckpointError, match="holds 3 fc_norm.*does not say fc_norm: true"):
        check_tensors("drafter d", EagleForm(), NORMS, 3)
    assert ParentMismatch.exit_code == 2


def _drafter(verifier, form: EagleForm, layer=None):
    size = json.loads((verifier / "config.json").read_text())["vocab_size"]
    d2t, t2d = build_vocab(torch.arange(size, 0, -1), 64)
    return build_draft_model(str(verifier), d2t=d2t, t2d=t2d, aux_layer_ids=[1, 2, 3], dtype=torch.float32,
                             draft_vocab_size=64, layer=with_form(layer or layer_config(str(verifier)), form))


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_a_31_drafter_is_built_written_and_read_back_as_vllm_reads_it(family, tiny, kimi, tmp_path, monkeypatch):
    verifier = tiny["verifier"] if family == "llama" else kimi["verifier"]
    monkeypatch.setenv("DRAFTLINE_TRUST_REMOTE_CODE", "")  # restored after the test
    hf_model.allow_custom_code(kimi["verifier"])  # the Kimi miniature ships its code, as Kimi-K2.5 does
    layer = layer_config(str(verifier), None, family)
    model = _drafter(verifier, V31, layer)
    assert (model.config.fc_norm, model.config.norm_output) == (True, True)
    with torch.no_grad():
        for i, norm in enumerate(model.fc_norm):
            norm.weight.fill_(1.0 + i)  # trained norms: not the ones vLLM would use in their absence
    out = save_served(model, tmp_path / "export", str(verifier))
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)  # top level, where vLLM reads them
    state = load_file(str(out / "model.safetensors"))
    assert all(state[k].eq(1.0 + i).all() for i, k in enumerate(NORMS))
    assert EagleForm.of_config(config) == V31 and load_config(out).fc_norm

    back = load_drafter(verifier, out, aux_layer_ids=[1, 2, 3])
    assert (back.config.fc_norm, back.config.norm_output) == (True, True)
    assert all(torch.equal(a, b) for a, b in zip(model.fc_norm.state_dict().values(),
                                                 back.fc_norm.state_dict().values(), strict=True))


def test_a_30_export_says_30_explicitly_and_specforges_form_says_norm_output(tiny, tmp_path):
    """SpecForge reads an absent norm_output as true: every form writes both switches."""
    model = _drafter(tiny["verifier"], EagleForm())
    assert model.fc_norm is None
    config = json.loads((save_served(model, tmp_path / "e", str(tiny["verifier"])) / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (False, False)
    sf = specforge_config(model.config.transformer_layer_config, draft_vocab_size=64, aux_layer_ids=[1, 2, 3],
                          form=V31)
    assert (sf["fc_norm"], sf["norm_output"], sf["norm_before_residual"]) == (True, True, False)


def test_training_moves_the_norms_and_31_feeds_the_next_step_the_post_norm_state(tiny):
    """speculators' TTT loop: the same batch, 3.0 and 3.1, from the same weights, gives different losses (the
    later steps are fed another state), and a step's gradient reaches every fc_norm."""
    torch.manual_seed(0)
    a = _drafter(tiny["verifier"], EagleForm(fc_norm=True, norm_output=False))
    b = _drafter(tiny["verifier"], V31)
    b.load_state_dict(a.state_dict())
    hidden = a.fc.in_features
    n = 24
    batch = {"input_ids": torch.randint(0, 200, (1, n)), "hidden_states": torch.randn(1, n, hidden),
             "verifier_last_hidden_states": torch.randn(1, n, hidden // 3), "loss_mask": torch.ones(1, n),
             "document_ids": torch.zeros(1, n, dtype=torch.long), "position_ids": torch.arange(n)[None]}
    from draftline.drafter.model import forward

    la, _ = forward(a, dict(batch), ttt_steps=3)
    lb, _ = forward(b, dict(batch), ttt_steps=3)
    assert not torch.isclose(la, lb)
    lb.backward()
    assert all(norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0 for norm in b.fc_norm)


def test_pull_refuses_a_31_directory_whose_norms_vllm_would_leave_at_ones(tiny, tmp_path):
    """vLLM loads ``fc_norm: true`` without its ``fc_norm.*`` tensors in silence; ``pull`` (here
    ``--verify-only``, the same check) reads the safetensors headers without torch and refuses it."""
    from click.testing import CliRunner
    from safetensors.torch import save_file

    from draftline.cli import cli
    from draftline.drafter.servable import require_servable, tensor_names
    from draftline.export.upload import CHECKSUMS, sha256_manifest

    out = save_served(_drafter(tiny["verifier"], V31), tmp_path / "export", str(tiny["verifier"]))
    (out / CHECKSUMS).write_text(json.dumps(sha256_manifest(out)))
    state = load_file(str(out / "model.safetensors"))
    assert sorted(tensor_names(out)) == sorted(state) and set(NORMS) <= set(state)
    require_servable(out)  # whole: served as trained
    assert CliRunner().invoke(cli, ["pull", "--verify-only", str(out)]).exit_code == 0

    del state[NORMS[2]]
    save_file(state, str(out / "model.safetensors"))
    (out / CHECKSUMS).write_text(json.dumps(sha256_manifest(out)))  # every file as its manifest says: only the
    r = CliRunner().invoke(cli, ["pull", "--verify-only", str(out)])  # form is wrong
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: its config says fc_norm (EAGLE 3.1) but it holds 2 fc_norm.*.weight "
                           "tensors for 3 aux layers"), line
    assert line.endswith("re-export it with this draftline (draftline export --run <its finetune run>)"), line
