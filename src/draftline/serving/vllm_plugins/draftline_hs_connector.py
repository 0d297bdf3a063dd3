"""vLLM's hidden-state connector for hosts with or without an accelerator, loaded by vLLM itself.

vLLM's ``ExampleHiddenStatesConnector`` (used with the ``extract_hidden_states`` speculative method) copies each
finished request's hidden states out of its KV cache on a CUDA stream into pinned memory, then writes them to
``<shared_storage_path>/<request>.safetensors`` (``hidden_states`` [T, layers, H], ``token_ids`` [T]) from a
thread, holding a ``.lock`` file until the write is done. Pinned memory needs an accelerator, so on a CPU the
engine dies at the first request. :class:`CpuSafeHiddenStatesConnector` keeps everything else of vLLM's
connector and, where there is no CUDA device, gathers the slots with vLLM's own ``extract_from_kv_cache`` on the
CPU and hands the writer an already-finished copy.

This file is imported in vLLM's environment, not draftline's: it imports vLLM and torch only. draftline starts
vLLM with ``kv_connector_module_path`` naming it and this folder on ``PYTHONPATH``
(:mod:`draftline.serving.capture_server`).
"""

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Finished:
    """A copy that is already done: what ``torch.cuda.Event`` answers once the device copy finished."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"two hidden-state writes for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Finished()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
