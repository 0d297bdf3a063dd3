"""Tokenise conversations exactly as the verifier sees them, with an assistant-only loss mask.

The mask is derived from the chat template itself: for each assistant turn, the text the template renders
for the turn (prefix with ``add_generation_prompt=True`` up to the rendering that includes the turn) is
located by character offsets, so any template whose renderings are prefix-stable works, generation tags or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftline.errors import DataError


@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_masked(self) -> int:
        return sum(self.loss_mask)


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the ``[start, end)`` character spans of each assistant turn."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:i], True) if i else _render(tokenizer, [], True)
        end_text = _render(tokenizer, messages[: i + 1], False).rstrip()
        if not (full.startswith(start_text) and full.startswith(end_text) and len(end_text) >= len(start_text)):
            raise DataError(
                "the verifier's chat template does not render conversations prefix-stably, so assistant turns "
                "cannot be located for the loss mask; use a template whose rendering of a conversation starts "
                "with the rendering of its first turns"
            )
        spans.append((len(start_text), len(end_text)))
    return full, spans


def tokenize_sample(tokenizer, sample: dict, max_length: int) -> TokenizedSample:
    text, spans = assistant_spans(tokenizer, sample["messages"])
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_length], enc["offset_mapping"][:max_length]
    mask = [int(any(s <= a and b <= e and b > a for s, e in spans)) for a, b in offsets]
    return TokenizedSample(id=sample["id"], input_ids=list(ids), loss_mask=mask)


def tokenize_conversations(samples: list[dict], tokenizer, max_length: int) -> list[TokenizedSample]:
    """Tokenise every conversation; samples left with no assistant token after truncation are dropped."""
    if tokenizer.chat_template is None:
        raise DataError("the verifier's tokenizer has no chat template; prepare needs one to tokenise conversations")
    out = [tokenize_sample(tokenizer, s, max_length) for s in samples]
    return [t for t in out if t.num_masked > 0]
