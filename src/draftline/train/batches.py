"""Token-budget batches over samples, deterministic in the seed and shardable across ranks."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence


def batch_plan(lengths: Sequence[int], tokens_per_batch: int, *, seed: int, epoch: int) -> list[list[int]]:
    """Shuffle sample indices (seed + epoch) and group them greedily up to ``tokens_per_batch`` tokens.
    A sample longer than the budget forms a batch of its own."""
    order = list(range(len(lengths)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    plan, cur, used = [], [], 0
    for i in order:
        if cur and used + lengths[i] > tokens_per_batch:
            plan.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        plan.append(cur)
    return plan


def batches(records: Sequence[dict], tokens_per_batch: int, *, seed: int = 0, rank: int = 0,
            world_size: int = 1, start_step: int = 0) -> Iterator[list[dict]]:
    """Endless stream of this rank's batches; global step ``s`` uses plan entry ``s * world_size + rank``."""
    lengths = [int(r["input_ids"].numel()) for r in records]
    epoch, plans = 0, {}
    step = start_step
    while True:
        idx = step * world_size + rank
        # find the epoch holding global batch idx
        epoch, offset = 0, idx
        while True:
            if epoch not in plans:
                plans[epoch] = batch_plan(lengths, tokens_per_batch, seed=seed, epoch=epoch)
            if offset < len(plans[epoch]):
                break
            offset -= len(plans[epoch])
            epoch += 1
        yield [records[i] for i in plans[epoch][offset]]
        step += 1
