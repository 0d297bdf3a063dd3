"""A step split into micro-batches, each loss weighted by its share of the trained tokens, has the gradient of
the whole packed step (the split only shortens the packed attention)."""

import torch

from draftline.data.shards import open_prepared
from draftline.drafter.batches import micro_batches
from draftline.drafter.model import build_draft_model, forward, loss_config, pack, trainable_parameters, trained_shares
from tests.unit.test_pairing import build_vocab_for


def test_micro_batches_are_whole_samples_in_order_within_the_budget():
    samples = [{"input_ids": torch.zeros(n)} for n in (100, 100, 60, 300, 20, 20)]
    groups = micro_batches(samples, 256)
    assert [[int(s["input_ids"].numel()) for s in g] for g in groups] == [[100, 100], [60], [300], [20, 20]]
    assert [s for g in groups for s in g] == samples


def test_weighted_micro_batches_give_the_whole_steps_gradient(tiny, prepared):
    data = open_prepared(prepared)
    records = data.records()[:12]
    assert all(not bool(r["loss_mask"][:3].any()) for r in records)  # chat samples: prompt tokens first
    d2t, t2d = build_vocab_for(data)
    torch.manual_seed(0)
    model = build_draft_model(str(tiny["verifier"]), d2t=d2t, t2d=t2d, aux_layer_ids=data.manifest["aux_layer_ids"],
                              draft_vocab_size=256, dtype=torch.float32)
    params = trainable_parameters(model)
    cfg = loss_config()

    def gradient(groups):
        for p in params:
            p.grad = None
        packs = [{k: v.float() if v.is_floating_point() else v for k, v in pack(g).items()} for g in groups]
        for share, batch in zip(trained_shares(packs), packs, strict=True):
            (forward(model, batch, 3, cfg)[0] * share).backward()
        return torch.cat([p.grad.flatten() for p in params])

    whole = gradient([records])
    groups = micro_batches(records, 200)
    assert len(groups) >= 4
    split = gradient(groups)
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-7)
