"""What the verifier generated, checked and counted: the regenerated replies of a prepare run.

Each regenerated assistant turn carries what the server returned (:mod:`draftline.data.regenerate`): its text as
the server split it (``content``; ``reasoning`` where a reasoning parser took the thinking out), the ids it
generated (``token_ids``), the prompt ids it saw (``prompt_token_ids``) and why it stopped (``finish_reason``).
Here they are checked before anything is tokenised (a reasoning reply without ids would lose its thinking; ids
that do not decode to the server's text come from another tokenizer than the verifier's), counted (cut at
``--regenerate-max-tokens``, reasoning share, lengths) and shown (a histogram of reply lengths).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from draftline import names
from draftline.errors import DataError

log = logging.getLogger(__name__)

THINK_END = ("</think>", "◁/think▷")  # the end of a thinking block in the tokenizers of DeepSeek-R1/Qwen3/Kimi
HISTOGRAM = "reply_lengths.png"
_WS = re.compile(r"\s+")


def regenerated_turns(samples: list[dict]) -> list[dict]:
    """Every assistant message the server answered (regeneration marks them with ``finish_reason``)."""
    return [m for s in samples for m in s["messages"] if m["role"] == "assistant" and "finish_reason" in m]


def thinking_tokens(tokenizer) -> tuple[int, ...]:
    """The ids of the tokenizer's end-of-thinking tokens (none for a verifier that does not think)."""
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in THINK_END if t in vocab)


def is_reasoning_verifier(tokenizer) -> bool:
    """Whether the verifier thinks before it answers: its tokenizer has an end-of-thinking token."""
    return bool(thinking_tokens(tokenizer))


def _squash(text: str) -> str:
    return _WS.sub("", text.replace("\ufffd", ""))


def _matches(tokenizer, m: dict) -> bool:
    """Whether the reply's ids decode to the text the server returned (whitespace and partial UTF-8 aside)."""
    decoded = _squash(tokenizer.decode(m["token_ids"], skip_special_tokens=True, clean_up_tokenization_spaces=False))
    decoded_all = _squash(tokenizer.decode(m["token_ids"], skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False))
    return all(_squash(part) in decoded or _squash(part) in decoded_all
               for part in (m.get("reasoning") or "", m.get("content") or ""))


def check(samples: list[dict], tokenizer, *, endpoint: str) -> None:
    """Refuse replies that would train on the wrong tokens: thinking the server split off but returned no ids
    for, and ids that do not decode to the server's text (another tokenizer than ``--verifier``'s); a few replies
    whose ids decode otherwise (a detokeniser's edge) are said, not refused."""
    turns = regenerated_turns(samples)
    lost = [m for m in turns if m.get("reasoning") and not (m.get("token_ids") and m.get("prompt_token_ids"))]
    if lost:
        raise DataError(f"the regeneration endpoint {endpoint} split the thinking off {len(lost)} of {len(turns)} "
                        "replies (a reasoning parser) but returned no token ids for them, so the thinking would be "
                        "lost: serve it with vLLM >= 0.10 (it answers return_token_ids), or without "
                        "--reasoning-parser")
    with_ids = [m for m in turns if m.get("token_ids")]
    wrong = [m for m in with_ids if not _matches(tokenizer, m)]
    if with_ids and len(wrong) * 2 > len(with_ids):
        raise DataError(f"the token ids the regeneration endpoint {endpoint} returned do not decode to its own "
                        f"text with the verifier's tokenizer in {len(wrong)} of {len(with_ids)} replies: it serves "
                        "another model or tokenizer than --verifier; point --verifier at the served model's files")
    if wrong:
        log.warning("%d of %d replies' token ids decode to other text than the server returned (kept: the ids are "
                    "what it generated)", len(wrong), len(with_ids))
    empty = [m for m in turns if not m.get("token_ids") and not (m.get("content") or m.get("reasoning"))]
    if turns and len(empty) == len(turns):
        raise DataError(f"the regeneration endpoint {endpoint} returned an empty reply to every prompt: check its "
                        "chat template and --regenerate-max-tokens")


def drop_truncated(samples: list[dict]) -> list[dict]:
    """Each conversation up to its first reply cut at the token limit (``--regenerate-keep-truncated false``);
    a conversation left with no regenerated reply is dropped."""
    out = []
    for s in samples:
        messages: list[dict] = []
        for m in s["messages"]:
            if m["role"] == "assistant" and m.get("finish_reason") == "length":
                break
            messages.append(m)
        if any(m["role"] == "assistant" and "finish_reason" in m for m in messages):
            out.append({**s, "messages": messages})
    return out


@dataclass
class ReplyStats:
    """What the verifier generated in a prepare run (regenerated replies only)."""

    replies: int = 0
    truncated: int = 0  # stopped at --regenerate-max-tokens (finish_reason "length")
    with_reasoning: int = 0  # replies whose thinking the server split off
    reasoning_tokens: int = 0
    lengths: list[int] = field(default_factory=list)  # generated tokens per reply (ids where returned)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def percentile(self, q: float) -> int:
        if not self.lengths:
            return 0
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def metrics(self) -> dict[str, float]:
        n = max(self.replies, 1)
        return {names.DATA_REPLIES: self.replies, names.DATA_REPLY_TOKENS: self.tokens,
                names.DATA_TRUNCATED_REPLIES: self.truncated,
                names.DATA_TRUNCATED_SHARE: self.truncated / n, names.DATA_REASONING_REPLIES: self.with_reasoning,
                names.DATA_REASONING_SHARE: self.reasoning_tokens / max(self.tokens, 1),
                names.DATA_REPLY_TOKENS_P50: self.percentile(0.5), names.DATA_REPLY_TOKENS_P90: self.percentile(0.9),
                names.DATA_REPLY_TOKENS_MAX: max(self.lengths, default=0)}

    def summary(self, max_tokens: int) -> str:
        cut = (f"{self.truncated} of {self.replies} cut at --regenerate-max-tokens {max_tokens}"
               if self.truncated else f"none cut at --regenerate-max-tokens {max_tokens}")
        think = (f", {self.reasoning_tokens / max(self.tokens, 1):.0%} of their tokens thinking"
                 if self.with_reasoning else "")
        return (f"{self.replies} replies, {self.percentile(0.5)} tokens at the median, {self.percentile(0.9)} at "
                f"p90, {max(self.lengths, default=0)} at most{think}; {cut}")


def _reasoning_tokens(m: dict, ends: tuple[int, ...], tokenizer) -> int:
    ids = m.get("token_ids") or []
    for i, t in enumerate(ids):
        if t in ends:
            return i + 1  # the thinking and its closing token
    if ids and not (m.get("content") or "").strip():
        return len(ids)  # no end of thinking: the parser took it all as thinking
    return len(tokenizer(m["reasoning"], add_special_tokens=False)["input_ids"])


def stats(samples: list[dict], tokenizer) -> ReplyStats:
    """Counts over every regenerated reply of ``samples``."""
    out = ReplyStats()
    ends = thinking_tokens(tokenizer)
    for m in regenerated_turns(samples):
        out.replies += 1
        out.truncated += m.get("finish_reason") == "length"
        ids = m.get("token_ids")
        n = len(ids) if ids else len(tokenizer(m.get("content") or "", add_special_tokens=False)["input_ids"])
        out.lengths.append(n)
        if m.get("reasoning"):
            out.with_reasoning += 1
            out.reasoning_tokens += min(n, _reasoning_tokens(m, ends, tokenizer))
    return out


def histogram(s: ReplyStats, path: Path, *, max_tokens: int) -> Path | None:
    """A histogram of the replies' lengths with the token limit marked, as a PNG (None without replies, or
    without matplotlib: a chart never fails a prepare)."""
    if not s.lengths:
        return None
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib)
    except ImportError:
        log.warning("%s not drawn: matplotlib is not installed", HISTOGRAM)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib)

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.hist(s.lengths, bins=min(40, max(5, len(set(s.lengths)))), color="#4C72B0")
    ax.axvline(max_tokens, color="#C44E52", linestyle="--", label=f"--regenerate-max-tokens {max_tokens}")
    ax.set_xlabel("tokens the verifier generated per reply")
    ax.set_ylabel("replies")
    ax.set_title(f"{s.replies} replies: median {s.percentile(0.5)}, p90 {s.percentile(0.9)}, "
                 f"{s.truncated} cut at the limit", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
