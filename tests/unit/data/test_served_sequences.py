"""Every token the verifier generates: a regenerated turn becomes the sequence the server saw and generated (its
prompt ids, then its reply ids under the loss), whatever its reasoning parser made of the text; replies cut at the
token limit are counted and said; what cannot be trained on as served is refused in one line. Against the tiny
verifier behind tests.kit.tiny_server on loopback (which splits replies as vLLM's deepseek_r1 parser does
when asked)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from draftline import names
from draftline.config import PrepareConfig
from draftline.data import replies
from draftline.data.conversations import load_conversations
from draftline.data.prepare import build_data
from draftline.data.regenerate import regenerate
from draftline.data.shards import open_prepared
from draftline.data.tokenize import served_samples, tokenize_conversations
from draftline.errors import DataError
from tests.kit.tiny_server import serve_in_thread

from ...conftest import DEMO, ROOT

PROMPTS = ROOT / "configs" / "demo" / "gsm8k_train_prompts.jsonl"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))


def _masked(records) -> list[list[int]]:
    return [r["input_ids"][r["loss_mask"].bool()].tolist() for r in records]


def test_a_reasoning_parser_changes_no_trained_token(tiny, tokenizer, tmp_path, monkeypatch):
    """The same prompts through the same verifier, its replies split by a reasoning parser or not: the same samples,
    each the server's prompt ids then every id it generated (before, the parser's split lost what it called
    thinking)."""
    samples = load_conversations(PROMPTS, prompts=True).samples[:6]
    out = {}
    for parser in (False, True):
        monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / f"cache-{parser}"))  # two servers, one model id
        with serve_in_thread(tiny["verifier"], reasoning_parser=parser) as server:
            r = regenerate(samples, server.url, max_tokens=12, progress=False)
        if parser:
            assert all(m.get("reasoning") and not m["content"] for m in replies.regenerated_turns(r.samples))
        out[parser] = tokenize_conversations(r.samples, tokenizer, max_length=512)
        for s, t in zip(r.samples, out[parser], strict=True):
            reply = s["messages"][-1]
            assert t.served and t.input_ids == reply["prompt_token_ids"] + reply["token_ids"]
            assert t.loss_mask == [0] * len(reply["prompt_token_ids"]) + [1] * len(reply["token_ids"])
    assert [(t.input_ids, t.loss_mask) for t in out[False]] == [(t.input_ids, t.loss_mask) for t in out[True]]
    generated = sum(len(m["token_ids"]) for m in replies.regenerated_turns(r.samples))
    assert sum(t.num_masked for t in out[True]) == generated > 6 * 6  # every generated token, none of the prompt


def test_prepare_counts_the_replies_cut_at_the_limit_and_can_leave_them_out(tiny, tmp_path):
    with serve_in_thread(tiny["verifier"], reasoning_parser=True) as server:
        base = dict(conversations=str(PROMPTS), verifier=str(tiny["verifier"]), max_length=256, max_samples=6,
                    regenerate_endpoint=server.url, regenerate_max_tokens=6)
        kept = build_data(PrepareConfig(**base), tmp_path / "kept", progress=False)
        dropped = build_data(PrepareConfig(**base, regenerate_keep_truncated=False), tmp_path / "dropped",
                             progress=False)
    answered = [json.loads(line)["messages"][-1] for line in
                next((tmp_path / "cache" / "regenerated").glob("*.jsonl")).read_text().splitlines()]
    cut = sum(m["finish_reason"] == "length" for m in answered)
    assert 0 < cut < 6  # the random verifier stops early on some prompts
    reg = kept["regenerated"]
    assert reg[names.DATA_REPLIES] == 6 and reg[names.DATA_TRUNCATED_REPLIES] == cut and reg[names.DATA_TRUNCATED_SHARE] == cut / 6
    assert reg[names.DATA_REPLY_TOKENS_MAX] == 6 and reg["max_tokens"] == 6 and reg["keep_truncated"] is True
    assert reg[names.DATA_REASONING_SHARE] == 1.0 and reg["served_samples"] == 6 and reg["turns_per_sample"] == 1.0
    assert (tmp_path / "kept" / replies.HISTOGRAM).stat().st_size > 1000  # the lengths, drawn
    assert kept["masked_tokens"] == sum(len(m["token_ids"]) for m in answered)
    assert dropped["samples"] == 6 - cut and dropped["regenerated"]["keep_truncated"] is False
    assert _masked(open_prepared(tmp_path / "dropped").records()) == [
        m["token_ids"] for m in answered if m["finish_reason"] != "length"]


def test_multi_turn_replies_continue_one_sample_where_the_prompt_ids_extend_it():
    first = {"role": "assistant", "content": "a", "finish_reason": "stop", "prompt_token_ids": [1, 2],
             "token_ids": [3, 4]}
    extends = {"role": "assistant", "content": "b", "finish_reason": "stop", "prompt_token_ids": [1, 2, 3, 4, 5],
               "token_ids": [6]}
    rewritten = {**extends, "prompt_token_ids": [1, 2, 9, 5]}  # a template that rendered the past turn otherwise
    user = {"role": "user", "content": "q"}
    one = served_samples({"id": "c"}, [(m["prompt_token_ids"], m["token_ids"]) for m in (first, extends)], 64)
    assert [(t.id, t.input_ids, t.loss_mask, t.turns_from_ids) for t in one] == [
        ("c", [1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], 2)]
    two = tokenize_conversations([{"id": "c", "messages": [user, first, user, rewritten]}], None, 64)
    assert [(t.id, t.input_ids, t.loss_mask) for t in two] == [("c", [1, 2, 3, 4], [0, 0, 1, 1]),
                                                                ("c#2", [1, 2, 9, 5, 6], [0, 0, 0, 0, 1])]
    cut = tokenize_conversations([{"id": "c", "messages": [user, first]}], None, 3)
    assert (cut[0].input_ids, cut[0].cut_tokens) == ([1, 2, 3], 1)


def test_replies_that_cannot_be_trained_as_served_are_refused_in_one_line(tiny, tokenizer, tmp_path):
    samples = load_conversations(PROMPTS, prompts=True).samples[:3]
    with serve_in_thread(tiny["verifier"], reasoning_parser=True, token_ids=False) as server:
        r = regenerate(samples, server.url, max_tokens=6, progress=False)
    with pytest.raises(DataError, match=r"split the thinking off 3 of 3 replies .* returned no token ids"):
        replies.check(r.samples, tokenizer, endpoint="http://x/v1")

    foreign = load_conversations(DEMO).samples[:2]  # ids from another tokenizer: the same text, other ids
    for m in (m for s in foreign for m in s["messages"] if m["role"] == "assistant"):
        m.update(finish_reason="stop", token_ids=[(t + 7) % 500 + 10 for t in tokenizer(m["content"])["input_ids"]])
    with pytest.raises(DataError, match=r"do not decode to its own text .* point --verifier at the served model"):
        replies.check(foreign, tokenizer, endpoint="http://x/v1")


def test_chat_template_kwargs_reach_the_server_and_one_the_template_ignores_is_refused(tiny, workspace):
    from draftline.cli import cli

    with serve_in_thread(tiny["verifier"]) as server:
        r = CliRunner().invoke(cli, ["prepare", "--conversations", str(PROMPTS), "--verifier", str(tiny["verifier"]),
                                     "--regenerate-endpoint", server.url, "--regenerate-chat-template-kwargs",
                                     json.dumps({"thinking": False})])
        assert server.state.requests == 0
    assert r.exit_code != 0 and "ignores 'thinking'" in r.output and "Traceback" not in r.output, r.output
    assert not (workspace / "mlflow.db").exists() and not (workspace / "work").exists()
    bad = CliRunner().invoke(cli, ["prepare", "--conversations", str(PROMPTS), "--verifier", str(tiny["verifier"]),
                                   "--regenerate-chat-template-kwargs", "thinking=false"])
    assert bad.exit_code == 2 and "expected a JSON object" in bad.output, bad.output
