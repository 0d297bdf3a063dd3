"""prepare's pieces: reading conversations, the assistant-only loss mask, shards and the manifest."""

import json

import pytest
import torch

from draftline.data.conversations import load_conversations
from draftline.data.shards import open_prepared
from draftline.data.tokenize import tokenize_sample
from draftline.errors import DataError


def test_reads_openai_and_sharegpt_forms_and_reports_malformed_lines(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "{not json",
        json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
    ]))
    with pytest.raises(DataError, match=r"c\.jsonl line 2: invalid JSON.*--skip-bad-records"):
        load_conversations(f)  # a broken line is no warning: it stops, naming the line
    convs = load_conversations(f, skip_bad=True)
    assert [m["role"] for m in convs.samples[1]["messages"]] == ["user", "assistant"]
    assert len(convs.samples) == 2
    assert [line for line, _ in convs.skipped] == [2, 4]
    assert "invalid JSON" in convs.skipped[0][1] and "no assistant turn" in convs.skipped[1][1]


def test_sharegpt_json_list(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "q"},
                                                            {"from": "gpt", "value": "a"}]}]))
    assert load_conversations(f).samples[0]["id"] == "x"


def test_no_usable_conversation_is_an_error(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("{}\n[1]\n")
    with pytest.raises(DataError, match="line 1: none of 'messages'.*and 1 more bad records"):
        load_conversations(f)
    with pytest.raises(DataError, match="does not exist"):
        load_conversations(tmp_path / "missing.jsonl")


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    sample = {"id": "t", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Vicuna."},
        {"role": "user", "content": "Bye!"},
        {"role": "assistant", "content": "You too!"},
    ]}
    t = tokenize_sample(tokenizer, sample, max_length=512)
    masked = [i for i, m in zip(t.input_ids, t.loss_mask) if m]
    unmasked = [i for i, m in zip(t.input_ids, t.loss_mask) if not m]
    # hand-checked: the assistant's words and its end-of-turn token, nothing of the system/user turns
    assert tokenizer.decode(masked) == "I am Vicuna.<|im_end|>You too!<|im_end|>"
    assert tokenizer.decode(unmasked) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho are you?"
                                          "<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>user\nBye!<|im_end|>\n"
                                          "<|im_start|>assistant\n\n")
    assert tokenizer.decode(t.input_ids) == tokenizer.apply_chat_template(sample["messages"], tokenize=False)


def test_shards_round_trip_with_bf16_minimum_storage(prepared, tiny):
    data = open_prepared(prepared, verify=True)
    m = data.manifest
    records = data.records()
    assert len(records) == m["samples"] and sum(r["input_ids"].numel() for r in records) == m["tokens"]
    assert m["aux_layer_ids"] == [2, 4, 5] and m["verifier"] == str(tiny["verifier"].resolve())
    assert len(m["shards"]) > 1  # shard_tokens=4096 splits the data
    r = records[0]
    h = m["hidden_size"]
    assert r["hidden_states"].shape == (r["input_ids"].numel(), 3 * h)
    assert r["hidden_states"].dtype == torch.bfloat16 and r["loss_mask"].dtype == torch.bool
    shard_bytes = sum((prepared / s["file"]).stat().st_size for s in m["shards"])
    floor = m["tokens"] * (3 + 1) * h * 2
    assert m["bytes_per_token"] == 4 * h * 2 + 8 + 1 and m["hidden_storage"] == "bf16"  # + id and mask
    assert floor <= shard_bytes <= floor * 1.02  # ids/masks/headers add < 2% at this hidden size


def test_last_hidden_state_is_taken_before_the_final_norm(tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    from draftline.data.capture import capture_hidden_states
    from draftline.data.tokenize import TokenizedSample

    verifier = AutoModelForCausalLM.from_pretrained(tiny["verifier"]).eval()
    s = TokenizedSample("x", tokenizer("hello there")["input_ids"], [1, 1])
    rec = capture_hidden_states(verifier, [s], [2, 4, 5])[0]
    with torch.no_grad():
        out = verifier(torch.tensor([s.input_ids]), output_hidden_states=True)
    # the pre-norm state, normed by the verifier's own norm, gives the verifier's logits
    logits = verifier.lm_head(verifier.model.norm(rec["verifier_last_hidden_states"].float()))
    assert torch.allclose(logits, out.logits[0], atol=0.1, rtol=0.05)
    assert torch.equal(rec["hidden_states"][:, :128], out.hidden_states[2][0].to(torch.bfloat16))


def test_digest_changes_when_a_shard_changes(prepared, tmp_path):
    import shutil

    from draftline.data.shards import data_digest, read_manifest

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    m = read_manifest(copy)
    assert data_digest(m) == m["digest"]
    shard = copy / m["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="does not match the sha256 in its manifest"):
        open_prepared(copy, verify=True)


def test_hugging_face_dataset_directory_with_a_malformed_row(tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "only a question"}]},
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    convs = load_conversations(tmp_path / "ds")
    assert [s["messages"][-1]["content"] for s in convs.samples] == ["hello", "4"]
    assert convs.skipped == [(2, "no assistant turn (a prompt: pass --regenerate-endpoint to have the verifier "
                                 "answer it)")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a Hugging Face dataset saved with save_to_disk"):
        load_conversations(tmp_path / "empty")


def test_shards_are_found_where_prepare_left_them(prepared, tmp_path):
    import shutil

    from draftline.data.shards import FREQS, MANIFEST

    logged = tmp_path / "logged"  # what a prepare run logs by default: the manifest and the frequencies
    logged.mkdir()
    for name in (MANIFEST, FREQS):
        shutil.copy(prepared / name, logged / name)
    data = open_prepared(logged, verify=True)
    assert data.shard_root == prepared.resolve() and len(data.records()) == data.manifest["samples"]
    moved = tmp_path / "moved"
    prepared_copy = shutil.copytree(prepared, tmp_path / "orig")
    m = open_prepared(prepared_copy).manifest
    m["location"] = str(moved)
    (logged / MANIFEST).write_text(__import__("json").dumps(m))
    with pytest.raises(DataError, match=f"neither in {logged} nor at {moved}.*--log-shards"):
        open_prepared(logged)
