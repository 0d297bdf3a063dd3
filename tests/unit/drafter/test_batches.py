"""Batches: token budget, disjoint across ranks, and a resumed stream equal to the uninterrupted one."""

from itertools import islice

import torch

from draftline.drafter.batches import batch_plan, batches


def _records(n=37):
    return [{"input_ids": torch.zeros(10 + (i * 7) % 50, dtype=torch.long), "i": i} for i in range(n)]


def _ids(stream, k):
    return [[r["i"] for r in b] for b in islice(stream, k)]


def test_budget_ranks_and_resume():
    recs = _records()
    one = _ids(batches(recs, 120, seed=3), 40)  # spans several epochs
    assert all(sum(int(recs[i]["input_ids"].numel()) for i in b) <= 120 or len(b) == 1 for b in one)
    epoch0 = len(batch_plan([int(r["input_ids"].numel()) for r in recs], 120, seed=3, epoch=0))
    assert sorted(i for b in one[:epoch0] for i in b) == list(range(len(recs)))  # an epoch sees every sample once
    r0, r1 = _ids(batches(recs, 120, seed=3, rank=0, world_size=2), 10), \
        _ids(batches(recs, 120, seed=3, rank=1, world_size=2), 10)
    assert [x for pair in zip(r0, r1) for x in pair] == one[:20]  # ranks interleave the global sequence
    assert _ids(batches(recs, 120, seed=3, start_step=13), 5) == one[13:18]  # resume
    assert _ids(batches(recs, 120, seed=4), 5) != one[:5]


def test_prefetch_keeps_order_and_raises_the_producers_error():
    import pytest

    from draftline.drafter.batches import prefetch

    assert list(prefetch(iter(range(10)), depth=2)) == list(range(10))

    def broken():
        yield 1
        raise ValueError("shard 3 is unreadable")

    out = prefetch(broken())
    assert next(out) == 1
    with pytest.raises(ValueError, match="shard 3 is unreadable"):
        next(out)
