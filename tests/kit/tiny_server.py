"""A small OpenAI-compatible server (FastAPI + uvicorn) for a local Hugging Face causal LM directory.

It stands in for ``vllm serve`` in tests and demos: ``GET /v1/models`` and ``POST /v1/chat/completions``
(non-streaming, one choice; ``return_token_ids`` answered as vLLM does: ``prompt_token_ids`` at the top of the
response and the reply's ``token_ids`` in its choice). Concurrent greedy requests are batched into one
left-padded ``generate`` call (up to ``max_batch`` at once; ``max_batch=1`` serves one at a time), giving each
request the same tokens it gets alone; sampled requests run alone, so their seeds mean what they say. With
``hidden_states_dir`` it also answers ``POST /v1/completions`` with ``max_tokens=1`` the way vLLM does under
speculators' hidden-state extraction (it writes ``hs_<id>.safetensors`` with ``token_ids`` and
``hidden_states`` [T, aux + 1, H] and returns the path in ``kv_transfer_params``): an emulation for testing
draftline's vLLM capture backend, computed with transformers. Failure injection exercises clients' retries:
``fail_every=N`` answers 503 to every Nth completion request, ``fail_after=K`` answers 503 to every completion
request after K succeeded.
With ``speculative_drafter=DIR`` it answers ``POST /v1/completions`` (token-id prompts, temperature 0) by greedy
chain speculative decoding with that EAGLE-3 drafter (``num_speculative_tokens``, default 3), as
``draftline.evaluation.chain`` decodes, and exposes vLLM's spec-decode counters at ``GET /metrics`` in vLLM's
Prometheus format: an emulation for testing draftline's vLLM evaluation backend.

    python -m tests.kit.tiny_server MODEL_DIR --port 8000 [--max-batch N] [--fail-every N] [--fail-after K]
                                            [--speculative-drafter DIR [--num-speculative-tokens K]]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftline.data.capture import iter_hidden_states
from draftline.data.tokenize import TokenizedSample
from draftline.drafter.loading import load_drafter
from draftline.evaluation.chain import Counters, speculative_generate
from draftline.evaluation.proposer import Eagle3Proposer


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    prompt: list[int] = Field(min_length=1)
    max_tokens: int | None = None


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat completion request the server honours (other keys are ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    return_token_ids: bool | None = None


@dataclass
class ServerState:
    """Counters and failure injection; tests may read and change them while the server runs."""

    fail_every: int | None = None
    fail_after: int | None = None
    requests: int = 0  # completion requests received, failed ones included
    completions: int = 0  # completion requests answered 200
    failures: int = 0  # completion requests answered 503 on purpose
    batches: list[int] = field(default_factory=list)  # the size of every generate call, in order
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def create_app(  # noqa: C901  (the routes of the test server, one closure each)
        model_dir: str | Path, *, served_model_name: str | None = None, fail_every: int | None = None,
               fail_after: int | None = None, api_key: str | None = None, state: ServerState | None = None,
               hidden_states_dir: str | Path | None = None, aux_layer_ids: list[int] | None = None,
               max_batch: int = 32, batch_wait_s: float = 0.1,
               speculative_drafter: str | Path | None = None, num_speculative_tokens: int = 3,
               reasoning_parser: bool = False, token_ids: bool = True):
    """The FastAPI app serving ``model_dir`` (weights + tokenizer with a chat template) on the CPU;
    with ``api_key``, /v1 requests without ``Authorization: Bearer <api_key>`` get 401 (as vLLM's --api-key).
    ``reasoning_parser``: the reply's text is split as vLLM's ``deepseek_r1`` parser splits it (up to ``</think>``
    into ``reasoning``, all of it when none comes). ``token_ids=False``: ``return_token_ids`` is refused with a 400
    naming it (a server that cannot return ids).
    Greedy requests arriving within ``batch_wait_s`` of each other share a generate call of up to ``max_batch``."""
    model_dir = str(Path(model_dir).resolve())
    name = served_model_name or model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = state or ServerState(fail_every=fail_every, fail_after=fail_after)
    generate_lock = threading.Lock()  # one generation at a time, like one accelerator
    batcher = Batcher(model, tokenizer, generate_lock, state, max_batch=max_batch, wait_s=batch_wait_s)
    created = int(time.time())
    app = FastAPI(title="draftline tiny server")
    app.state.draftline = state
    app.state.batcher = batcher

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Any:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "Unauthorized", "AuthenticationError")
        return await call_next(request)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "draftline", "root": model_dir}]}

    @app.post("/v1/chat/completions", response_model=None)
    def chat_completions(req: ChatRequest) -> Any:
        with state.lock:
            state.requests += 1
            inject = bool((state.fail_every and state.requests % state.fail_every == 0)
                          or (state.fail_after is not None and state.completions >= state.fail_after))
            state.failures += int(inject)
        if inject:
            return error(503, "injected failure (tiny server failure injection)", "ServiceUnavailable")
        if req.model != name:
            return error(404, f"The model `{req.model}` does not exist.", "NotFoundError")
        if req.stream:
            return error(400, "streaming is not supported by the tiny server", "BadRequestError")
        if req.return_token_ids and not token_ids:
            return error(400, "return_token_ids is not supported by this server", "BadRequestError")
        messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        max_new = req.max_completion_tokens or req.max_tokens or 16
        sampling = (req.temperature, req.top_p, req.seed) if req.temperature > 0 else None
        out = batcher.generate(ids, max_new, sampling)
        stopped = bool(out) and out[-1] == tokenizer.eos_token_id
        text = str(tokenizer.decode(out, skip_special_tokens=True))
        with state.lock:
            state.completions += 1
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning_parser:  # deepseek_r1: the thinking up to </think>, all of the output when none comes
            thought, end, answer = text.partition("</think>")
            message = {"role": "assistant", "reasoning": thought, "content": answer if end else None}
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": "stop" if stopped else "length"}
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                          "total_tokens": len(ids) + len(out)}}
        if req.return_token_ids:  # as vLLM: the prompt's ids at the top, the reply's (stop token included) per choice
            body["prompt_token_ids"] = ids
            choice["token_ids"] = out
        return body

    if hidden_states_dir is not None:
        _add_hidden_state_extraction(app, model, name, Path(hidden_states_dir), list(aux_layer_ids or []),
                                     generate_lock, error)
    if speculative_drafter is not None:
        if hidden_states_dir is not None:
            raise ValueError("hidden_states_dir and speculative_drafter both answer /v1/completions; pass one")
        _add_speculative_decoding(app, model, tokenizer, model_dir, name, Path(speculative_drafter),
                                  num_speculative_tokens, generate_lock, error)
    return app


def _add_hidden_state_extraction(app, model, name: str, out: Path, aux: list[int], generate_lock, error) -> None:
    out.mkdir(parents=True, exist_ok=True)

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> Any:
        if req.model != name:
            return error(404, f"The model `{req.model}` does not exist.", "NotFoundError")
        sample = TokenizedSample("request", list(req.prompt), [1] * len(req.prompt))
        with generate_lock:
            rec = next(iter_hidden_states(model, [sample], aux, 1))
        h = rec["verifier_last_hidden_states"].shape[-1]
        hs = torch.cat([rec["hidden_states"].view(len(req.prompt), len(aux), h),
                        rec["verifier_last_hidden_states"].unsqueeze(1)], dim=1)
        path = out / f"hs_{uuid.uuid4().hex}.safetensors"
        save_file({"token_ids": rec["input_ids"], "hidden_states": hs.contiguous()}, str(path))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": name, "kv_transfer_params": {"hidden_states_path": str(path)},
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None,
                             "prompt_token_ids": list(req.prompt)}],
                "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": 1,
                          "total_tokens": len(req.prompt) + 1}}


SPEC_DECODE_COUNTERS = (  # vLLM's names and help texts (vllm/v1/spec_decode/metrics.py, SpecDecodingProm)
    ("num_drafts", "Number of spec decoding drafts."),
    ("num_draft_tokens", "Number of draft tokens."),
    ("num_accepted_tokens", "Number of accepted tokens."),
)


def prometheus_text(counters, model_name: str, created: float) -> str:
    """vLLM's spec-decode counters as the Prometheus client writes them (``_total`` and ``_created`` samples)."""
    labels = f'engine="0",model_name="{model_name}"'
    lines: list[str] = []

    def counter(name: str, doc: str, series: list[tuple[str, float]]) -> None:
        full = f"vllm:spec_decode_{name}"
        lines.extend([f"# HELP {full}_total {doc}", f"# TYPE {full}_total counter"])
        lines.extend(f"{full}_total{{{lab}}} {float(v)}" for lab, v in series)
        lines.extend([f"# HELP {full}_created {doc}", f"# TYPE {full}_created gauge"])
        lines.extend(f"{full}_created{{{lab}}} {created}" for lab, _ in series)

    for name, doc in SPEC_DECODE_COUNTERS:
        value = {"num_drafts": counters.drafts, "num_draft_tokens": counters.draft_tokens,
                 "num_accepted_tokens": counters.accepted}[name]
        counter(name, doc, [(labels, value)])
    counter("num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            [(f'{labels},position="{i}"', v) for i, v in enumerate(counters.accepted_per_pos)])
    return "\n".join(lines) + "\n"


def _add_speculative_decoding(app, model, tokenizer, model_dir: str, name: str, drafter_dir: Path, k: int,
                              generate_lock, error) -> None:
    proposer = Eagle3Proposer(load_drafter(model_dir, drafter_dir))
    counters = Counters(k)
    created = time.time()
    eos = tokenizer.eos_token_id

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> Any:
        if req.model != name:
            return error(404, f"The model `{req.model}` does not exist.", "NotFoundError")
        if float((req.model_extra or {}).get("temperature", 1.0)) != 0.0:
            return error(400, "the tiny server decodes speculatively at temperature 0 only", "BadRequestError")
        with generate_lock:
            out = speculative_generate(model, proposer, list(req.prompt), k=k, max_new_tokens=req.max_tokens or 16,
                                       eos_token_ids={eos}, counters=counters)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": name,
                "choices": [{"index": 0, "text": tokenizer.decode(out, skip_special_tokens=True), "logprobs": None,
                             "finish_reason": "stop" if out and out[-1] == eos else "length",
                             "token_ids": out}],
                "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(out),
                          "total_tokens": len(req.prompt) + len(out)}}

    @app.get("/metrics", response_model=None)
    def metrics() -> Any:
        with generate_lock:
            text = prometheus_text(counters, name, created)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@dataclass
class _Job:
    ids: list[int]
    max_new: int
    sampling: tuple[float, float, int | None] | None  # (temperature, top_p, seed), None for greedy
    done: threading.Event = field(default_factory=threading.Event)
    out: list[int] = field(default_factory=list)  # the reply, when done without error
    error: BaseException | None = None


class Batcher:
    """Runs generation on one thread: greedy requests waiting together form one left-padded batch (the
    attention mask hides the padding and generate derives position ids from it, so each row gets the tokens it
    gets alone); a sampled request runs alone."""

    def __init__(self, model, tokenizer, lock: threading.Lock, state: ServerState, *, max_batch: int,
                 wait_s: float):
        eos = tokenizer.eos_token_id
        self.model, self.lock, self.state = model, lock, state
        self.eos = eos
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.max_batch, self.wait_s = max(1, max_batch), wait_s
        self.queue: list[_Job] = []
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._loop, name="tiny-server-generate", daemon=True).start()

    def close(self) -> None:
        """Stop the generation thread once the queue is empty."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def generate(self, ids: list[int], max_new: int, sampling) -> list[int]:
        """The reply's token ids: up to ``max_new``, ending with the stop token when it came."""
        job = _Job(list(ids), max_new, sampling)
        with self.cond:
            self.queue.append(job)
            self.cond.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.out

    def _take(self) -> list[_Job]:
        with self.cond:
            while not self.queue and not self.closed:
                self.cond.wait()
            if not self.queue:
                return []
            if self.queue[0].sampling is not None or self.max_batch == 1:
                return [self.queue.pop(0)]
            deadline = time.monotonic() + self.wait_s  # let requests sent together arrive together
            while len([j for j in self.queue if j.sampling is None]) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            batch = [j for j in self.queue if j.sampling is None][: self.max_batch]
            self.queue = [j for j in self.queue if j not in batch]
            return batch

    def _loop(self) -> None:
        while jobs := self._take():
            try:
                outs = self._run(jobs)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting requests
                for j in jobs:
                    j.error = e
            else:
                for j, out in zip(jobs, outs, strict=True):
                    j.out = out
            for j in jobs:
                j.done.set()

    def _run(self, jobs: list[_Job]) -> list[list[int]]:
        longest = max(len(j.ids) for j in jobs)
        ids = torch.full((len(jobs), longest), self.pad, dtype=torch.long)
        mask = torch.zeros(len(jobs), longest, dtype=torch.long)
        for r, j in enumerate(jobs):  # left padding: every row's last prompt token is in the last column
            ids[r, longest - len(j.ids):] = torch.tensor(j.ids)
            mask[r, longest - len(j.ids):] = 1
        kwargs: dict[str, Any] = dict(do_sample=False, max_new_tokens=max(j.max_new for j in jobs),
                                      eos_token_id=self.eos, pad_token_id=self.pad)
        sampling = jobs[0].sampling
        if sampling is not None:
            kwargs.update(do_sample=True, temperature=sampling[0], top_p=sampling[1], top_k=0)
        with self.lock, torch.no_grad():
            if sampling is not None and sampling[2] is not None:
                torch.manual_seed(sampling[2])
            out = self.model.generate(ids, attention_mask=mask, **kwargs)[:, longest:].tolist()
        with self.state.lock:
            self.state.batches.append(len(jobs))
        replies = []
        for j, row in zip(jobs, out, strict=True):
            row = row[: j.max_new]
            if self.eos in row:  # a finished row is padded after its stop token
                row = row[: row.index(self.eos) + 1]
            replies.append(row)
        return replies


@dataclass
class RunningServer:
    url: str  # the OpenAI base URL, e.g. http://127.0.0.1:PORT/v1
    model: str
    state: ServerState


@contextlib.contextmanager
def serve_in_thread(model_dir: str | Path, *, served_model_name: str | None = None, fail_every: int | None = None,
                    fail_after: int | None = None, api_key: str | None = None, host: str = "127.0.0.1",
                    port: int = 0, **options: Any) -> Iterator[RunningServer]:
    """Serve ``model_dir`` from a background thread on a free loopback port; stops on exit. ``options`` go to
    :func:`create_app` (hidden-state extraction, ``max_batch``, ``batch_wait_s``)."""
    state = ServerState(fail_every=fail_every, fail_after=fail_after)
    app = create_app(model_dir, served_model_name=served_model_name, api_key=api_key, state=state, **options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tiny-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the tiny server for {model_dir} did not start")
            time.sleep(0.02)
        bound = sock.getsockname()
        name = served_model_name or str(Path(model_dir).resolve())
        yield RunningServer(url=f"http://{bound[0]}:{bound[1]}/v1", model=name, state=state)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        app.state.batcher.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.kit.tiny_server", description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="Hugging Face causal LM directory (weights + tokenizer with a chat template).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="Model id to serve (default: the directory).")
    p.add_argument("--fail-every", type=int, default=None, help="Answer 503 to every Nth completion request.")
    p.add_argument("--fail-after", type=int, default=None, help="Answer 503 once K completions succeeded.")
    p.add_argument("--api-key", default=None, help="Require this bearer key (default: none).")
    p.add_argument("--max-batch", type=int, default=32, help="Most greedy requests per generate call (1: none "
                                                             "batched).")
    p.add_argument("--speculative-drafter", default=None,
                   help="EAGLE-3 drafter directory: /v1/completions decodes speculatively, /metrics has vLLM's counters.")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="Drafts per step (default 3).")
    args = p.parse_args(argv)

    app = create_app(args.model_dir, served_model_name=args.served_model_name, fail_every=args.fail_every,
                     fail_after=args.fail_after, api_key=args.api_key, max_batch=args.max_batch,
                     speculative_drafter=args.speculative_drafter, num_speculative_tokens=args.num_speculative_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
