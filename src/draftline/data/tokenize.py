"""Tokenise conversations exactly as the verifier sees them, with an assistant-only loss mask.

A regenerated turn whose server returned both the prompt's ids and the reply's (vLLM's ``return_token_ids``:
``prompt_token_ids`` and the choice's ``token_ids``) is taken as served: the sample is those prompt ids followed
by the generated ids, the loss on every generated id (thinking, answer, tool calls and the stop token alike),
whatever the server's reasoning parser made of the text. A later turn of the same conversation whose prompt ids
start with the previous sample continues it (one sample, several replies in the loss); where the template
renders the history otherwise (reasoning templates drop past thinking), the turn starts a sample of its own.

Conversations without served ids (not regenerated, or a server that returns no ids) are rendered by the chat
template. The mask is derived from the chat template itself: for each assistant turn, the text the template renders
for the turn (prefix with ``add_generation_prompt=True`` up to the rendering that includes the turn) is
located by character offsets, so any template whose renderings are prefix-stable works, generation tags or not.

An assistant turn that carries the verifier's own ``token_ids`` (regeneration through a server that returns
them) contributes those ids instead of a re-tokenisation of its text: the conversation is cut at the turn's
content, the text around it is tokenised as before, and the reply's ids go in between (a trailing stop token
is dropped: the template writes its own end of turn). The ids are used only where they can be placed: the
template renders the content verbatim (where a probe content lands) and the ids decode to that text, as a
server renders it (special tokens skipped, no U+FFFD for a token that holds part of a UTF-8 character);
otherwise the turn falls back to its text.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftline.errors import DataError

_PROBE = "draftline-content-probe-7f3a"


@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    turns_from_ids: int = 0  # assistant turns whose tokens are the server's reply ids
    turns_ids_unplaced: int = 0  # turns that carried ids but were tokenised from their text
    served: bool = False  # the sequence the server saw and generated (prompt ids + reply ids)
    cut_tokens: int = 0  # tokens past max_length, cut off

    @property
    def num_masked(self) -> int:
        return sum(self.loss_mask)


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the ``[start, end)`` character spans of each assistant turn."""
    full = _render(tokenizer, _plain(messages), False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = _render(tokenizer, _plain(messages[:i]), True) if i else _render(tokenizer, [], True)
        end_text = _render(tokenizer, _plain(messages[: i + 1]), False).rstrip()
        if not (full.startswith(start_text) and full.startswith(end_text) and len(end_text) >= len(start_text)):
            raise DataError(
                "the verifier's chat template does not render conversations prefix-stably, so assistant turns "
                "cannot be located for the loss mask; use a template whose rendering of a conversation starts "
                "with the rendering of its first turns"
            )
        spans.append((len(start_text), len(end_text)))
    return full, spans


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as the template sees them (role and content; reply ids are not the template's business)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _lossy(text: str) -> str:
    """``text`` as a server's detokeniser may render it: special tokens skipped (by the caller), and no U+FFFD,
    which a token holding part of a UTF-8 character decodes to here while vLLM's incremental detokeniser holds
    it back (an empty or shorter content) or renders it otherwise."""
    return text.replace("\ufffd", "")


def _reply_ids(tokenizer, messages: list[dict], i: int, text: str, start: int) -> tuple[int, list[int]] | None:
    """Where assistant turn ``i``'s content starts in ``text`` and the ids that stand for it, or None when its
    ids cannot be placed (see the module)."""
    m = messages[i]
    ids = list(m["token_ids"])
    if ids and ids[-1] in set(tokenizer.all_special_ids):  # the stop token: the template writes its own end of turn
        ids.pop()  # one only: a reply cut at max_tokens may end in special tokens the verifier generated
    content = m["content"]
    if _lossy(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)) != _lossy(content):
        return None
    probe = _render(tokenizer, _plain(messages[:i]) + [{"role": "assistant", "content": _PROBE}], False)
    at = probe.find(_PROBE, start)
    if at < 0 or text[start:at] != probe[start:at] or not text.startswith(content, at):
        return None
    return at, ids


def _encode(tokenizer, text: str, a: int, b: int, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokens of ``text[a:b]`` and their mask (1 inside an assistant span)."""
    if a >= b:
        return [], []
    enc = tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a + x and a + y <= e and y > x for s, e in spans)) for x, y in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def tokenize_sample(tokenizer, sample: dict, max_length: int) -> TokenizedSample:
    messages = sample["messages"]
    text, spans = assistant_spans(tokenizer, messages)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    cuts, unplaced = [], 0  # (content start, content end, ids) of turns whose ids stand in for their text
    for i, (start, _end) in zip(assistant, spans, strict=True):
        if not messages[i].get("token_ids"):
            continue
        placed = _reply_ids(tokenizer, messages, i, text, start)
        if placed is None:
            unplaced += 1
        else:
            cuts.append((placed[0], placed[0] + len(messages[i]["content"]), placed[1]))
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for a, b, reply in [*cuts, (len(text), len(text), [])]:
        seg_ids, seg_mask = _encode(tokenizer, text, pos, a, spans)
        ids += seg_ids + reply
        mask += seg_mask + [1] * len(reply)
        pos = b
    return TokenizedSample(id=sample["id"], input_ids=ids[:max_length], loss_mask=mask[:max_length],
                           turns_from_ids=len(cuts), turns_ids_unplaced=unplaced,
                           cut_tokens=max(0, len(ids) - max_length))


def _int_ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return list(value)
    return None


def served_turns(messages: list[dict]) -> list[tuple[list[int], list[int]]] | None:
    """``(prompt ids, reply ids)`` of each regenerated assistant turn, when every one of them carries both (the
    served path), else None."""
    turns = []
    for m in messages:
        if m["role"] != "assistant" or "finish_reason" not in m and "token_ids" not in m:
            continue  # a turn kept as it came (not regenerated)
        prompt, reply = _int_ids(m.get("prompt_token_ids")), _int_ids(m.get("token_ids"))
        if prompt is None or reply is None:
            return None
        turns.append((prompt, reply))
    return turns or None


def served_samples(sample: dict, turns: list[tuple[list[int], list[int]]], max_length: int) -> list[TokenizedSample]:
    """The served sequences of one conversation: a turn whose prompt ids start with the sample so far continues
    it, any other starts a new one (``<id>#<n>`` from the second on)."""
    out: list[TokenizedSample] = []
    ids: list[int] = []
    mask: list[int] = []
    turns_in = 0

    def close() -> None:
        if ids:
            name = sample["id"] if not out else f"{sample['id']}#{len(out) + 1}"
            out.append(TokenizedSample(id=name, input_ids=ids[:max_length], loss_mask=mask[:max_length],
                                       turns_from_ids=turns_in, served=True,
                                       cut_tokens=max(0, len(ids) - max_length)))

    for prompt, reply in turns:
        if ids and prompt[:len(ids)] == ids:
            ids, mask = ids + prompt[len(ids):] + reply, mask + [0] * (len(prompt) - len(ids)) + [1] * len(reply)
            turns_in += 1
            continue
        close()
        ids, mask, turns_in = prompt + reply, [0] * len(prompt) + [1] * len(reply), 1
    close()
    return out


def tokenize(tokenizer, sample: dict, max_length: int) -> list[TokenizedSample]:
    """One conversation's samples: its served sequences where every regenerated turn carries the server's ids
    (see the module), else one sample rendered by the chat template."""
    turns = served_turns(sample["messages"])
    if turns is not None:
        return served_samples(sample, turns, max_length)
    return [tokenize_sample(tokenizer, sample, max_length)]


def tokenize_conversations(samples: list[dict], tokenizer, max_length: int) -> list[TokenizedSample]:
    """Tokenise every conversation; samples left with no assistant token after truncation are dropped."""
    if not all(served_turns(s["messages"]) for s in samples) and tokenizer.chat_template is None:
        raise DataError("the verifier's tokenizer has no chat template; prepare needs one to tokenise conversations")
    out = [t for s in samples for t in tokenize(tokenizer, s, max_length)]
    return [t for t in out if t.num_masked > 0]
