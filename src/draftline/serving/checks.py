"""The strongest check a drafter directory can get before it ships: real vLLM loads it beside its verifier and
drafts with it (``export`` runs this when the vLLM venv is there)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from draftline.serving.client import complete, read_counters, settled_counters
from draftline.serving.engine import EngineError, ServeSpec, VerifierRefused, VllmServer

PROBE_PROMPTS = ("Hello! Who are you?", "Write one sentence about the sea.", "What is 12 times 7?")


def check_serves(drafter_dir: Path | str, verifier_dir: Path | str, *, k: int = 3, max_new_tokens: int = 24,
                 python: Path | None = None) -> dict:
    """Serve ``verifier_dir`` with the EAGLE-3 drafter ``drafter_dir`` (in the verifier's dtype, loopback),
    complete a few prompts (``ignore_eos``, so every step drafts) and require vLLM's spec-decode counters to have moved.
    Raises :class:`EngineError` with vLLM's own error when it refuses the drafter."""
    spec = ServeSpec(model=str(verifier_dir), served_name="verifier", drafter=str(drafter_dir), k=k,
                     max_model_len=512)
    t0 = time.monotonic()
    server = VllmServer(spec, python=python)
    try:
        server.start()
    except EngineError:
        blame_verifier(verifier_dir, python)
        raise
    try:  # started above, so not `with server:` (its __enter__ starts a server)
        before = read_counters(server.endpoint, server.model, {})
        with httpx.Client() as client:
            generated = sum(len(complete(client, server.endpoint, server.model, p, max_tokens=max_new_tokens,
                                         headers={}, extra={"ignore_eos": True})) for p in PROBE_PROMPTS)
        after = settled_counters(server.endpoint, server.model, {})
        server.check_alive()
    except BaseException:
        server.stop(keep_log=True)  # its log names vLLM's own error
        raise
    server.stop()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    if drafts <= 0:
        raise EngineError(f"vLLM loaded the drafter {drafter_dir} but drafted nothing in {generated} generated "
                          "tokens: its spec-decode counters did not move")
    return {"dtype": spec.dtype, "drafts": int(drafts), "accepted": int(accepted), "acceptance_length": round(1 + accepted / drafts, 4),
            "generated_tokens": generated, "startup_s": round(server.startup_s, 1),
            "seconds": round(time.monotonic() - t0, 1)}


def blame_verifier(verifier_dir: Path | str, python: Path | None) -> None:
    """After vLLM failed to start with a drafter: start it with the verifier alone, and raise
    :class:`VerifierRefused` with vLLM's own error when that fails too (the drafter was never the problem)."""
    plain = VllmServer(ServeSpec(model=str(verifier_dir), served_name="verifier", max_model_len=512), python=python)
    try:
        plain.start()
    except EngineError as e:
        raise VerifierRefused(f"vLLM cannot serve the verifier {verifier_dir} itself, without the drafter ({e}); "
                              "serve it with vLLM first (its architecture, dtype, --trust-remote-code, "
                              "DRAFTLINE_VLLM_ARGS)") from None
    plain.stop()
