"""The strongest check a drafter directory can get before it ships: real vLLM loads it beside its verifier and
drafts with it, and says in its log which verifier layers it captures for it (``export`` runs this when the vLLM
venv is there)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from draftline.serving.client import complete, read_counters, settled_counters
from draftline.serving.engine import EngineError, ServeSpec, VerifierRefused, VllmServer

PROBE_PROMPTS = ("Hello! Who are you?", "Write one sentence about the sea.", "What is 12 times 7?")
# vLLM 0.32's INFO line for the layers an EAGLE-3 drafter is fed: the V1 runner's (gpu_model_runner.py: "from
# speculative config", and nothing when it falls back to the verifier's defaults) and Model Runner V2's
# (eagle3_utils.py: "from config", or "from model" for the defaults)
_INFO = re.compile(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d ")  # vLLM's own INFO lines: "INFO 12-07 21:37:09 [file.py:5243]"
_AUX_LINE = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (speculative config|config|model): [(\[]([\d,\s]*)[)\]]")


def captured_aux_layers(log: str) -> tuple[list[int] | None, str]:
    """``(layers, whence)``: the verifier layers vLLM's log says it captures for the drafter, ``whence`` being
    ``config`` (the drafter's) or ``default`` (the verifier's own, the drafter's ids unread: the V1 runner then
    logs nothing, so an INFO-level log without the line means that); ``(None, "unknown")`` when the log is not at
    INFO level and cannot tell."""
    found = _AUX_LINE.findall(log)
    if found:
        whence, ids = found[-1]
        return [int(i) for i in ids.replace(",", " ").split()], "default" if whence == "model" else "config"
    return None, "default" if _INFO.search(log) else "unknown"


def check_serves(drafter_dir: Path | str, verifier_dir: Path | str, *, k: int = 3, max_new_tokens: int = 24,
                 python: Path | None = None) -> dict:
    """Serve ``verifier_dir`` with the EAGLE-3 drafter ``drafter_dir`` (in the verifier's dtype, loopback),
    complete a few prompts (``ignore_eos``, so every step drafts) and require vLLM's spec-decode counters to have moved.
    Raises :class:`EngineError` with vLLM's own error when it refuses the drafter. ``aux_layers``/``aux_from``:
    what its log says it captured (:func:`captured_aux_layers`)."""
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
        aux_layers, aux_from = captured_aux_layers(server.log_text())
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
            "generated_tokens": generated, "startup_s": round(server.startup_s, 1), "aux_layers": aux_layers,
            "aux_from": aux_from,
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
