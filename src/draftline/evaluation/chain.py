"""Measured acceptance: real greedy chain speculative decoding of a drafter against its verifier, in process.

The verifier (a transformers causal LM) and the drafter (speculators' ``Eagle3DraftModel``, through
:class:`~draftline.evaluation.proposer.Eagle3Proposer`) decode each prompt as vLLM does with
``--speculative-config '{"method": "eagle3", "num_speculative_tokens": k}'`` at temperature 0, and count what
vLLM counts. vLLM references:

- ``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``: a running request is scheduled at most
  ``prompt + max_tokens - 1 - num_computed_tokens`` tokens, so near ``max_tokens`` its drafts are trimmed
  (``del request.spec_token_ids[num_scheduled_spec_tokens:]``) and a step left with none is a plain decode
  step; ``Scheduler.update_from_output``: a step with scheduled drafts records
  ``num_draft_tokens = len(scheduled_spec_token_ids)``, ``num_accepted = len(generated_token_ids) - 1``, before
  the stop checks (EOS, ``max_tokens``) drop tokens after the stop;
- the greedy rejection sampler: drafts are accepted while each equals the verifier's argmax at its position; the
  verifier's argmax after the last accepted one is emitted too (the recovered or bonus token);
- ``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingStats.observe_draft``: ``num_drafts += 1``,
  ``num_draft_tokens += n``, ``num_accepted_tokens += a``, ``num_accepted_tokens_per_pos[i] += 1`` for
  ``i < a``; the mean acceptance length is ``1 + num_accepted_tokens / num_drafts`` and the per-position rates
  ``num_accepted_tokens_per_pos / num_drafts``.

Speculative decoding is lossless: the output must be the verifier's own greedy output, token for token. Each
prompt is also decoded by ``verifier.generate(do_sample=False)``; a difference is recorded in
``ChainResult.mismatches`` (a bug, reported, never raised).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig

from draftline.console import bar_kwargs
from draftline.evaluation.proposer import Eagle3Proposer, truncate
from draftline.registry.confidence import prompt_key


@dataclass
class ChainResult:
    """What a run of greedy chain speculative decoding measured, in vLLM's counters."""

    k: int  # num_speculative_tokens
    prompts: int
    drafts: int  # verification steps with at least one draft token (vLLM's num_drafts)
    draft_tokens: int  # draft tokens verified: drafts * k, less where max_new_tokens trimmed a step's drafts
    accepted: int  # accepted draft tokens (vLLM's num_accepted_tokens)
    accepted_per_pos: list[int]  # len k: steps whose first j+1 drafts were all accepted
    generated_tokens: int
    seconds: float
    mismatches: list[dict] = field(default_factory=list)  # {"prompt", "position", "expected", "got"}
    near_ties: list[dict] = field(default_factory=list)  # bf16: differences within each other's top choices
    lossless_rule: str = "identical"  # or "top-5" (bf16: vllm_backend.lossless_against)
    allowed_mismatches: int = 0  # bf16: mismatches the verifier's own measured bf16 noise explains
    lossless_checked: bool = True  # False where the backend cannot see the verifier's own greedy output
    backend: str = "transformers"
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # generated token ids, per prompt
    output_tops: list[list[dict]] = field(default_factory=list, repr=False)  # per token {id: logprob}, top 5
    per_prompt: list[dict] = field(default_factory=list, repr=False)  # evidence per prompt (prompt_row)
    speeds: list = field(default_factory=list, repr=False)  # speed with and without the drafter (speed.Speed)
    sweep: dict = field(default_factory=dict, repr=False)  # k -> its speeds (--sweep-k)

    @property
    def acceptance_length(self) -> float:
        """vLLM's mean acceptance length, the bonus token included: ``1 + accepted / drafts``."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position_rates(self) -> list[float]:
        """P(the first j drafts of a step are all accepted), j = 1..k (vLLM's per-position acceptance rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def lossless(self) -> bool:
        return self.lossless_checked and len(self.mismatches) <= self.allowed_mismatches

    def metrics(self) -> dict[str, float]:
        """Flat metric names, ready for ``mlflow.log_metrics``."""
        out = {
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
            **{f"acceptance_rate_pos_{j + 1}": r for j, r in enumerate(self.per_position_rates)},
            "num_speculative_tokens": float(self.k),
            "drafts": float(self.drafts),
            "draft_tokens": float(self.draft_tokens),
            "accepted_tokens": float(self.accepted),
            "generated_tokens": float(self.generated_tokens),
            "prompts": float(self.prompts),
            "tokens_per_s": self.generated_tokens / self.seconds if self.seconds else 0.0,
            "prompts_per_s": self.prompts / self.seconds if self.seconds else 0.0,
        }
        if self.lossless_checked:
            out["lossless"] = 1.0 if self.lossless else 0.0
            out["mismatched_prompts"] = float(len(self.mismatches))
            if self.lossless_rule != "identical":
                out["near_tie_prompts"] = float(len(self.near_ties))
                out["bf16_noise_allowed_prompts"] = float(self.allowed_mismatches)
        return out

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("outputs", "output_tops", "per_prompt")}, "acceptance_length": self.acceptance_length,
                "per_position_rates": self.per_position_rates}


@dataclass
class Counters:
    """vLLM's ``SpecDecodingStats`` for greedy chain drafting with ``k`` speculative tokens."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def add(self, other: Counters) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=True)]

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft_tokens
        self.accepted += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


def speculative_generate(verifier, proposer, prompt: list[int], *, k: int, max_new_tokens: int,
                         eos_token_ids: Iterable[int] = (), counters: Counters | None = None) -> list[int]:
    """Greedy chain speculative decoding of one prompt; returns the generated tokens and updates ``counters``.

    The verifier keeps a ``DynamicCache`` (cropped after each rejection); its hidden states ``out.hidden_states[i]``
    (the input of decoder layer i, as prepare captures them) feed the proposer.
    """
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1 (got {k})")
    eos = set(eos_token_ids)
    aux = proposer.aux_layer_ids
    device = next(verifier.parameters()).device
    cache = DynamicCache()
    proposer.reset()

    def run(tokens: list[int]):
        out = verifier(input_ids=torch.tensor([tokens], device=device), past_key_values=cache, use_cache=True,
                       output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i][0] for i in aux], dim=-1)
        return out.logits[0].argmax(dim=-1).tolist(), hidden

    generated: list[int] = []

    def emit(tokens: list[int]) -> bool:
        """Append tokens one by one with vLLM's stop checks; True once the request is finished."""
        for t in tokens:
            generated.append(t)
            if t in eos or len(generated) >= max_new_tokens:
                return True
        return False

    if max_new_tokens < 1:
        return generated
    with torch.inference_mode():
        argmax, hidden = run(list(prompt))
        seq = list(prompt) + [argmax[-1]]
        finished = emit([argmax[-1]])
        pending_hidden, pending_tokens = hidden, seq[1:]  # verified pairs (hidden t, token t+1) not yet drafted on
        while not finished:
            spec = min(k, max_new_tokens - len(generated) - 1)  # vLLM trims drafts that would pass max_tokens
            if spec > 0:
                drafts = proposer.propose(pending_hidden, pending_tokens, spec)
                argmax, hidden = run([seq[-1], *drafts])
                accepted = 0
                while accepted < spec and drafts[accepted] == argmax[accepted]:
                    accepted += 1
                new = drafts[:accepted] + [argmax[accepted]]
                if counters is not None:
                    counters.observe(spec, accepted)
                truncate(cache, len(seq) + accepted)  # keep the last token and the accepted drafts
                pending_hidden, pending_tokens = hidden[: accepted + 1], new
            else:  # one token left: a plain decode step (no drafts, nothing counted)
                argmax, hidden = run([seq[-1]])
                new = [argmax[0]]
            seq.extend(new)
            finished = emit(new)
    return generated


def _reference(verifier, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The verifier's own greedy output (``generate(do_sample=False)``), stopping at ``eos`` or the length."""
    # An explicit config: no eos means none (not the model's default), no other processor interferes.
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                              eos_token_id=sorted(eos) or None, pad_token_id=verifier.config.pad_token_id or 0,
                              num_beams=1, repetition_penalty=1.0, top_k=None, top_p=None, temperature=None)
    ids = torch.tensor([prompt], device=next(verifier.parameters()).device)
    with torch.inference_mode():
        out = verifier.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out[0, len(prompt):].tolist()
    if not eos:
        return tokens
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def first_mismatch(prompt_index: int, expected: list[int], got: list[int]) -> dict | None:
    """Where ``got`` leaves ``expected``: the first differing position (``None`` for a missing token)."""
    for p in range(max(len(expected), len(got))):
        e = expected[p] if p < len(expected) else None
        g = got[p] if p < len(got) else None
        if e != g:
            return {"prompt": prompt_index, "position": p, "expected": e, "got": g}
    return None


def measure_chain(verifier, drafter, prompts: list[list[int]], *, k: int, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = frozenset(), progress: bool = False) -> ChainResult:
    """Decode every prompt by greedy chain speculative decoding (``num_speculative_tokens = k``) and check each
    output against the verifier's own greedy output. ``seconds`` covers the speculative decoding only."""
    eos = set(eos_token_ids)
    proposer = Eagle3Proposer(drafter)
    counters = Counters(k)
    outputs: list[list[int]] = []
    per_prompt: list[dict] = []
    start = time.perf_counter()
    for prompt in tqdm(prompts, desc="speculative decoding", unit="prompt", **bar_kwargs(progress)):
        one = Counters(k)
        outputs.append(speculative_generate(verifier, proposer, prompt, k=k, max_new_tokens=max_new_tokens,
                                            eos_token_ids=eos, counters=one))
        counters.add(one)
        per_prompt.append(prompt_row(prompt, one.drafts, one.accepted, one.accepted_per_pos, len(outputs[-1])))
    seconds = time.perf_counter() - start
    mismatches = []
    for i, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        miss = first_mismatch(i, _reference(verifier, prompt, max_new_tokens, eos), got)
        if miss is not None:
            mismatches.append(miss)
    return ChainResult(k=k, prompts=len(prompts), drafts=counters.drafts, draft_tokens=counters.draft_tokens,
                       accepted=counters.accepted, accepted_per_pos=counters.accepted_per_pos,
                       generated_tokens=sum(len(o) for o in outputs), seconds=seconds, mismatches=mismatches,
                       outputs=outputs, per_prompt=per_prompt)


def prompt_row(prompt: list[int], drafts: int, accepted: int, accepted_per_pos: list[int], generated: int) -> dict:
    """One prompt's evidence (``per_prompt.jsonl``): what later comparisons pair prompt by prompt."""
    return {"key": prompt_key(prompt), "drafts": drafts, "accepted": accepted,
            "accepted_per_pos": list(accepted_per_pos), "generated": generated}


def recommend_num_speculative_tokens(per_position_rates: list[float], draft_cost_ratio: float = 0.05) -> int:
    """The ``num_speculative_tokens`` that maximises expected tokens per unit of cost, from measured rates.

    ``per_position_rates[j-1]`` is P(the first j drafts of a step are accepted), as measured with some k.
    Drafting only the first k' <= k tokens accepts ``min(a, k')`` of them, so a step yields
    ``1 + sum_{j<=k'} P(first j accepted)`` tokens (the bonus token included), and costs one verifier forward
    plus k' drafter forwards, each ``draft_cost_ratio`` of a verifier forward:

        k* = argmax_{1 <= k' <= k} (1 + sum_{j<=k'} rates[j-1]) / (1 + draft_cost_ratio * k')

    Ties go to the smaller k'; at least 1 (also when nothing was measured). Rates past the measured k are
    unknown, so k* never exceeds it: measure with a larger k to consider longer chains.
    """
    if draft_cost_ratio < 0:
        raise ValueError(f"draft_cost_ratio must be >= 0 (got {draft_cost_ratio})")
    if any(not 0.0 <= r <= 1.0 for r in per_position_rates):
        raise ValueError(f"acceptance rates must lie in [0, 1] (got {list(per_position_rates)})")
    best_k, best, tokens = 1, float("-inf"), 1.0
    for j, rate in enumerate(per_position_rates, start=1):
        tokens += rate
        value = tokens / (1.0 + draft_cost_ratio * j)
        if value > best + 1e-12:
            best_k, best = j, value
    return best_k
