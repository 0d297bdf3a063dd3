"""Regeneration through an OpenAI-compatible endpoint: the tiny verifier served by tests.kit.tiny_server on
loopback (a real FastAPI/uvicorn server, no mocks)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from draftline.data.conversations import load_conversations
from draftline.data.regenerate import cache_dir, regenerate
from draftline.errors import DataError
from draftline.util import free_port
from tests.kit.tiny_server import serve_in_thread

from ...conftest import DEMO

SAMPLES = load_conversations(DEMO).samples[:6]
FAST = dict(max_tokens=8, progress=False, backoff_s=0.01)


def turns(samples: list[dict]) -> int:
    return sum(m["role"] == "assistant" for s in samples for m in s["messages"])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("OPENAI_API_KEY", "DRAFTLINE_REGENERATE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache" / "regenerated"


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"


def test_assistant_turns_become_the_verifiers_greedy_replies_and_user_turns_stay(tiny, cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert turns(SAMPLES) > len(SAMPLES)  # some conversations are multi-turn
    with serve_in_thread(tiny["verifier"]) as server:
        r = regenerate(SAMPLES, server.url, concurrency=3, **FAST)  # model: the first one the server lists
        assert server.state.requests == turns(SAMPLES)
    assert (r.model, r.done, r.reused, r.failed) == (server.model, 6, 0, 0)
    assert r.path.parent == cache and r.path.is_file() and not list(cache.glob("*.partial"))
    assert [s["id"] for s in r.samples] == [s["id"] for s in SAMPLES]
    assert load_conversations(r.path).samples  # the regenerated file is itself a conversations file

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    verifier = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval()
    for old, new in zip(SAMPLES, r.samples):
        assert [m["role"] for m in new["messages"]] == [m["role"] for m in old["messages"]]
        for i, (a, b) in enumerate(zip(old["messages"], new["messages"])):
            if a["role"] != "assistant":
                assert b == a
                continue
            # the reply to the history so far, earlier assistant turns already regenerated
            prompt = tok.apply_chat_template(new["messages"][:i], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                out = verifier.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            assert b["content"] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) != a["content"]


def test_a_server_failing_every_third_request_still_yields_every_conversation(tiny):
    with serve_in_thread(tiny["verifier"], fail_every=3) as server:
        r = regenerate(SAMPLES, server.url, model=server.model, concurrency=2, max_attempts=8, **FAST)
    assert (r.done, r.failed) == (6, 0)
    assert server.state.failures >= turns(SAMPLES) // 3 and server.state.completions == turns(SAMPLES)


def test_an_interrupted_run_resumes_with_only_the_missing_conversations(tiny, cache, caplog):
    with serve_in_thread(tiny["verifier"], fail_after=4) as server:
        # the server goes down after 4 replies: what finished stays in the partial file, the rest fails
        with caplog.at_level(logging.WARNING, logger="draftline.data.regenerate"):
            first = regenerate(SAMPLES, server.url, model=server.model, concurrency=1, max_attempts=2, **FAST)
        assert first.path.name.endswith(".jsonl.partial") and not list(cache.glob("*.jsonl"))
        assert 0 < first.done < 6 and first.failed == 6 - first.done and len(first.samples) == first.done
        assert all(i in caplog.text for i in first.failed_ids)
        with first.path.open("a") as f:
            f.write('{"index": 5, "id": "torn')  # a run killed in the middle of a line

        missing = [s for s in SAMPLES if s["id"] in first.failed_ids]
        server.state.fail_after, server.state.requests = None, 0
        second = regenerate(SAMPLES, server.url, model=server.model, concurrency=2, **FAST)
        assert server.state.requests == turns(missing)
    assert (second.done, second.reused, second.failed) == (len(missing), first.done, 0)
    assert second.path.suffix == ".jsonl" and not first.path.exists()
    lines = [json.loads(line) for line in second.path.read_text().splitlines()]
    assert sorted(rec["index"] for rec in lines) == list(range(6))
    assert [s["id"] for s in second.samples] == [s["id"] for s in SAMPLES]
    assert [s for s in second.samples if s["id"] not in first.failed_ids] == first.samples  # read back as written

    # the final file is written once and reused as-is: the server is gone, nothing is requested
    third = regenerate(SAMPLES, _dead_url(), model=server.model, **FAST)
    assert (third.path, third.done, third.reused, third.file_sha256) == (second.path, 0, 6, second.file_sha256)
    assert third.samples == second.samples


def test_an_unreachable_endpoint_is_one_data_error_naming_the_url(cache):
    url = _dead_url()
    with pytest.raises(DataError, match=rf"endpoint {url} is unreachable.*--regenerate-endpoint"):
        regenerate(SAMPLES, url, **FAST)
    secret = url.replace("http://", "http://user:hunter2@")
    with pytest.raises(DataError, match=rf"endpoint {url} is unreachable") as e:
        regenerate(SAMPLES, secret, model="m", **FAST)
    assert "hunter2" not in str(e.value) and not cache.exists()


def test_prepare_regenerates_with_the_api_key_and_records_it_nowhere(tiny, tmp_path, monkeypatch, caplog):
    from draftline.config import PrepareConfig
    from draftline.data.prepare import build_data

    key = "sk-test-secret-123"
    with serve_in_thread(tiny["verifier"], api_key=key, served_model_name="tiny-verifier") as server:
        with pytest.raises(DataError, match=r"refused the request \(HTTP 401\).*OPENAI_API_KEY"):
            regenerate(SAMPLES, server.url, **FAST)
        monkeypatch.setenv("DRAFTLINE_REGENERATE_API_KEY", key)
        cfg = PrepareConfig(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_length=256, max_samples=6,
                            regenerate_endpoint=server.url, regenerate_max_tokens=8, regenerate_concurrency=4)
        with caplog.at_level(logging.DEBUG):
            manifest = build_data(cfg, tmp_path / "data", progress=False)
    reg = manifest["regenerated"]
    assert (reg["endpoint"], reg["model"], reg["done"], reg["failed"]) == (server.url, "tiny-verifier", 6, 0)
    # one sample per served sequence: a later turn whose prompt ids do not extend the earlier one starts its own
    assert manifest["samples"] == reg["served_samples"] >= 6 and len(reg["file_sha256"]) == 64
    assert key not in json.dumps(manifest) and key not in caplog.text
    assert [p.name for p in cache_dir().glob("*.jsonl")]
