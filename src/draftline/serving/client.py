"""An HTTP client of a vLLM server: its spec-decode counters and greedy completions.

vLLM (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``) exports the counters ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos`` (label ``position`` = 0..k-1), labelled ``model_name`` and
``engine``; the Prometheus client adds ``_total`` to a counter's samples at ``GET /metrics`` (the server root,
not under ``/v1``). The difference after minus before is what our requests drafted and accepted, provided
nothing else runs on that server meanwhile.
"""

from __future__ import annotations

import os
import re
import time
from urllib.parse import urlsplit, urlunsplit

import httpx

from draftline import environment
from draftline.errors import DataError

PREFIX = "vllm:spec_decode_"
API_KEY_ENVS = (environment.REGENERATE_API_KEY.name, "OPENAI_API_KEY")


def redact(url: str) -> str:
    """The URL without user info or query (where credentials hide)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def api_key() -> str | None:
    """An OpenAI-compatible endpoint's key, from the environment only (never from a flag, so it reaches no
    param or log)."""
    return next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None)
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
GENERATED = "vllm:generation_tokens"  # the tokens the server generated (its counter; ``generation_tokens`` here)
_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_counters(text: str, model: str | None = None) -> dict[str, float | dict[int, float]]:
    """The spec-decode counters in a Prometheus text exposition, summed over engines (series of other
    ``model_name`` values left out); ``num_accepted_tokens_per_pos`` by position; ``generation_tokens``, the
    tokens generated, where the server exports them."""
    out: dict[str, float | dict[int, float]] = {}
    per: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m["name"].startswith((PREFIX, GENERATED)) or not m["name"].endswith("_total"):
            continue
        name = "generation_tokens" if m["name"] == GENERATED + "_total" else m["name"][len(PREFIX):-len("_total")]
        if name not in (*COUNTERS, "generation_tokens"):
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        if model is not None and labels.get("model_name", model) != model:
            continue
        value = float(m["value"])
        if name == "num_accepted_tokens_per_pos":
            pos = int(labels.get("position", 0))
            per[pos] = per.get(pos, 0.0) + value
            out[name] = per
        else:
            total = out.get(name, 0.0)
            out[name] = (total if isinstance(total, float) else 0.0) + value
    return out


def server_root(endpoint: str) -> str:
    """``http://host:8000/v1`` -> ``http://host:8000`` (where vLLM serves ``/metrics``)."""
    root = endpoint.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def read_counters(endpoint: str, model: str, headers: dict[str, str], timeout_s: float = 30.0) -> dict:
    url = server_root(endpoint) + "/metrics"
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise DataError(f"cannot read vLLM's metrics at {redact(url)} ({type(e).__name__}: {e}): pass the "
                        "server's OpenAI base URL (ending in /v1) as --vllm-endpoint") from None
    counters = parse_counters(r.text, model)
    missing = [c for c in COUNTERS if c not in counters]
    if missing:
        raise DataError(f"{redact(url)} exposes no {', '.join(PREFIX + c for c in missing)} for model {model}: "
                        "serve the verifier with the drafter (`vllm serve <verifier> --speculative-config "
                        "'{\"model\": \"<drafter>\", \"method\": \"eagle3\", \"num_speculative_tokens\": K}'`)")
    return counters


def settled_counters(endpoint: str, model: str, headers: dict[str, str], wait_s: float = 5.0) -> dict:
    """The counters once two reads agree (vLLM records a step's stats as its outputs are processed)."""
    last = read_counters(endpoint, model, headers)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read_counters(endpoint, model, headers)
        if now == last:
            break
        last = now
    return last



def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def complete(client: httpx.Client, endpoint: str, model: str, prompt: list[int] | str, *, max_tokens: int,
             headers: dict[str, str], timeout_s: float = 600.0, extra: dict | None = None) -> list[int]:
    """One greedy completion (``temperature=0``) through ``POST <endpoint>/completions``: the generated token
    ids (vLLM's ``return_token_ids``)."""
    return complete_with_stats(client, endpoint, model, prompt, max_tokens=max_tokens, headers=headers,
                               timeout_s=timeout_s, extra=extra)[0]


TOP_LOGPROBS = 5  # the choices per token a bf16 lossless check compares (vLLM's own tests ask for 5)


def complete_with_stats(client: httpx.Client, endpoint: str, model: str, prompt: list[int] | str, *,
                        max_tokens: int, headers: dict[str, str], timeout_s: float = 600.0,
                        extra: dict | None = None, tops: list[dict[int, float]] | None = None,
                        ) -> tuple[list[int], dict | None]:
    """:func:`complete`, and the request's own spec-decode statistics where the server reports them
    (``metrics.speculative_decoding``: vLLM with ``--per-request-spec-decode-metrics summary``). With ``tops``
    (a list to fill), the server is asked for its top :data:`TOP_LOGPROBS` log-probabilities and, per generated
    token, ``{token id: log-probability}`` of its first choices is appended (:func:`top_choices`)."""
    if tops is not None:  # keyed by token id: two tokens that decode alike would share one text key
        extra = {**(extra or {}), "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}
    url = endpoint.rstrip("/") + "/completions"
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **(extra or {})}
    try:
        r = client.post(url, json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise DataError(f"completion request to {redact(url)} failed ({type(e).__name__}): is the vLLM "
                        "server still up?") from None
    if r.status_code != 200:
        first = (r.text.strip().splitlines() or [""])[0][:200]
        raise DataError(f"{redact(url)} answered HTTP {r.status_code} to a completion request: {first}")
    body = r.json()
    choice = (body.get("choices") or [{}])[0]
    stats = (body.get("metrics") or {}).get("speculative_decoding")
    if tops is not None:
        tops.extend(top_choices(choice))
    ids = choice.get("token_ids")
    if ids is None:  # a server without return_token_ids: only the count is known
        n = int((body.get("usage") or {}).get("completion_tokens", 0))
        return [-1] * n, stats
    return [int(t) for t in ids], stats


def top_choices(choice: dict) -> list[dict[int, float]]:
    """Per generated token, ``{token id: log-probability}`` from a completion's ``top_logprobs`` asked with
    ``return_tokens_as_token_ids`` (keys ``"token_id:<id>"``)."""
    return [{int(str(k).rsplit(":", 1)[-1]): float(v) for k, v in (top or {}).items()}
            for top in (choice.get("logprobs") or {}).get("top_logprobs") or []]
