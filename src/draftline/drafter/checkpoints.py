"""Drafter checkpoints on disk: find the files, detect the layout, remap keys, load strictly, hash.

Two layouts exist for the same EAGLE-3 drafter:

* ``midlayer``: SpecForge / EAGLE / AQ-MedAI (``midlayer.*``, no embeddings);
* ``speculators``: vLLM's speculators format (``layers.0.*``).

Loading never trusts a checkpoint silently (``speculators convert`` drops keys it does not know): every parent
key must land on a model key of the same shape, or one :class:`CheckpointError` lists every mismatch. Tensors are
copied one at a time from memory-mapped safetensors straight into the (already bf16) parameters, so peak memory
is the model plus one tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from draftline.drafter.shape import MIDLAYER_PREFIX, SPECULATORS_PREFIX, key_remap
from draftline.errors import CheckpointError, ParentMismatch

# Keys a drafter shares with its verifier, or keeps only in memory: a parent may lack them or carry them;
# they are never taken from the parent (reported and recorded as skipped).
VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass
class CheckpointFiles:
    root: Path
    weights: list[Path]
    config: dict
    pickled: bool = False

    @property
    def all_files(self) -> list[Path]:
        extra = [self.root / "config.json"] if (self.root / "config.json").is_file() else []
        return sorted(self.weights) + extra


@dataclass
class LoadReport:
    layout: str
    key_remap: str
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    remapped_lm_head: bool = False
    lm_head_from_verifier: bool = False  # the parent has none: it drafts through the verifier's (see head_shared)


def find_checkpoint(path: Path | str, *, allow_pickle: bool = False) -> CheckpointFiles:
    """The weight files of a checkpoint directory (one safetensors file, or shards with an index)."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint {root} does not exist: pass a directory holding model.safetensors")
    if root.is_file():
        root = root.parent
    config = {}
    if (root / "config.json").is_file():
        try:
            config = json.loads((root / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{root / 'config.json'} is not valid JSON ({e})") from None
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        weights = sorted({root / f for f in weight_map.values()})
        missing = [w.name for w in weights if not w.is_file()]
        if missing:
            raise CheckpointError(f"{root} index names shards that are missing: {', '.join(missing)}")
        return CheckpointFiles(root, weights, config)
    weights = sorted(root.glob("*.safetensors"))
    if weights:
        return CheckpointFiles(root, weights, config)
    pickles = sorted(p for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES and p.name != "training_state.pt")
    if pickles:
        if not allow_pickle:
            raise CheckpointError(
                f"{root} holds only pickle weights ({', '.join(p.name for p in pickles)}); pickles can run code, "
                "so they are refused. Convert them to safetensors, or pass --allow-pickle to load them with "
                "torch.load(weights_only=True)"
            )
        return CheckpointFiles(root, pickles, config, pickled=True)
    raise CheckpointError(f"no weights in {root}: expected model.safetensors (or shards with an index)")


def _iter_tensors(files: CheckpointFiles):
    """Yield ``(key, tensor_getter, shape, dtype_name)`` without materialising tensors."""
    for f in files.weights:
        if files.pickled:
            state = torch.load(f, map_location="cpu", weights_only=True)
            for k, v in state.items():
                yield k, (lambda v=v: v), tuple(v.shape), str(v.dtype)
            continue
        try:
            handle = safe_open(str(f), framework="pt")
            for k in handle.keys():
                sl = handle.get_slice(k)
                yield k, (lambda h=handle, k=k: h.get_tensor(k)), tuple(sl.get_shape()), sl.get_dtype()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 (safetensors raises SafetensorError or OSError on bad files)
            raise CheckpointError(f"cannot read {f}: {e}. The file is truncated or not safetensors; "
                                  "download it again") from None


def read_header(files: CheckpointFiles) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` from the headers alone."""
    return {k: (shape, dt) for k, _, shape, dt in _iter_tensors(files)}


def detect_layout(keys) -> str:
    keys = list(keys)
    if any(k.startswith(MIDLAYER_PREFIX) for k in keys):
        return "midlayer"
    if any(k.startswith("layers.") for k in keys):
        return "speculators"
    raise CheckpointError("the checkpoint has neither midlayer.* nor layers.0.* keys: not an EAGLE-3 drafter")


def to_model_key(key: str, layout: str) -> str:
    if layout == "midlayer" and key.startswith(MIDLAYER_PREFIX):
        return SPECULATORS_PREFIX + key[len(MIDLAYER_PREFIX):]
    return key


def to_midlayer_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators keys -> SpecForge/AQ-MedAI keys, without the verifier-owned tensors."""
    out = {}
    for k, v in state.items():
        if k in VERIFIER_OWNED:
            continue
        if k.startswith("layers."):
            if not k.startswith(SPECULATORS_PREFIX):
                raise CheckpointError(f"{k}: the midlayer layout holds exactly one decoder layer")
            k = MIDLAYER_PREFIX + k[len(SPECULATORS_PREFIX):]
        out[k] = v.contiguous()
    return out


def read_tensors(files: CheckpointFiles, keys: set[str]) -> dict[str, torch.Tensor]:
    """Just the named tensors (e.g. ``d2t``/``t2d``), read without touching the others."""
    return {k: get() for k, get, _, _ in _iter_tensors(files) if k in keys}


def head_shared(header: dict[str, tuple[tuple[int, ...], str]]) -> bool:
    """Whether a drafter ships no ``lm_head`` and no draft vocabulary: vLLM then drafts the whole vocabulary
    through the verifier's own head (``process_eagle_weight``), as a ModelOpt export read without its head does.
    A drafter built for the whole vocabulary starts from those very rows (speculators' ``load_verifier_weights``),
    so such a parent loads as the drafter vLLM serves from it."""
    return not {"lm_head.weight", "d2t", "t2d"} & set(header)


def full_vocabulary(header: dict[str, tuple[tuple[int, ...], str]], verifier_vocab: int) -> bool:
    """Whether a drafter's draft vocabulary is the verifier's whole vocabulary with no ``d2t``/``t2d`` shipped
    (lightseekorg/kimi-k2.5-eagle3-mla: vLLM then maps draft row *i* to token *i*), its own ``lm_head`` or the
    verifier's (:func:`head_shared`)."""
    if head_shared(header):
        return True
    rows = header.get("lm_head.weight", ((0,), ""))[0][0]
    return "d2t" not in header and "t2d" not in header and rows == verifier_vocab


def draft_vocab(files: CheckpointFiles, verifier_vocab: int) -> dict[str, torch.Tensor]:
    """A drafter checkpoint's ``d2t``/``t2d``; for a full-vocabulary drafter that ships neither
    (:func:`full_vocabulary`), the identity map it means. Raises :class:`CheckpointError` for neither."""
    vocab = read_tensors(files, {"d2t", "t2d"})
    if not vocab and full_vocabulary(read_header(files), verifier_vocab):
        return {"d2t": torch.zeros(verifier_vocab, dtype=torch.long),
                "t2d": torch.ones(verifier_vocab, dtype=torch.bool)}
    if set(vocab) != {"d2t", "t2d"}:
        raise CheckpointError(f"{files.root} has no d2t/t2d and its lm_head does not cover the verifier's "
                              f"{verifier_vocab} tokens: not an EAGLE-3 drafter with a draft vocabulary")
    return vocab


def _hint(key: str) -> str:
    if key.startswith(("fc.", "layers.", "norm.")):
        return " — parent trained for another verifier?"
    if key in ("lm_head.weight", "d2t"):
        return " — another draft vocabulary size? (vocab=rebuild remaps lm_head rows)"
    if key == "t2d":
        return " — parent made for a verifier with another vocabulary?"
    return ""


def match_keys(header: dict[str, tuple[tuple[int, ...], str]], shapes: dict[str, tuple[int, ...]], *,
               root: Path | str, rebuild: bool = False) -> tuple[dict[str, str], list[str]]:
    """``({parent key: drafter key}, skipped parent keys)`` for a parent ``header`` against the drafter's
    ``shapes`` (``{key: shape}``, e.g. of a model on the meta device); one :class:`CheckpointError` lists every
    key that does not fit, with the shapes and the fix. ``rebuild`` (vocab=rebuild): ``d2t``/``t2d`` are not
    taken from the parent and ``lm_head`` may have another row count (its rows are remapped), not another width.
    """
    layout = detect_layout(header)
    problems: list[str] = []
    mapped: dict[str, str] = {}
    skipped: list[str] = []
    for key, (shape, _dtype) in header.items():
        target = to_model_key(key, layout)
        if target in VERIFIER_OWNED or (rebuild and target in ("d2t", "t2d")):
            skipped.append(key)
            continue
        if target not in shapes:
            problems.append(f"{key}: unexpected key (no {target} in the drafter)")
            continue
        want = tuple(shapes[target])
        if rebuild and target == "lm_head.weight":
            if len(shape) != 2 or shape[1:] != want[1:]:
                problems.append(f"{key}: parent {list(shape)}, model [*, {want[1]}] — parent trained for a "
                                "verifier of another hidden size?")
                continue
        elif shape != want:
            problems.append(f"{key}: parent {list(shape)}, model {list(want)}{_hint(target)}")
            continue
        mapped[key] = target
    required = {k for k in shapes if k not in VERIFIER_OWNED}
    if rebuild or full_vocabulary(header, shapes.get("t2d", (0,))[0]):  # the built vocabulary stays
        required -= {"d2t", "t2d"}
    if head_shared(header):  # the head as built: the verifier's rows
        required -= {"lm_head.weight"}
    for missing in sorted(required - set(mapped.values())):
        if missing not in {to_model_key(k, layout) for k in header}:
            problems.append(f"{missing}: missing from the parent")
    if problems:
        raise ParentMismatch(f"parent {root} does not fit the drafter ({len(problems)} problem"
                              f"{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(problems)
                              + "\nChoose a parent made for this verifier and draft vocabulary (vocab=rebuild "
                              "for another vocabulary), or init=random")
    return mapped, skipped


def model_shapes(model) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a drafter's weights (non-persistent buffers, e.g. rotary inv_freq, are not weights)."""
    persistent = set(model.state_dict().keys())
    return {k: tuple(t.shape) for k, t in [*model.named_parameters(), *model.named_buffers()] if k in persistent}


def load_into_model(model, files: CheckpointFiles, *, lm_head_remap=None) -> LoadReport:
    """Copy every parent tensor into ``model`` (strict keys and shapes); verifier-owned keys are skipped.

    ``lm_head_remap`` is a callable ``old_lm_head -> new_lm_head`` (the vocab=rebuild policy); ``d2t``/``t2d``
    then stay as the model was built (the new vocabulary) instead of being taken from the parent.
    """
    header = read_header(files)
    layout = detect_layout(header)
    persistent = set(model.state_dict().keys())  # non-persistent buffers (rotary inv_freq) are not weights
    params = {k: t for k, t in [*model.named_parameters(), *model.named_buffers()] if k in persistent}
    report = LoadReport(layout=layout, key_remap=key_remap(layout))
    mapped, report.skipped = match_keys(header, model_shapes(model), root=files.root,
                                        rebuild=lm_head_remap is not None)
    report.lm_head_from_verifier = head_shared(header)

    with torch.no_grad():
        for key, get, _, _ in _iter_tensors(files):
            target = mapped.get(key)
            if target is None:
                continue
            tensor = get()
            if target == "lm_head.weight" and lm_head_remap is not None:
                tensor = lm_head_remap(tensor)
                report.remapped_lm_head = True
            dest = params[target]
            if dest.dtype == torch.bool or not dest.is_floating_point():
                if tensor.dtype != dest.dtype:
                    raise CheckpointError(f"{key}: dtype {tensor.dtype}, the drafter needs {dest.dtype}")
            dest.data.copy_(tensor)
            report.loaded.append(key)
            del tensor
    return report


