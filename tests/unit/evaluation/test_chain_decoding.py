"""Measured acceptance: greedy chain speculative decoding of a drafter against the tiny verifier, as vLLM's
EAGLE-3 proposer drafts, with vLLM's counters; the output must be the verifier's own greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftline import names
from draftline.drafter.loading import load_drafter
from draftline.evaluation.chain import ChainResult, measure_chain, recommend_num_speculative_tokens
from draftline.evaluation.proposer import Eagle3Proposer
from tests.kit import greedy

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo" / "conversations.jsonl"

AUX = [2, 4, 5]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Two threads on a shared 2-core machine spin against each other (40x slower measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def verifier(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    return AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval(), tok


@pytest.fixture(scope="module")
def trained(tiny, verifier):
    """A drafter trained 40 steps on the verifier's greedy replies to 64 demo prompts; 6 other prompts held out."""
    model, tok = verifier
    prompts = greedy.chat_prompts(tok, DEMO, 70)
    train, held_out = prompts[:64], prompts[64:]
    recs = greedy.records(model, train, greedy.greedy_replies(model, train, 32, tok.pad_token_id), AUX)
    drafter = greedy.train_drafter(tiny["verifier"], recs, aux_layer_ids=AUX, steps=40)
    return drafter, held_out


def test_the_proposer_computes_what_speculators_trained(verifier, trained):
    """Step 0 over the verified pairs and each later step, fed the true tokens, give exactly the drafts of
    speculators' own (teacher-forced) forward, position by position, whether the proposer starts afresh or
    carries its KV cache from one round to the next."""
    from draftline.drafter.model import pack

    model, _ = verifier
    drafter, held_out = trained
    ids = held_out[0] + greedy.greedy_replies(model, held_out[:1], 16, 0)[0]
    rec = greedy.records(model, [ids[:8]], [ids[8:]], AUX)[0]
    batch = {k: v for k, v in pack([rec]).items() if k not in ("verifier_last_hidden_states", "loss_mask")}
    with torch.no_grad():
        steps = drafter(**batch, ttt_steps=3)
    expected = [[int(s[0, i]) + int(drafter.d2t[s[0, i]]) for s in steps] for i in range(len(ids) - 4)]
    hidden, fresh, carried = rec["hidden_states"], Eagle3Proposer(drafter), Eagle3Proposer(drafter)
    for i, want in enumerate(expected):
        fresh.reset()
        assert fresh.propose(hidden[:i + 1], ids[1:i + 2], 3, feed=ids[i + 2:i + 4]) == want, i
        assert carried.propose(hidden[i:i + 1], ids[i + 1:i + 2], 3, feed=ids[i + 2:i + 4]) == want, i


def test_output_is_the_verifiers_greedy_output_token_for_token(tiny, verifier):
    """The tiny parent (AQ-MedAI layout, loaded as a user's drafter directory) on several prompts, with EOS
    and a length that trims the last step's drafts: every output equals generate(do_sample=False)."""
    model, tok = verifier
    drafter = load_drafter(tiny["verifier"], tiny["parent"])
    prompts = greedy.chat_prompts(tok, DEMO, 4, offset=100)
    result = measure_chain(model, drafter, prompts, k=3, max_new_tokens=21, eos_token_ids={tok.eos_token_id})
    assert result.mismatches == [] and result.lossless
    assert result.prompts == 4 and 0 < result.generated_tokens <= 4 * 21
    assert len(result.accepted_per_pos) == 3 and result.drafts > 0
    assert result.draft_tokens <= 3 * result.drafts
    assert result.metrics()["lossless"] == 1.0


def test_a_wrong_drafter_is_accepted_almost_never_and_the_output_stays_identical(verifier, trained):
    model, _ = verifier
    drafter, held_out = trained
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    try:
        with torch.no_grad():  # every draft lands on the neighbouring draft-vocabulary entry
            drafter.lm_head.weight.copy_(drafter.lm_head.weight.roll(1, dims=0))
        wrong = measure_chain(model, drafter, held_out, k=3, max_new_tokens=24)
    finally:
        drafter.load_state_dict(state)
    assert wrong.mismatches == []
    assert wrong.acceptance_length < 1.05, wrong


def test_a_trained_drafter_accepts_more_and_agrees_with_teacher_forced_accuracy(verifier, trained):
    """Measured on the same held-out prompts as the verifier's replies it is teacher-forced on. Measured (tiny
    verifier, 6 prompts x 24 tokens, 1 thread): acceptance length 1.38 at k=3 (wrong drafter: 1.00); the
    position-1 rate at k=1 is 0.279 vs 0.333 teacher-forced over the full vocabulary and 0.354 for speculators'
    full_acc_0 (= cond_acc_0), which scores the argmax within the draft vocabulary (decoding cannot accept a
    verifier token outside it) at every position (decoding drafts only after a verified token). Tolerances:
    0.15 and 0.2 absolute."""
    model, _ = verifier
    drafter, held_out = trained
    replies = greedy.greedy_replies(model, held_out, 24, 0)
    forced = greedy.teacher_forced(drafter, greedy.records(model, held_out, replies, AUX))
    k1 = measure_chain(model, drafter, held_out, k=1, max_new_tokens=24)
    k3 = measure_chain(model, drafter, held_out, k=3, max_new_tokens=24)
    assert k1.mismatches == [] and k3.mismatches == []
    print(f"\nteacher-forced {forced}\nk=1 {k1.metrics()}\nk=3 {k3.metrics()}")
    assert k3.acceptance_length > 1.15, k3
    assert abs(k1.per_position_rates[0] - forced["full_vocab_acc_0"]) < 0.15, (k1, forced)
    assert abs(k1.per_position_rates[0] - forced["full_acc_0"]) < 0.2, (k1, forced)
    rates = k3.per_position_rates
    assert rates == sorted(rates, reverse=True)  # P(first j accepted) cannot grow with j


def test_result_definitions_are_vllms():
    r = ChainResult(k=3, prompts=2, drafts=10, draft_tokens=28, accepted=12, accepted_per_pos=[6, 4, 2],
                    generated_tokens=40, seconds=2.0)
    assert r.acceptance_length == pytest.approx(2.2)  # 1 + accepted / drafts
    assert r.per_position_rates == pytest.approx([0.6, 0.4, 0.2])
    m = r.metrics()
    assert m["acceptance_rate_pos_1"] == pytest.approx(0.6) and m["acceptance_rate_pos_3"] == pytest.approx(0.2)
    assert m["tokens_per_s"] == 20.0 and m["prompts_per_s"] == 1.0 and m["lossless"] == 1.0
    assert ChainResult(k=2, prompts=0, drafts=0, draft_tokens=0, accepted=0, accepted_per_pos=[0, 0],
                       generated_tokens=0, seconds=0.0).acceptance_length == 1.0


@pytest.mark.parametrize("rates, cost, best", [
    ([0.9, 0.8, 0.7, 0.6, 0.5], 0.05, 5),   # long chains pay when drafts are cheap and accepted
    ([0.5, 0.1, 0.02], 0.05, 2),            # (1.5/1.05=1.43, 1.6/1.10=1.45, 1.62/1.15=1.41)
    ([0.3, 0.05], 0.2, 1),                  # an expensive drafter: one draft only
    ([0.0, 0.0, 0.0], 0.05, 1),             # nothing accepted: the minimum
    ([], 0.05, 1),
    ([0.5, 0.5], 0.0, 2),                   # free drafts: every measured position
])
def test_recommend_num_speculative_tokens(rates, cost, best):
    assert recommend_num_speculative_tokens(rates, draft_cost_ratio=cost) == best


def test_recommend_refuses_rates_that_are_not_probabilities():
    with pytest.raises(ValueError):
        recommend_num_speculative_tokens([1.5])
    with pytest.raises(ValueError):
        recommend_num_speculative_tokens([0.5], draft_cost_ratio=-1)



VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 99.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_vllm_counters_are_read_by_their_exported_names():
    from draftline.serving.client import parse_counters, server_root

    c = parse_counters(VLLM_METRICS, "m")
    assert c["num_drafts"] == 15.0  # summed over engines, the other model left out
    assert c["num_draft_tokens"] == 45.0 and c["num_accepted_tokens"] == 20.0
    assert c["num_accepted_tokens_per_pos"] == {0: 12.0, 1: 6.0, 2: 2.0}
    assert server_root("http://h:8000/v1/") == "http://h:8000"


def test_the_vllm_backend_reads_the_counters_measure_chain_counts(tiny, verifier, trained, tmp_path):
    """Against the tiny server decoding with the same drafter (vLLM's /v1/completions and /metrics), the
    counters measure_vllm reads equal those measure_chain counts in process on the same prompts."""
    from draftline.evaluation.vllm_backend import measure_vllm
    from tests.kit.tiny_server import serve_in_thread

    model, tok = verifier
    drafter, held_out = trained
    directory = greedy.save_drafter(drafter, tiny["verifier"], tmp_path / "drafter")
    local = measure_chain(model, load_drafter(tiny["verifier"], directory), held_out, k=3, max_new_tokens=20,
                          eos_token_ids={tok.eos_token_id})
    with serve_in_thread(tiny["verifier"], speculative_drafter=directory, num_speculative_tokens=3) as server:
        served = measure_vllm(server.url, server.model, held_out, max_new_tokens=20, concurrency=2)
    assert served.k == 3 and served.prompts == len(held_out)
    for name in ("drafts", "draft_tokens", "accepted", "accepted_per_pos", "generated_tokens"):
        assert getattr(served, name) == getattr(local, name), name
    assert local.accepted > 0
    assert served.lossless_checked is False and "lossless" not in served.metrics()
    assert served.acceptance_length == pytest.approx(local.acceptance_length)


def test_the_walk_over_teacher_forced_drafts_is_what_decoding_counts(verifier, trained):
    """vLLM's walk replayed on one teacher-forced forward over the verifier's greedy replies gives exactly the
    drafts, accepted tokens and per-position counts of real chain decoding of the same prompts, while the
    uniform average over reply positions (teacher-forced acceptance) does not."""
    from draftline.drafter.model import metric_sums, summarise

    model, _ = verifier
    drafter, held_out = trained
    prompts = held_out[:4]
    result = measure_chain(model, drafter, prompts, k=3, max_new_tokens=24)
    recs = greedy.records(model, prompts, result.outputs, AUX)
    sums = metric_sums(drafter, recs, ttt_steps=3, tokens_per_batch=4096, dtype=torch.float32)
    assert (sums["walk_accepted_total"], sums["walk_accepted_sum"]) == (result.drafts, result.accepted)
    assert [sums[f"walk_pos_{k}_sum"] for k in range(3)] == result.accepted_per_pos
    m = summarise(sums, 3)
    assert m["walk_acceptance_length"] == pytest.approx(result.acceptance_length)
    assert m["acceptance_length"] != pytest.approx(result.acceptance_length, abs=1e-3)


def test_the_served_cut_of_longer_replies_predicts_a_shorter_measurement(verifier, trained):
    """An evaluation serves its first prompts for fewer tokens than the data's replies hold: the walk over
    `served_samples` (those prompts, those first tokens) still gives decoding's counts exactly."""
    from draftline.drafter.model import metric_sums
    from draftline.evaluation.teacher_forced import served_samples

    model, _ = verifier
    drafter, held_out = trained
    recs = greedy.records(model, held_out, greedy.greedy_replies(model, held_out, 30, 0), AUX)
    result = measure_chain(model, drafter, held_out[:3], k=3, max_new_tokens=11)
    cut = [sample for _, sample in served_samples(recs, max_prompts=3, max_new_tokens=11)]
    assert [int(r["loss_mask"].sum()) for r in cut] == [11, 11, 11]
    sums = metric_sums(drafter, cut, ttt_steps=3, tokens_per_batch=4096, dtype=torch.float32)
    assert (sums["walk_accepted_total"], sums["walk_accepted_sum"]) == (result.drafts, result.accepted)


def test_evaluate_says_when_vllm_serves_other_than_the_drafters_own_forward_predicts(verifier, trained, capsys):
    """On the verifier's greedy replies (prepare regenerated them at temperature 0) a measured figure far
    from the walk over the same replies means serving runs another model: evaluate says so in one line; close
    to it, or on replies that are not the verifier's greedy output, it stays quiet."""
    from draftline.config import EvaluateConfig
    from draftline.evaluation.stage import _predicted


    model, _ = verifier
    drafter, held_out = trained
    recs = greedy.records(model, held_out, greedy.greedy_replies(model, held_out, 20, 0), AUX)
    cfg = EvaluateConfig(target="x", data="x", max_prompts=4, max_new_tokens=12)
    greedy_manifest = {"regenerated": {"temperature": 0.0}}
    right = measure_chain(model, drafter, held_out[:4], k=3, max_new_tokens=12).acceptance_length
    got = _predicted(cfg, drafter, recs, greedy_manifest, right, progress=False)
    assert got[names.PREDICTED] == pytest.approx(right) and "warning" not in capsys.readouterr().err
    _predicted(cfg, drafter, recs, greedy_manifest, right + 0.5, progress=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"served acceptance {right + 0.5:.3f}" in err and f"predicts {right:.3f}" in err
    _predicted(cfg, drafter, recs, {"regenerated": {"temperature": 0.7}}, right + 0.5, progress=False)
    _predicted(cfg, drafter, recs, {}, right + 0.5, progress=False)
    assert "warning" not in capsys.readouterr().err


def test_a_stored_reply_that_is_not_what_was_served_is_left_out_of_the_prediction(verifier, trained, capsys):
    """prepare may hold a reply that is not the server's (its lossy text re-tokenised, an empty turn): walked, it
    predicts nothing about its prompt, and compared with the whole measurement it raised a false warning. Given
    the measurement's outputs and per-prompt counts, the prediction walks only the replies served token for
    token and is compared with the measurement on those prompts."""
    from draftline.config import EvaluateConfig
    from draftline.evaluation.stage import _predicted


    model, _ = verifier
    drafter, held_out = trained
    recs = greedy.records(model, held_out, greedy.greedy_replies(model, held_out, 20, 0), AUX)
    cfg = EvaluateConfig(target="x", data="x", max_prompts=4, max_new_tokens=12)
    greedy_manifest = {"regenerated": {"temperature": 0.0}}
    result = measure_chain(model, drafter, held_out[:4], k=3, max_new_tokens=12)
    bad = list(recs)
    for j in (0, 2):  # the reply stored as other tokens than those served
        r = dict(bad[j])
        first = int(r["loss_mask"].nonzero()[0])
        r["input_ids"] = r["input_ids"].clone()
        r["input_ids"][first:] = (r["input_ids"][first:] + 1) % model.config.vocab_size
        bad[j] = r
    _predicted(cfg, drafter, bad, greedy_manifest, result.acceptance_length, progress=False)
    assert "warning" in capsys.readouterr().err  # the old comparison, over every prompt
    got = _predicted(cfg, drafter, bad, greedy_manifest, result.acceptance_length, progress=False,
                     outputs=result.outputs, per_prompt=result.per_prompt)
    rows = [result.per_prompt[j] for j in (1, 3)]
    on_them = 1 + sum(r["accepted"] for r in rows) / sum(r["drafts"] for r in rows)
    assert got[names.PREDICTED_PROMPTS] == 2 and got[names.PREDICTED] == pytest.approx(on_them)
    assert got[names.PREDICTED_DIFFERENCE] == pytest.approx(0.0, abs=1e-9)
    assert "warning" not in capsys.readouterr().err
    without = _predicted(cfg, drafter, bad, greedy_manifest, result.acceptance_length, progress=False,
                         outputs=result.outputs, per_prompt=[])  # no per-prompt counts: nothing to compare with
    assert names.PREDICTED_DIFFERENCE not in without and "warning" not in capsys.readouterr().err


def test_the_bf16_lossless_check_tolerates_a_difference_only_within_each_others_top_choices():
    """bf16 (vLLM's check_logprobs_close rule): a first difference where each server's token is among the
    other's top choices is a near tie; a token the plain verifier did not rank at all is a mismatch; float32
    (no top choices asked) tolerates nothing."""
    from draftline.evaluation.chain import ChainResult
    from draftline.evaluation.vllm_backend import lossless_against

    def result(outputs, tops):
        return ChainResult(k=3, prompts=len(outputs), drafts=1, draft_tokens=3, accepted=0, accepted_per_pos=[0] * 3,
                           generated_tokens=6, seconds=1.0, lossless_checked=False, backend="vllm",
                           outputs=outputs, output_tops=tops)

    plain = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    plain_tops = [[{1: -0.1, 9: -3}, {2: -0.5, 20: -0.6, 21: -4}, {3: -0.1}],
                  [{4: -0.1}, {5: -0.2, 6: -3}, {6: -0.1}],
                  [{7: -0.1}, {8: -0.1}, {9: -0.1}]]
    spec = [[1, 20, 3], [4, 50, 6], [7, 8, 9]]  # prompt 0: a near tie; prompt 1: 50 is not in plain's list
    spec_tops = [[{1: -0.1}, {20: -0.5, 2: -0.55}, {3: -0.1}],
                 [{4: -0.1}, {50: -0.1, 5: -2.0}, {6: -0.1}],
                 [{7: -0.1}, {8: -0.1}, {9: -0.1}]]
    checked = lossless_against(result(spec, spec_tops), plain, reference_tops=plain_tops)
    assert [t["prompt"] for t in checked.near_ties] == [0] and checked.near_ties[0]["margin"] == 0.1
    assert [m["prompt"] for m in checked.mismatches] == [1] and not checked.lossless
    assert checked.metrics()["near_tie_prompts"] == 1.0 and checked.metrics()["mismatched_prompts"] == 1.0
    exact = lossless_against(result(spec, []), plain)
    assert [m["prompt"] for m in exact.mismatches] == [0, 1] and "near_tie_prompts" not in exact.metrics()
    # as many mismatches as the verifier's own measured bf16 noise explains leave it lossless, no more
    assert lossless_against(result(spec, spec_tops), plain, reference_tops=plain_tops, allowed=1).lossless


def test_the_bf16_noise_bound_is_the_clopper_pearson_upper_bound():
    from draftline.evaluation.loopback import binomial_upper

    assert abs(binomial_upper(0, 12) - (1 - 0.05 ** (1 / 12))) < 1e-9  # no difference in 12: rate <= 22 %
    assert 0.116 < binomial_upper(3, 64) < 0.118 and binomial_upper(64, 64) == 1.0
