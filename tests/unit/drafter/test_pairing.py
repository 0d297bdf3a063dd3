"""The pairing vLLM serves: the verifier's hidden state at t goes with the token at t+1 (speculators' shift_batch).

vLLM's EAGLE proposer shifts the input ids by one and drafts the token at t+2; speculators and SpecForge train
that way. A drafter trained on unshifted samples learns an easier task and serves poorly.
"""

import torch
from speculators.models.eagle3 import shift_batch

from draftline.data.shards import open_prepared
from draftline.drafter.model import (
    accumulate,
    build_draft_model,
    forward,
    loss_config,
    pack,
    summarise,
    train_steps_in_process,
)


def _sample(n: int, seed: int, hidden: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (n,), generator=g),
            "loss_mask": torch.rand(n, generator=g) > 0.3,
            "hidden_states": torch.randn(n, 3 * hidden, generator=g),
            "verifier_last_hidden_states": torch.randn(n, hidden, generator=g)}


def test_each_packed_sample_is_speculators_shift_batch_of_it():
    samples = [_sample(n, seed) for seed, n in enumerate((7, 12, 5))]
    batch = pack(samples)
    start = 0
    for i, s in enumerate(samples):
        n = s["input_ids"].numel()
        ref = shift_batch({**s, "lengths": torch.tensor([n]), "position_ids": torch.arange(n)})
        piece = slice(start, start + n - 1)
        for key in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states", "position_ids"):
            assert torch.equal(batch[key][0, piece], ref[key]), key
        assert (batch["document_ids"][0, piece] == i).all()
        # the pairing itself: hidden state at t with the token (and the verifier's last state) at t+1
        assert torch.equal(batch["hidden_states"][0, piece], s["hidden_states"][:-1])
        assert torch.equal(batch["input_ids"][0, piece], s["input_ids"][1:])
        assert torch.equal(batch["verifier_last_hidden_states"][0, piece], s["verifier_last_hidden_states"][1:])
        assert batch["position_ids"][0, start].item() == 1  # positions from 1, as speculators sets them
        start += n - 1
    assert batch["input_ids"].shape == (1, start)


def _unshifted(records):
    """The pairing draftline trained in before the fix: (x_t, g_t, y_t) as captured."""
    cat = lambda key: torch.cat([r[key] for r in records]).unsqueeze(0)  # noqa: E731
    lengths = torch.tensor([r["input_ids"].numel() for r in records])
    return {"input_ids": cat("input_ids"), "loss_mask": cat("loss_mask"), "hidden_states": cat("hidden_states"),
            "verifier_last_hidden_states": cat("verifier_last_hidden_states"),
            "position_ids": torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0),
            "document_ids": torch.repeat_interleave(torch.arange(len(lengths)), lengths).unsqueeze(0)}


def _shifted(records):
    """vLLM's pairing, built here from speculators' shift_batch directly (not through draftline's pack)."""
    out = [shift_batch({**r, "lengths": torch.tensor([r["input_ids"].numel()]),
                        "position_ids": torch.arange(r["input_ids"].numel())}) for r in records]
    lengths = torch.cat([o["lengths"] for o in out])
    batch = {k: torch.cat([o[k] for o in out]).unsqueeze(0) for k in
             ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states", "position_ids")}
    batch["document_ids"] = torch.repeat_interleave(torch.arange(len(lengths)), lengths).unsqueeze(0)
    return batch


@torch.no_grad()
def _acceptance(model, records, make_batch) -> float:
    sums: dict[str, float] = {}
    cfg = loss_config()
    for i in range(0, len(records), 8):
        batch = make_batch(records[i:i + 8])
        for key in ("hidden_states", "verifier_last_hidden_states"):
            batch[key] = batch[key].to(torch.float32)
        accumulate(sums, forward(model, batch, 3, cfg)[1])
    return summarise(sums, 3)["acceptance_length"]


def test_a_drafter_trained_by_draftline_scores_higher_in_vllms_pairing(tiny, prepared):
    """Trained on the tiny verifier's data, measured on held-out samples in both pairings: the drafter must be
    better in the pairing vLLM serves. Before the fix it was the other way round (measured, teacher-forced
    acceptance length: 1.10 in vLLM's pairing vs 1.29 unshifted for the old trainer; after it, 1.20 vs 1.01)."""
    data = open_prepared(prepared)
    records = data.records()
    train, held_out = [r for i, r in enumerate(records) if i % 4], [r for i, r in enumerate(records) if not i % 4]
    d2t, t2d = build_vocab_for(data)
    torch.manual_seed(0)
    model = build_draft_model(str(tiny["verifier"]), d2t=d2t, t2d=t2d, aux_layer_ids=data.manifest["aux_layer_ids"],
                              draft_vocab_size=256, dtype=torch.float32)
    train_steps_in_process(model, train, steps=60, lr=3e-3, tokens_per_batch=512)
    served, unshifted = _acceptance(model, held_out, _shifted), _acceptance(model, held_out, _unshifted)
    assert served > unshifted + 0.05, (served, unshifted)


def build_vocab_for(data):
    from draftline.drafter.vocab import build_vocab

    return build_vocab(data.token_freqs(), 256)


def test_validation_on_fewer_chunks_than_ranks_gives_every_rank_the_same_metrics(tiny, prepared):
    """A validation set of one chunk on two ranks: rank 1 only runs the surplus forward. Its sums must carry the
    same keys (zeros) as rank 0's, or the ranks all-reduce tensors of different lengths and hang (found by
    demo_real.sh: a parent finetune with 3 held-out samples stopped at step 0)."""
    from draftline.drafter.model import metric_sums

    data = open_prepared(prepared)
    one_chunk = data.records()[:2]
    d2t, t2d = build_vocab_for(data)
    model = build_draft_model(str(tiny["verifier"]), d2t=d2t, t2d=t2d, aux_layer_ids=data.manifest["aux_layer_ids"],
                              draft_vocab_size=256, dtype=torch.float32)
    kw = dict(ttt_steps=3, tokens_per_batch=100_000, dtype=torch.float32, world=2)
    rank0, rank1 = metric_sums(model, one_chunk, rank=0, **kw), metric_sums(model, one_chunk, rank=1, **kw)
    assert sorted(rank0) == sorted(rank1) and rank0
    assert all(v == 0 for v in rank1.values())  # nothing counted twice
    alone = metric_sums(model, one_chunk, rank=0, **{**kw, "world": 1})
    assert {k: rank0[k] + rank1[k] for k in rank0} == alone
