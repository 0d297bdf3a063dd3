"""A step split into micro-batches, each loss weighted by its share of the trained tokens, has the gradient of
the whole packed step (the split only shortens the packed attention)."""

import torch

from draftline.data.shards import open_prepared
from draftline.drafter.batches import batches, micro_steps, split_even
from draftline.drafter.model import build_draft_model, forward, loss_config, pack, trainable_parameters, trained_shares
from tests.unit.drafter.test_pairing import build_vocab_for


def test_a_step_is_cut_into_even_whole_sample_groups_in_order():
    samples = [{"input_ids": torch.zeros(n)} for n in (100, 100, 60, 300, 20, 20)]
    for parts in range(1, 7):
        groups = split_even(samples, parts)
        assert len(groups) == parts and all(groups) and [s for g in groups for s in g] == samples
    assert [[int(s["input_ids"].numel()) for s in g] for g in split_even(samples, 3)] == \
        [[100, 100], [60, 300], [20, 20]]


def test_every_rank_cuts_its_step_into_as_many_micro_batches_and_trains_the_same_samples():
    """ZeRO-2 reduces every micro-batch's gradients across the ranks together: a rank with one micro-batch more
    than another hangs them both (seen: gloo 'Received data size doesn't match')."""
    torch.manual_seed(0)
    records = [{"input_ids": torch.zeros(int(n))} for n in torch.randint(20, 400, (200,))]
    for world in (1, 2, 3):
        streams = [micro_steps(records, 1024, 256, seed=3, rank=r, world_size=world, start_step=5)
                   for r in range(world)]
        plain = [batches(records, 1024, seed=3, rank=r, world_size=world, start_step=5) for r in range(world)]
        for _ in range(40):
            steps = [next(s) for s in streams]
            assert len({len(groups) for groups in steps}) == 1
            for groups, whole in zip(steps, (next(p) for p in plain), strict=True):
                assert [s for g in groups for s in g] == whole  # the same samples, in order
                assert all(groups)


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
    groups = split_even(records, 4)
    split = gradient(groups)
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-7)
