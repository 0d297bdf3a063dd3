"""Hidden states from vLLM instead of transformers: the backend for a verifier only vLLM can run.

vLLM serves the verifier with its ``extract_hidden_states`` speculative method and a hidden-state KV connector:
each ``/v1/completions`` request with ``max_tokens=1`` makes the server write the requested layers' hidden
states for the prompt to one safetensors file (``token_ids`` [T], ``hidden_states`` [T, aux + 1, H], the last
entry the final layer's output before the final norm, as the transformers capture records it) and answer
with its path in ``kv_transfer_params``; the file's ``.lock`` is held until the write is done. The client is
speculators' own (``speculators.data_generation.vllm_client``, retries included); this module turns each file
into draftline's record and deletes it. The files are written by the server, so its output directory must be
readable here (a shared file system on a cluster).

``prepare --capture-backend vllm`` starts its own loopback server (:func:`loopback_capture_server`, the
connector of :mod:`draftline.serving.vllm_plugins.draftline_hs_connector`, which also runs on a CPU), or talks to
the one ``--capture-endpoint`` names (started as ``speculators generate-offline-data --help`` documents it,
extracting the aux layers plus the last).
"""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import torch
from safetensors.torch import load_file
from speculators.data_generation.offline import check_hidden_states
from speculators.data_generation.vllm_client import generate_hidden_states_async

from draftline.data.regenerate import served_models
from draftline.data.tokenize import TokenizedSample
from draftline.errors import DataError, UsageError
from draftline.serving.client import api_key, redact
from draftline.serving.engine import EngineError, ServeSpec, VllmServer


async def _one(client, model: str, sample: TokenizedSample, timeout: float, retries: int):
    path, _ = await generate_hidden_states_async(client, model, {"input_ids": list(sample.input_ids)},
                                                 timeout=timeout, max_retries=retries)
    return path


def _written(path: str) -> None:
    """Wait until the server has finished writing ``path`` (it holds ``<path>.lock`` exclusively until then)."""
    lock = Path(path + ".lock")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)


def _record(path: str, sample: TokenizedSample, num_aux: int, hidden: int) -> dict[str, torch.Tensor]:
    try:
        _written(path)
        data = load_file(path)
    except Exception as e:  # noqa: BLE001 (OSError, or safetensors' own error type)
        raise DataError(f"cannot read the hidden states the server wrote to {path} ({e}); is its output "
                        "directory on a file system this machine can read?") from None
    try:
        check_hidden_states(data, list(sample.input_ids))
    except ValueError as e:
        raise DataError(f"hidden states for sample {sample.id} from {path}: {e}") from None
    hs = data["hidden_states"]
    if hs.dim() != 3 or hs.shape[1] != num_aux + 1 or hs.shape[2] != hidden:
        raise UsageError(f"the server returned hidden states of shape {tuple(hs.shape)} for sample {sample.id}; "
                        f"expected [tokens, {num_aux + 1}, {hidden}] (the {num_aux} aux layers and the last): "
                        "start it extracting the same layers as --aux-layers")
    Path(path).unlink(missing_ok=True)
    Path(path + ".lock").unlink(missing_ok=True)
    return {
        "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
        "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.bool),
        "hidden_states": hs[:, :-1].flatten(1).to(torch.bfloat16).contiguous(),
        "verifier_last_hidden_states": hs[:, -1].to(torch.bfloat16).contiguous(),
    }


def _answers(endpoint: str) -> bool:
    try:
        return httpx.get(endpoint.rstrip("/") + "/models", timeout=5.0).status_code < 500
    except httpx.HTTPError:
        return False


def probe_capture(endpoint: str, model: str, *, num_aux: int, hidden_size: int) -> None:
    """Capture one short prompt through ``endpoint`` and discard it: a server that is down, serves another model
    or extracts other layers than ``--aux-layers`` says so before prepare opens a run."""
    probe = TokenizedSample("probe", list(range(1, 9)), [0] * 8)
    for _ in iter_hidden_states_vllm([probe], endpoint, model, num_aux=num_aux, hidden_size=hidden_size,
                                     batch_size=1, retries=0):
        pass


def loopback_capture_server(verifier: str, layers: list[int], out_dir: str, *, max_len: int) -> VllmServer:
    """A vLLM on 127.0.0.1 serving ``verifier`` with hidden-state extraction of ``layers`` into ``out_dir``
    (not yet started: ``with`` it)."""
    return VllmServer(ServeSpec(model=verifier, served_name="verifier", extract_layers=list(layers),
                                hidden_states_dir=out_dir, max_model_len=max_len))


def iter_hidden_states_vllm(samples: Sequence[TokenizedSample], endpoint: str, model: str, *, num_aux: int,
                            hidden_size: int, batch_size: int = 8, timeout: float = 120.0,
                            retries: int = 3, server: VllmServer | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """One record per sample, in order, ``batch_size`` requests in flight at a time. ``server``: the loopback
    server behind ``endpoint``, whose death is reported with its root cause."""
    async def window(client, chunk):
        return await asyncio.gather(*(_one(client, model, s, timeout, retries) for s in chunk))

    if model not in served_models(endpoint, what="vLLM capture endpoint", flag="--capture-endpoint"):  # one clear error when the server is down or serves another model
        raise DataError(f"the vLLM server at {redact(endpoint)} does not serve {model}; pass --capture-model with "
                        "one of the models it lists")
    client = openai.AsyncClient(base_url=endpoint.rstrip("/"), api_key=api_key() or "EMPTY", max_retries=0)
    loop = asyncio.new_event_loop()
    try:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start:start + batch_size]
            try:
                paths = loop.run_until_complete(window(client, chunk))
            except Exception as e:  # noqa: BLE001 (openai / speculators errors after their retries)
                if server is not None:
                    server.check_alive()  # EngineError naming vLLM's own last error
                if not _answers(endpoint):
                    raise EngineError(f"the vLLM server at {redact(endpoint)} died while capturing (it no longer "
                                      f"answers /v1/models) after {start} of {len(samples)} samples; the shards "
                                      "written so far are kept: restart it and run prepare again to resume. On a "
                                      "CPU, vLLM's own ExampleHiddenStatesConnector dies on the first request "
                                      "(pinned memory): start it with draftline's connector (see prepare "
                                      "--capture-endpoint --help), or leave --capture-endpoint out") from None
                raise DataError(f"the vLLM server at {redact(endpoint)} did not return hidden states ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); check that it runs with "
                                "speculators' hidden-state extraction") from None
            for sample, path in zip(chunk, paths):
                yield _record(path, sample, num_aux, hidden_size)
    finally:
        loop.run_until_complete(client.close())
        loop.close()
