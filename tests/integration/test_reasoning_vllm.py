"""A reasoning verifier behind real vLLM: the Kimi miniature (its tokenizer has <think>/</think>) served with and
without ``--reasoning-parser kimi_k2``, as Kimi-K2.5 teams serve it. What prepare trains on is every token the
verifier generated, whatever the parser made of the text. Skipped, saying why, without the vLLM venv (CI builds
it and requires it)."""

from __future__ import annotations

import pytest

from draftline.data import replies
from draftline.data.conversations import load_conversations
from draftline.data.regenerate import regenerate
from draftline.data.tokenize import tokenize_conversations, tokenize_sample
from draftline.serving import hf_model
from draftline.serving.engine import ServeSpec, VllmServer, extra_vllm_args

from ..conftest import ROOT

pytestmark = pytest.mark.integration
GSM8K_TRAIN = ROOT / "configs" / "demo" / "gsm8k_train_prompts.jsonl"


@pytest.mark.timeout(1200)
def test_real_vllm_with_and_without_the_kimi_reasoning_parser_trains_the_same_tokens(kimi, tmp_path, monkeypatch,
                                                                                     vllm_python):
    verifier = str(kimi["verifier"])
    hf_model.allow_custom_code(verifier)
    tokenizer = hf_model.load_tokenizer(verifier)
    assert replies.is_reasoning_verifier(tokenizer)
    samples = load_conversations(GSM8K_TRAIN, prompts=True).samples[:8]
    served, thinking_off = {}, None
    for parser in (None, "kimi_k2"):
        monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / f"cache-{parser}"))  # one model id, two servers
        flags = [*extra_vllm_args(), *(["--reasoning-parser", parser] if parser else [])]
        with VllmServer(ServeSpec(model=verifier, served_name="kimi", max_model_len=512, extra_args=flags)) as server:
            # one request at a time: bf16 batches of another shape could take another greedy branch
            r = regenerate(samples, server.endpoint, max_tokens=24, concurrency=1, progress=False)
            if parser:  # the deployment's switch reaches the template: Kimi's instant mode closes the thinking
                off = regenerate(samples[:2], server.endpoint, max_tokens=8, concurrency=1, progress=False,
                                 chat_template_kwargs={"thinking": False})
                thinking_off = replies.regenerated_turns(off.samples)
        replies.check(r.samples, tokenizer, endpoint=server.endpoint)
        served[parser] = r.samples
    with_parser = replies.regenerated_turns(served["kimi_k2"])
    # the parser took the (random verifier's) output for thinking: the answer text is empty or short
    assert all(m.get("reasoning") for m in with_parser), with_parser[0]
    assert sum(len(m["content"]) for m in with_parser) < sum(len(m["reasoning"]) for m in with_parser)
    plain, parsed = (tokenize_conversations(served[p], tokenizer, 512) for p in (None, "kimi_k2"))
    assert all(t.served for t in plain + parsed)
    assert [(t.input_ids, t.loss_mask) for t in plain] == [(t.input_ids, t.loss_mask) for t in parsed]
    masked = sum(t.num_masked for t in parsed)
    assert masked == sum(len(m["token_ids"]) for m in with_parser)
    # what the template path made of the parser's text (the answer only): most generated tokens lost
    before = sum(tokenize_sample(tokenizer, {"id": s["id"], "messages": [
        {"role": m["role"], "content": m["content"]} for m in s["messages"]]}, 512).num_masked
        for s in served["kimi_k2"])
    assert before < masked / 2, (before, masked)
    print(f"loss-masked tokens: {masked} as served, with or without the parser; {before} from the parser's "
          "answer text through the chat template")
    close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert thinking_off and all(m["prompt_token_ids"][-2:] == close for m in thinking_off)
    assert not any(m.get("reasoning") for m in thinking_off)  # the parser saw the thinking closed in the prompt
