"""Token-budget batches over samples, deterministic in the seed and shardable across ranks."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Iterator, Mapping, Sequence


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


def _planned(plans: list[list[list[int]]], lengths: Sequence[int], tokens_per_batch: int, seed: int,
             idx: int) -> list[int]:
    """Sample indices of batch ``idx`` of the concatenated epoch plans (extended as far as needed)."""
    epoch = 0
    while True:
        if epoch == len(plans):
            plans.append(batch_plan(lengths, tokens_per_batch, seed=seed, epoch=epoch))
        if idx < len(plans[epoch]):
            return plans[epoch][idx]
        idx -= len(plans[epoch])
        epoch += 1


def batches(records: Sequence[Mapping], tokens_per_batch: int, *, seed: int = 0, rank: int = 0,
            world_size: int = 1, start_step: int = 0) -> Iterator[list[Mapping]]:
    """Endless stream of this rank's batches; global step ``s`` uses batch ``s * world_size + rank`` of the
    concatenated epoch plans, so a run resumed at ``start_step`` sees exactly the batches it would have seen."""
    lengths = [int(r["input_ids"].numel()) for r in records]
    plans: list[list[list[int]]] = []
    step = start_step
    while True:
        yield [records[i] for i in _planned(plans, lengths, tokens_per_batch, seed, step * world_size + rank)]
        step += 1


def micro_steps(records: Sequence[Mapping], tokens_per_batch: int, micro_batch_tokens: int, *, seed: int = 0,
                rank: int = 0, world_size: int = 1, start_step: int = 0) -> Iterator[list[list[Mapping]]]:
    """:func:`batches`, each step split into micro-batches (:func:`split_even`): as many as the rank whose
    batch splits into the fewest needs (``micro_batch_tokens`` each at most, one sample each at least), the
    same number on every rank, since ZeRO-2 reduces the gradients of every micro-batch together. Each rank
    reads every rank's plan, so no rank asks another."""
    lengths = [int(r["input_ids"].numel()) for r in records]
    plans: list[list[list[int]]] = []
    step = start_step
    while True:
        every = [_planned(plans, lengths, tokens_per_batch, seed, step * world_size + r) for r in range(world_size)]
        count = min(min(len(b), -(-sum(lengths[i] for i in b) // micro_batch_tokens)) for b in every)
        yield split_even([records[i] for i in every[rank]], max(1, count))
        step += 1


def split_even(samples: Sequence[Mapping], parts: int) -> list[list[Mapping]]:
    """``samples`` in order, cut into exactly ``parts`` groups (``parts`` <= len(samples)) of about equal
    tokens."""
    lengths = [int(s["input_ids"].numel()) for s in samples]
    total, groups, current, used = sum(lengths), list[list[Mapping]](), list[Mapping](), 0
    for i, sample in enumerate(samples):
        current.append(sample)
        used += lengths[i]
        cuts_left = parts - len(groups) - 1
        if cuts_left > 0 and (used >= total * (len(groups) + 1) / parts or len(samples) - i - 1 == cuts_left):
            groups.append(current)
            current = []
    groups.append(current)
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
