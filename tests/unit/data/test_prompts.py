"""Prompts in, the verifier's own replies out: prompt-only inputs (OpenAI messages ending in a user turn,
ShareGPT without replies, MT-Bench questions, plain prompts, Hugging Face dataset directories of them) are
answered turn by turn by the tiny verifier behind tests.kit.tiny_server (a real server on loopback);
the server's reply token ids stand in for re-tokenised text; concurrent requests are batched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftline.config import PrepareConfig
from draftline.data.conversations import load_conversations
from draftline.data.regenerate import regenerate
from draftline.data.tokenize import tokenize_sample
from draftline.errors import ConfigError, DataError
from tests.kit.tiny_server import serve_in_thread

from ...conftest import DEMO

MT_BENCH = DEMO.parent / "mt_bench_questions.jsonl"  # shipped as FastChat has it (configs/demo/SOURCES.md)
FAST = dict(max_tokens=8, progress=False, backoff_s=0.01)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("OPENAI_API_KEY", "DRAFTLINE_REGENERATE_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def verifier(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    return tok, AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval()


def greedy(verifier, messages: list[dict], max_new: int = 8) -> list[int]:
    """The verifier's greedy reply to ``messages``, computed alone (no server, no batch)."""
    tok, model = verifier
    prompt = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                     tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    return out[: out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


PROMPT_FORMS = {
    "openai": [{"id": "o1", "messages": [{"role": "user", "content": "Who are you?"}]},
               {"id": "o2", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What can you do?"}]}],
    "sharegpt": [{"id": "s1", "conversations": [{"from": "human", "value": "Tell me a joke."}]},
                 {"id": "s2", "conversations": [{"from": "system", "value": "You are kind."},
                                                {"from": "human", "value": "Hello!"}]}],
    "mt-bench": [{"question_id": 7, "category": "writing", "turns": ["Write a poem.", "Now make it shorter."]},
                 {"question_id": 8, "category": "math", "turns": ["What is 2+2?"]}],
    "prompt": [{"prompt": "Name three colours.", "category": "stem"}, {"id": "p2", "prompt": "Say hi."}],
}


def test_every_prompt_only_form_is_answered_turn_by_turn_with_the_verifiers_greedy_replies(tiny, tmp_path,
                                                                                             verifier):
    import datasets

    tok = verifier[0]
    inputs = {name: write_jsonl(tmp_path / f"{name}.jsonl", recs) for name, recs in PROMPT_FORMS.items()}
    rows = PROMPT_FORMS["mt-bench"] + [{"question_id": 9, "category": "math", "turns": ["And 3+3?"]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf-turns"))
    rows = [{"messages": [{"role": "user", "content": "Hi from a dataset."}]},
            {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "Again?"}]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hf-messages"))
    inputs.update({"hf-turns": tmp_path / "hf-turns", "hf-messages": tmp_path / "hf-messages"})

    with serve_in_thread(tiny["verifier"]) as server:
        for name, path in inputs.items():
            convs = load_conversations(path, prompts=True)
            assert convs.prompts == len(convs.samples) - (name == "hf-messages") and not convs.skipped, name
            r = regenerate(convs.samples, server.url, concurrency=4, **FAST)
            assert (r.done, r.failed) == (len(convs.samples), 0), name
            for old, new in zip(convs.samples, r.samples, strict=True):
                assert (new["id"], new.get("category")) == (old["id"], old.get("category")), name
                users = [m for m in old["messages"] if m["role"] == "user"]
                # each user turn is followed by the verifier's reply to everything before it (an assistant turn
                # already there is replaced by one)
                assert [m["role"] for m in new["messages"]] == \
                    [m["role"] for m in old["messages"] if m["role"] == "system"] + ["user", "assistant"] * len(users)
                assert [m for m in new["messages"] if m["role"] != "assistant"] == \
                    [m for m in old["messages"] if m["role"] != "assistant"]
                for i, m in enumerate(new["messages"]):
                    if m["role"] == "assistant":
                        expected = greedy(verifier, new["messages"][:i])
                        assert m["token_ids"] == expected, (name, i)
                        assert m["content"] == tok.decode(expected, skip_special_tokens=True)
    assert [s["id"] for s in load_conversations(inputs["mt-bench"], prompts=True).samples] == ["7", "8"]
    assert [s["id"] for s in load_conversations(inputs["prompt"], prompts=True).samples] == ["prompt-1", "p2"]


def test_mt_bench_questions_as_they_are_become_a_prepared_data_set_of_two_replies_each(tiny, tmp_path, verifier):
    from draftline.data.prepare import build_data

    with serve_in_thread(tiny["verifier"]) as server:
        cfg = PrepareConfig(conversations=str(MT_BENCH), verifier=str(tiny["verifier"]), max_length=512,
                            max_samples=3, categories="!writing,!roleplay", regenerate_endpoint=server.url,
                            regenerate_max_tokens=8, regenerate_concurrency=3)
        manifest = build_data(cfg, tmp_path / "data", progress=False)
        assert server.state.requests == 6  # two turns each, answered in order
    reg = manifest["regenerated"]
    assert manifest["categories"] == {"reasoning": 3}  # MT-Bench: 10 per category
    assert (reg["done"], reg["failed"], reg["prompts"]) == (3, 0, 3)
    assert (reg["turns_from_token_ids"], reg["turns_token_ids_unplaced"]) == (6, 0)
    # each question's two replies as served: one sample where the second prompt's ids extend the first reply's
    assert manifest["samples"] == reg["served_samples"] and 3 <= manifest["samples"] <= 6

    regenerated = [json.loads(line) for line in Path(_regenerated_file(tmp_path)).read_text().splitlines()]
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()]
    questions = [q for q in questions if q["category"] == "reasoning"][:3]
    for q, rec in zip(questions, sorted(regenerated, key=lambda r: r["index"]), strict=True):
        assert (rec["id"], rec["category"]) == (str(q["question_id"]), "reasoning")
        u1, a1, u2, a2 = rec["messages"]
        assert (u1["content"], u2["content"]) == tuple(q["turns"])
        assert a1["token_ids"] == greedy(verifier, [u1])
        assert a2["token_ids"] == greedy(verifier, [u1, a1, u2])  # the first reply is in the context
    assert manifest["masked_tokens"] == sum(len(m["token_ids"]) for rec in regenerated for m in rec["messages"]
                                            if m["role"] == "assistant")  # every generated token, once


def _regenerated_file(tmp_path: Path) -> Path:
    (found,) = (tmp_path / "cache" / "regenerated").glob("*.jsonl")
    return found


def test_prompts_without_an_endpoint_are_one_error_naming_the_file_and_the_count(tiny, tmp_path):
    from draftline.data.prepare import build_data

    path = write_jsonl(tmp_path / "prompts.jsonl", PROMPT_FORMS["mt-bench"] + PROMPT_FORMS["prompt"])
    cfg = PrepareConfig(conversations=str(path), verifier=str(tiny["verifier"]))
    with pytest.raises(DataError, match=rf"{path} holds prompts only: 4 of its 4 records have no assistant turn.*"
                                        r"pass --regenerate-endpoint URL"):
        build_data(cfg, tmp_path / "data", progress=False)
    # mixed with conversations, the prompts are skipped (each reported) and the conversations used
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [json.loads(line) for line in DEMO.read_text().splitlines()[:2]]
                        + PROMPT_FORMS["prompt"])
    convs = load_conversations(mixed)
    assert (len(convs.samples), convs.prompts) == (2, 2)
    assert [n for n, why in convs.skipped if "--regenerate-endpoint" in why] == [3, 4]


def test_categories_select_or_drop_and_a_name_no_record_has_is_an_error(tmp_path):
    from draftline.config import resolve
    from draftline.data.conversations import select_categories

    samples = load_conversations(write_jsonl(tmp_path / "q.jsonl", PROMPT_FORMS["mt-bench"] + PROMPT_FORMS["prompt"]),
                                 prompts=True).samples
    assert [s["id"] for s in select_categories(samples, "math,stem", "q")] == ["8", "q-3"]
    assert [s["id"] for s in select_categories(samples, "!math", "q")] == ["7", "q-3", "p2"]
    assert select_categories(samples, None, "q") == samples
    with pytest.raises(DataError, match=r"no record of q has category maths \(its categories: math, stem, writing\)"):
        select_categories(samples, "maths", "q")
    with pytest.raises(ConfigError, match="categories: .*not both"):
        resolve(PrepareConfig, flags={"conversations": "q", "verifier": "v", "categories": "math,!stem"})
    assert PrepareConfig(conversations="q", verifier="v", categories=["math", " stem"]).categories == "math,stem"


def test_reply_token_ids_stand_in_for_the_text_where_the_template_puts_the_content(tokenizer):
    # ids a tokenisation of the text would not produce: the reply "I am." spelled one byte-level token at a time
    chars = [tokenizer.convert_tokens_to_ids(c) for c in ["I", "Ġ", "a", "m", "."]]
    assert tokenizer.decode(chars) == "I am." and chars != tokenizer("I am.", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "I am.", "token_ids": chars + [eos]},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye.", "token_ids": [5, 6]}]
    t = tokenize_sample(tokenizer, {"id": "x", "messages": messages}, max_length=512)
    assert (t.turns_from_ids, t.turns_ids_unplaced) == (1, 1)  # [5, 6] do not decode to "Bye.": its text is used
    plain = tokenize_sample(tokenizer, {"id": "x", "messages": [{k: v for k, v in m.items() if k != "token_ids"}
                                                                 for m in messages]}, max_length=512)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prefix = tokenizer(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    rest = tokenizer(full[full.index("I am.") + len("I am."):], add_special_tokens=False)["input_ids"]
    # the prompt as the server tokenised it, the reply's own ids (its stop token dropped), then the template's
    # end of turn and the rest of the conversation as text
    assert t.input_ids == prefix + chars + rest and rest[0] == eos
    assert t.loss_mask[:len(prefix)] == [0] * len(prefix) and t.loss_mask[len(prefix):][:len(chars) + 1] == \
        [1] * (len(chars) + 1)
    assert t.loss_mask[-len(rest):] == plain.loss_mask[-len(rest):] and plain.input_ids[-len(rest):] == rest
    assert tokenizer.decode(t.input_ids) == tokenizer.decode(plain.input_ids) == full


def test_reply_ids_are_kept_where_the_servers_text_is_their_lossy_rendering(tokenizer):
    """A token holding half a UTF-8 character decodes to U+FFFD here while vLLM's detokeniser holds it back, and
    a reply cut at max_tokens may end in special tokens the verifier generated: the ids are still the reply (only
    the one stop token at the end is dropped), not a re-tokenisation of the text the server rendered."""
    eos = tokenizer.eos_token_id
    half = tokenizer.convert_tokens_to_ids("Ã")  # the first byte of "é" alone
    assert "\ufffd" in tokenizer.decode([half])
    word = [tokenizer.convert_tokens_to_ids(c) for c in ["I", "Ġ", "a", "m"]]
    cases = {"fragment": (word + [half, eos], "I am"), "specials": (word + [eos, eos, eos], "I am")}
    for name, (ids, content) in cases.items():
        messages = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": content, "token_ids": ids}]
        t = tokenize_sample(tokenizer, {"id": "x", "messages": messages}, max_length=512)
        assert (t.turns_from_ids, t.turns_ids_unplaced) == (1, 0), name
        kept = ids[:-1]  # the stop token: the template writes its own end of turn
        at = next(i for i in range(len(t.input_ids)) if t.input_ids[i:i + len(kept)] == kept)
        assert t.loss_mask[at:at + len(kept)] == [1] * len(kept), name


def test_the_server_returns_token_ids_as_vllm_does_and_prepare_places_them(tiny, verifier):
    import httpx

    tok = verifier[0]
    messages = [{"role": "user", "content": "Who are you?"}]
    with serve_in_thread(tiny["verifier"]) as server:
        body = {"model": server.model, "messages": messages, "max_tokens": 8, "temperature": 0}
        plain = httpx.post(f"{server.url}/chat/completions", json=body).json()
        r = httpx.post(f"{server.url}/chat/completions", json={**body, "return_token_ids": True}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["prompt_token_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    ids = r["choices"][0]["token_ids"]
    assert ids == greedy(verifier, messages) and tok.decode(ids, skip_special_tokens=True) == \
        r["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    reply = {"role": "assistant", "content": r["choices"][0]["message"]["content"], "token_ids": ids}
    t = tokenize_sample(tok, {"id": "x", "messages": [*messages, reply]}, max_length=512)
    content_ids = ids[:-1] if ids[-1] == tok.eos_token_id else ids
    n = len(r["prompt_token_ids"])
    assert t.turns_from_ids == 1 and t.input_ids[:n + len(content_ids)] == r["prompt_token_ids"] + content_ids


def test_batched_greedy_replies_equal_the_unbatched_ones(tiny, verifier):
    """Concurrent requests share one left-padded generate call and get the tokens each gets alone."""
    import concurrent.futures

    import httpx

    prompts = [s["messages"][:1] for s in load_conversations(DEMO).samples[:9]]
    prompts += [[{"role": "user", "content": "x" * n}] for n in (1, 7, 300)]  # prompt lengths far apart
    with serve_in_thread(tiny["verifier"], max_batch=32, batch_wait_s=0.2) as server:
        def ask(messages):
            body = {"model": server.model, "messages": messages, "max_tokens": 12, "temperature": 0,
                    "return_token_ids": True}
            return httpx.post(f"{server.url}/chat/completions", json=body, timeout=120).json()["choices"][0]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(ask, prompts))
        batches = list(server.state.batches)
    assert max(batches) > 1 and sum(batches) == len(prompts)
    for messages, reply in zip(prompts, replies, strict=True):
        assert reply["token_ids"] == greedy(verifier, messages, max_new=12), messages
