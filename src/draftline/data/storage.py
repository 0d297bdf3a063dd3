"""What prepared data costs on disk, before it is written: the shard bytes for a verifier's hidden size, its aux
layers and a token count (:func:`shard_bytes`), and the token count of a conversations file, measured with the
verifier's tokenizer (:func:`estimate_tokens`).

A shard token holds (aux + 1) x hidden hidden-state values in bf16 (``hidden_states`` [T, aux*H] and
``verifier_last_hidden_states`` [T, H]), an int64 token id and a uint8 loss mask (``data/shards.py``); the
safetensors header and the offsets are a few hundred bytes per shard. For Kimi-K2.5 (hidden 7168, three aux
layers) that is 57,353 bytes a token: 25,000 samples of 3,000 tokens are 4.3 TB.

``--hidden-storage fp8`` stores the hidden states in E4M3 with a float32 scale per token and layer
(:mod:`draftline.data.fp8`): (aux + 1) x (hidden + 4) bytes of hidden state a token, 28,697 bytes in all for
Kimi-K2.5 (0.50x): 2.2 TB for those samples.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from draftline.disk_space import require_free
from draftline.errors import ConfigError

TOKEN_ID_BYTES, MASK_BYTES = 8, 1  # int64 input_ids, uint8 loss_mask
HIDDEN_BYTES = {"bf16": 2, "fp8": 1}
SCALE_BYTES = {"bf16": 0, "fp8": 4}  # fp8: one float32 scale per token and captured layer
# The mission's first run, planned before its conversations exist: 25,000 samples of Kimi-K2.5's own answers,
# reasoning included (2,000-4,000 tokens a sample).
DEFAULT_SAMPLES, DEFAULT_TOKENS_PER_SAMPLE = 25_000, 3_000
# What a chat template adds around each turn (role markers, separators): an allowance when tokens are counted
# from the turns' text; the exact count comes from the tokenised samples, before the capture starts.
TEMPLATE_TOKENS_PER_TURN = 8
# Headroom asked beyond the estimate: the manifest, token frequencies, progress file and the file system's own.
MARGIN = 0.05


def verifier_hidden_size(source: str | Path) -> tuple[int, str]:
    """The hidden size of a verifier from its directory or ``config.json`` (a multimodal wrapper such as
    Kimi-K2.5's ``kimi_k25`` keeps it under ``text_config``), and the name to print; read as JSON, nothing
    imported, no custom code run. Raises :class:`ConfigError` naming the file."""
    path = Path(source).expanduser()
    path = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"verifier config {path} is unreadable ({e}): pass the verifier's directory or its "
                          "config.json") from None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    hidden = text.get("hidden_size") if isinstance(text, dict) else None
    if not isinstance(hidden, int) or hidden < 1:
        raise ConfigError(f"verifier config {path} has no hidden_size (nor text_config.hidden_size): pass a causal "
                          "LM's config.json")
    return hidden, str(raw.get("_name_or_path") or path.parent.name or path)


def token_bytes(hidden_size: int, num_aux: int, storage: str = "bf16") -> int:
    """Bytes one token takes in a shard."""
    return (num_aux + 1) * (hidden_size * HIDDEN_BYTES[storage] + SCALE_BYTES[storage]) + TOKEN_ID_BYTES + MASK_BYTES


@dataclass(frozen=True)
class StoragePlan:
    samples: int
    tokens: int
    bytes_per_token: int
    bytes: int
    storage: str
    tokens_source: str  # how the tokens were counted: "measured …" or "assumed …"

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def needed(self) -> int:
        """The free space to ask for: the shards plus :data:`MARGIN`."""
        return int(self.bytes * (1 + MARGIN))


def shard_bytes(hidden_size: int, num_aux: int, *, tokens: int, samples: int, tokens_source: str,
                storage: str = "bf16") -> StoragePlan:
    per = token_bytes(hidden_size, num_aux, storage)
    return StoragePlan(samples=samples, tokens=tokens, bytes_per_token=per, bytes=per * tokens, storage=storage,
                       tokens_source=tokens_source)


def estimate_tokens(samples: list[dict], tokenizer, max_length: int,
                    regenerate_max_tokens: int | None = None) -> int:
    """Tokens the samples will take, each cut at ``max_length``: every turn's text counted with the verifier's
    tokenizer plus :data:`TEMPLATE_TOKENS_PER_TURN`. With regeneration (``regenerate_max_tokens``), every
    assistant turn, and the answer to a user turn no assistant turn follows, counts as that many tokens: an upper bound, since
    the server may stop sooner."""
    texts = [m["content"] for s in samples for m in s["messages"]
             if regenerate_max_tokens is None or m["role"] != "assistant"]
    counts = iter(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    total, answer = 0, regenerate_max_tokens
    for s in samples:
        n, turns = 0, s["messages"]
        for i, m in enumerate(turns):
            n += (answer if answer is not None and m["role"] == "assistant" else next(counts))
            n += TEMPLATE_TOKENS_PER_TURN
            unanswered = m["role"] == "user" and (i + 1 == len(turns) or turns[i + 1]["role"] != "assistant")
            if answer is not None and unanswered:  # regeneration answers it
                n += answer + TEMPLATE_TOKENS_PER_TURN
        total += min(n, max_length)
    return total


SKIP = "--disk-check false"


def require_room(out_dir: Path, plan: StoragePlan, *, kept_bytes: int = 0) -> None:
    """Refuse (one :class:`DiskFullError` line) when the file system of ``out_dir`` cannot hold the shards
    ``plan`` estimates, less ``kept_bytes`` of finished shards already there."""
    need = max(0, plan.needed - kept_bytes)
    require_free(out_dir, need, what=f"prepare's shards ({plan.tokens:,} tokens x {plan.bytes_per_token:,} bytes, "
                 f"{plan.tokens_source}, +{MARGIN:.0%})",
                 fix=f"free space, choose another --output-dir, cut --max-samples or --max-length, or pass "
                     f"{SKIP} if the file system reports its free space wrongly")


def existing_shard_bytes(out_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(out_dir).glob("shard-*.safetensors")) if Path(out_dir).is_dir() else 0
