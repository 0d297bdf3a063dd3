"""A serving vLLM's /metrics page (its spec-decode counters, as vLLM names them) and /v1/models, on loopback,
whose counters a test moves: what `draftline observe` reads. Real vLLM serves them in
tests/integration/test_kimi.py."""

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Counters:
    """A vLLM /metrics page whose counters the test moves; with ``spec=False``, a server without a drafter."""

    def __init__(self, spec=True):
        self.drafts, self.accepted, self.spec = 0, 0, spec
        self.per_pos = [0, 0, 0]
        self.reads = 0
        self.script: dict[int, tuple[int, list[int]]] = {}  # read n of /metrics -> the traffic served after it

    def serve(self, drafts: int, accepted_per_pos: list[int]):
        self.drafts += drafts
        self.per_pos = [a + b for a, b in zip(self.per_pos, accepted_per_pos, strict=True)]
        self.accepted = sum(self.per_pos)

    def page(self) -> str:
        self.reads += 1
        text = self._page()
        if self.reads in self.script:  # traffic, or something else that happens then
            then = self.script[self.reads]
            then() if callable(then) else self.serve(*then)
        return text

    def _page(self) -> str:
        if not self.spec:
            return 'vllm:generation_tokens_total{model_name="kimi"} 100.0\n'
        lines = [f'vllm:spec_decode_num_drafts_total{{model_name="kimi"}} {float(self.drafts)}',
                 f'vllm:generation_tokens_total{{model_name="kimi"}} {float(self.drafts + self.accepted)}',
                 'vllm:generation_tokens_total{model_name="another"} 1000.0',
                 f'vllm:spec_decode_num_draft_tokens_total{{model_name="kimi"}} {float(3 * self.drafts)}',
                 f'vllm:spec_decode_num_accepted_tokens_total{{model_name="kimi"}} {float(self.accepted)}']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="kimi",position="{p}"}} {float(v)}'
                  for p, v in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def metrics_server(counters: Counters | None = None):
    """``(counters, OpenAI base URL)`` of a server exposing ``counters`` until the block ends."""
    counters = counters or Counters()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/metrics":
                body, kind = counters.page().encode(), "text/plain"
            elif self.path == "/v1/models":
                body, kind = json.dumps({"data": [{"id": "kimi"}]}).encode(), "application/json"
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield counters, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
