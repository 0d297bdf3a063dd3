"""vocab=rebuild: lm_head rows follow their tokens into the new draft vocabulary."""

import pytest
import torch

from draftline.data.shards import open_prepared
from draftline.drafter.checkpoints import find_checkpoint, load_into_model, read_tensors
from draftline.drafter.model import build_draft_model, pack
from draftline.drafter.vocab import build_vocab, draft_to_target_ids, plan_remap, remap_lm_head, verifier_head


def _logits(model, batch):
    seen = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "verifier_last_hidden_states"}, ttt_steps=1)
    handle.remove()
    return seen[0][0].float()  # [T, draft_vocab]


def test_remap_keeps_predictions_on_shared_tokens_and_naive_load_does_worse(tiny, prepared):

    files = find_checkpoint(tiny["parent"])
    old = read_tensors(files, {"d2t", "t2d"})
    data = open_prepared(prepared)
    # a vocabulary rebuilt from other data: shift the counts so the top-256 set changes
    freqs = data.token_freqs().clone()
    freqs[draft_to_target_ids(old["d2t"])[::3]] = 0
    new_d2t, new_t2d = build_vocab(freqs, 256)
    plan = plan_remap(old["d2t"], new_d2t)
    assert plan.kept > 100 and plan.added > 20 and plan.added == plan.dropped

    def model_with(d2t, t2d, remap):
        m = build_draft_model(str(tiny["verifier"]), d2t=d2t, t2d=t2d, aux_layer_ids=[2, 4, 5], draft_vocab_size=256)
        load_into_model(m, files, lm_head_remap=remap)
        return m.eval()

    parent = model_with(old["d2t"], old["t2d"], None)
    full_head = verifier_head(str(tiny["verifier"]))
    remapped = model_with(new_d2t, new_t2d, lambda w: remap_lm_head(w, plan, new_d2t, full_head))
    naive = model_with(new_d2t, new_t2d, lambda w: w)  # the bug: the parent's rows under the new d2t

    batch = pack(data.records()[:8])
    keep = plan.new_rows_from_old >= 0
    new_rows, old_rows = torch.nonzero(keep).squeeze(1), plan.new_rows_from_old[keep]
    p = _logits(parent, batch)[:, old_rows]
    r = _logits(remapped, batch)[:, new_rows]
    n = _logits(naive, batch)[:, new_rows]
    assert torch.equal(p, r)  # bit-identical on every token both vocabularies hold
    agree_remapped = (p.argmax(-1) == r.argmax(-1)).float().mean().item()
    agree_naive = (p.argmax(-1) == n.argmax(-1)).float().mean().item()
    assert agree_remapped == 1.0
    assert agree_naive < 0.9, agree_naive  # measured 0.73: a quarter of the predictions change
    # new tokens start from the verifier's own lm_head row for them
    added = torch.nonzero(~keep).squeeze(1)
    target_ids = draft_to_target_ids(new_d2t)[added]
    assert torch.equal(remapped.lm_head.weight[added], full_head[target_ids].to(torch.bfloat16))


def test_build_vocab_is_speculators_top_n_with_id_ties():
    freqs = torch.tensor([0, 5, 5, 1, 9, 0])
    d2t, t2d = build_vocab(freqs, 3)
    assert draft_to_target_ids(d2t).tolist() == [1, 2, 4]
    assert t2d.tolist() == [False, True, True, False, True, False]


def test_plan_counts():
    old = torch.tensor([0, 0, 0])          # tokens 0, 1, 2
    new = torch.tensor([1, 1, 2])          # tokens 1, 2, 4
    plan = plan_remap(old, new)
    assert plan.new_rows_from_old.tolist() == [1, 2, -1]
    assert (plan.kept, plan.added, plan.dropped) == (2, 1, 1)


@pytest.mark.parametrize("bad", ["dtype", "length"])
def test_parent_d2t_of_wrong_dtype_or_length_is_refused(tiny, prepared, tmp_path, bad):
    import shutil

    from safetensors.torch import load_file, save_file

    from draftline.config import FinetuneConfig
    from draftline.errors import CheckpointError
    from draftline.train.finetune import choose_vocab

    p = tmp_path / "p"
    shutil.copytree(tiny["parent"], p)
    state = load_file(str(p / "model.safetensors"))
    state["d2t"] = state["d2t"].to(torch.int32) if bad == "dtype" else state["d2t"][:200]
    save_file(state, str(p / "model.safetensors"))
    cfg = FinetuneConfig(data=str(prepared), init=str(p))
    with pytest.raises(CheckpointError, match="int64/bool" if bad == "dtype" else "d2t has 200 rows"):
        choose_vocab(cfg, find_checkpoint(p), open_prepared(prepared), 518)


def test_the_output_head_of_a_verifier_with_tied_embeddings_is_its_embedding_matrix(tiny, tmp_path):
    """SmolLM2, Llama-3.2, Qwen2.5 and Gemma tie lm_head to the embeddings: their checkpoints hold no
    lm_head.weight, and vocab=rebuild must start new draft rows from the embedding rows instead."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftline.drafter.vocab import verifier_head

    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=300,
                                        tie_word_embeddings=True))
    tied.save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    head = verifier_head(str(tmp_path / "tied"))
    assert torch.equal(head, tied.model.embed_tokens.weight.detach())
    untied = verifier_head(str(tiny["verifier"]))  # an untied verifier: its own lm_head
    with safe_open(str(tiny["verifier"] / "model.safetensors"), "pt") as f:
        assert torch.equal(untied, f.get_tensor("lm_head.weight"))
