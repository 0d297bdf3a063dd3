"""The kinds of drafter layer live in one registry (drafter/layer_kinds.py): each kind answers for itself, and no
other module decides by comparing a kind's name."""

import re
from pathlib import Path

import pytest

from draftline import kinds
from draftline.drafter import layer_kinds
from draftline.drafter.form import EagleForm
from draftline.errors import ConfigError

SRC = Path(__file__).resolve().parents[3] / "src" / "draftline"


def test_every_kind_vllm_serves_is_registered_once():
    assert set(layer_kinds.LAYERS) == set(kinds.KINDS)
    for name, kind in layer_kinds.LAYERS.items():
        assert kind.served is kinds.KINDS[name]
        assert layer_kinds.named(name) is kind
    with pytest.raises(ConfigError, match="choose one of llama, mla"):
        layer_kinds.named("gqa")


def test_each_kind_tells_its_parents_and_builds_its_reference_in_either_form():
    mla_flat = {"model_type": "kimi_k2", "hidden_size": 64, "kv_lora_rank": 32}
    specforge = {"model_type": "llama", "hidden_size": 64, "draft_vocab_size": 32}
    assert layer_kinds.of_parent(mla_flat) is layer_kinds.MlaLayer
    assert layer_kinds.of_parent(specforge) is layer_kinds.LlamaLayer
    assert layer_kinds.of_parent({"speculators_model_type": "eagle3"}) is None
    assert layer_kinds.of_parent(None) is None
    for kind in layer_kinds.LAYERS.values():
        for form in (EagleForm(), EagleForm(fc_norm=True, norm_output=True)):
            ref = kind.reference
            cfg = kind.drafter_config(ref, draft_vocab_size=ref["draft_vocab_size"], aux_layer_ids=[2, 30, 58],
                                      form=form)
            assert layer_kinds.of_layer(cfg.transformer_layer_config.to_dict()) is kind
            assert (cfg.fc_norm, cfg.norm_output) == (form.fc_norm, form.norm_output)
    # the published MLA drafter drafts the whole vocabulary; AQ-MedAI's Llama one a reduced one
    assert layer_kinds.MlaLayer.whole_vocabulary() and not layer_kinds.LlamaLayer.whole_vocabulary()


def test_no_module_outside_the_registry_decides_by_a_kinds_name():
    found = []
    pattern = re.compile(r"""[=!]= ["'](?:mla|llama)["']|in \(["']llama["'], ["']mla["']\)""")
    for path in SRC.rglob("*.py"):
        if path.name in ("layer_kinds.py", "kinds.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and 'model_type") ==' not in line:
                found.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not found, "ask drafter/layer_kinds.py instead:\n" + "\n".join(found)
