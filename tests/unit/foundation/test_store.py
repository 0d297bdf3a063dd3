"""The tracking store a command checks before MLflow loads: a server is asked once per command, not once per
check."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftline import store
from draftline.errors import ServerUnavailable


@pytest.fixture
def health():
    hits = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield hits, f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()


def test_a_server_that_just_answered_is_not_asked_again(health, monkeypatch):
    hits, uri, _ = health
    store.check_reachable(uri)
    store.check_reachable(uri)  # the CLI's check, then MLflow's set-up: one request
    assert hits == ["/health"]
    monkeypatch.setattr(store, "ANSWER_FRESH_S", 0.0)
    store.check_reachable(uri)
    assert hits == ["/health", "/health"]


def test_a_server_that_stopped_answering_is_refused_once_its_answer_is_stale(health, monkeypatch):
    _, uri, httpd = health
    store.check_reachable(uri)
    httpd.shutdown()
    httpd.server_close()
    monkeypatch.setattr(store, "ANSWER_FRESH_S", 0.0)
    with pytest.raises(ServerUnavailable, match="is unreachable"):
        store.check_reachable(uri)
