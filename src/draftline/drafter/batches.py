"""Token-budget batches over samples, deterministic in the seed and shardable across ranks."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Iterator, Sequence


def batch_plan(lengths: Sequence[int], tokens_per_batch: int, *, seed: int, epoch: int) -> list[list[int]]:
    """Shuffle sample indices (seed + epoch) and group them greedily up to ``tokens_per_batch`` tokens.
    A sample longer than the budget forms a batch of its own."""
    order = list(range(len(lengths)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    plan: list[list[int]] = []
    cur: list[int] = []
    used = 0
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
    """Endless stream of this rank's batches; global step ``s`` uses batch ``s * world_size + rank`` of the
    concatenated epoch plans, so a run resumed at ``start_step`` sees exactly the batches it would have seen."""
    lengths = [int(r["input_ids"].numel()) for r in records]
    plans: list[list[list[int]]] = []
    step = start_step
    while True:
        idx, epoch = step * world_size + rank, 0
        while True:
            if epoch == len(plans):
                plans.append(batch_plan(lengths, tokens_per_batch, seed=seed, epoch=epoch))
            if idx < len(plans[epoch]):
                break
            idx -= len(plans[epoch])
            epoch += 1
        yield [records[i] for i in plans[epoch][idx]]
        step += 1


def micro_batches(samples: Sequence[dict], tokens: int) -> list[list[dict]]:
    """A step's samples in order, grouped greedily into micro-batches of at most ``tokens`` tokens (whole
    samples; a longer sample is a micro-batch of its own)."""
    groups: list[list[dict]] = []
    used = 0
    for sample in samples:
        n = int(sample["input_ids"].numel())
        if not groups or used + n > tokens:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += n
    return groups


def prefetch(items: Iterator, depth: int = 2) -> Iterator:
    """Yield ``items`` produced on a background thread, up to ``depth`` ahead, so reading the memory-mapped
    shards and packing the next batch overlap the current step (torch releases the GIL while copying)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    end = object()

    def produce():
        try:
            for item in items:
                q.put(item)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, raised there)
            q.put(e)
        q.put(end)

    threading.Thread(target=produce, name="draftline-prefetch", daemon=True).start()
    while (item := q.get()) is not end:
        if isinstance(item, BaseException):
            raise item
        yield item
