"""Prepared data on disk: safetensors shards of packed samples plus a manifest.

Each shard holds its samples back to back: ``input_ids`` [T], ``loss_mask`` [T] (uint8), ``hidden_states``
[T, aux*H] (bf16), ``verifier_last_hidden_states`` [T, H] (bf16) and ``offsets`` [n+1]; per token that is
(aux+1) x H x 2 bytes of hidden state. With ``--hidden-storage fp8`` both hidden-state tensors are E4M3 with a
float32 scale per token and layer beside them (``hidden_states_scale`` [T, aux], ``verifier_last_hidden_states_scale``
[T, 1]; :mod:`draftline.data.fp8`), half the bytes, read back to bf16 sample by sample. ``manifest.json`` names
the verifier, the layer ids, the shapes, the storage, the counts, each shard's sha256, and the data digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftline.data import fp8
from draftline.data.inputs import MANIFEST, read_manifest
from draftline.data.storage import token_bytes
from draftline.data.verify import verify_all
from draftline.disk_space import require_free, room_for
from draftline.errors import DataError
from draftline.util import atomic_write_text, file_sha256
from draftline.util import exclusive as lock

FREQS = "token_freqs.safetensors"
FORMAT_VERSION = 1


HIDDEN = ("hidden_states", "verifier_last_hidden_states")


def write_shard(path: Path, records: list[dict[str, torch.Tensor]], storage: str = "bf16") -> dict:
    """Write one shard atomically (temp file + rename), its hidden states in ``storage`` (bf16, or fp8: E4M3
    with a scale per token and layer); returns its manifest entry."""
    lengths = [int(r["input_ids"].numel()) for r in records]
    offsets = torch.zeros(len(records) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    tensors = {
        "input_ids": torch.cat([r["input_ids"] for r in records]),
        "loss_mask": torch.cat([r["loss_mask"] for r in records]).to(torch.uint8),
        "hidden_states": torch.cat([r["hidden_states"] for r in records]),
        "verifier_last_hidden_states": torch.cat([r["verifier_last_hidden_states"] for r in records]),
        "offsets": offsets,
    }
    if storage == "fp8":
        hidden = tensors["verifier_last_hidden_states"].shape[-1]
        for name in HIDDEN:
            tensors[name], tensors[name + fp8.SCALE_SUFFIX] = fp8.quantize(tensors[name], hidden)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return {"file": path.name, "samples": len(records), "tokens": int(offsets[-1]),
            "masked_tokens": int(tensors["loss_mask"].sum()), "sha256": file_sha256(path)}


PROGRESS = "progress.json"


def exclusive(out_dir: Path):
    """Hold ``out_dir/.lock``: one prepare writes a data directory at a time."""
    return lock(out_dir / ".lock", busy=f"another prepare is writing {out_dir}; wait for it or choose another "
                                       "--output-dir")


class ShardWriter:
    """Streams records into shards of about ``shard_tokens`` tokens, written atomically; after each shard
    ``progress.json`` records it, so a prepare interrupted at any point resumes after its last finished shard.

    ``key`` names everything the shards depend on; a directory holding shards for another key is refused.
    Shards close only at :meth:`boundary` calls (the caller's batch boundaries), so a resumed run starts on the
    same batch as an uninterrupted one and writes the same bytes.
    """

    def __init__(self, out_dir: Path, key: str, shard_tokens: int, vocab_size: int, *, check_room: bool = True,
                 storage: str = "bf16"):
        self.out_dir, self.key, self.shard_tokens = Path(out_dir), key, shard_tokens
        self.check_room, self.storage = check_room, storage
        self.freqs = torch.zeros(vocab_size, dtype=torch.long)
        self.entries: list[dict] = []
        self.pending: list[dict[str, torch.Tensor]] = []
        self.pending_tokens = 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._resume()

    def _resume(self) -> None:
        path = self.out_dir / PROGRESS
        if not path.is_file():
            if any(self.out_dir.glob("shard-*.safetensors")):
                raise DataError(f"{self.out_dir} holds shards but no {PROGRESS}: choose an empty --output-dir")
            return
        state = json.loads(path.read_text())
        if state.get("key") != self.key:
            raise DataError(f"{self.out_dir} holds data prepared with other inputs or settings (key "
                            f"{str(state.get('key'))[:12]}…, this run {self.key[:12]}…): choose another "
                            "--output-dir or delete that one")

        for entry in state["shards"]:  # keep the finished shards that are intact; redo from the first that is not
            f = self.out_dir / entry["file"]
            if not f.is_file() or file_sha256(f) != entry["sha256"]:
                break
            with safe_open(str(f), framework="pt") as st:
                ids, mask = st.get_tensor("input_ids"), st.get_tensor("loss_mask").bool()
            self.freqs += torch.bincount(ids[mask], minlength=self.freqs.numel())
            self.entries.append(entry)

    @property
    def done_samples(self) -> int:
        return sum(e["samples"] for e in self.entries)

    @property
    def done_tokens(self) -> int:
        return sum(e["tokens"] for e in self.entries)

    def add(self, record: dict[str, torch.Tensor]) -> None:
        self.freqs += torch.bincount(record["input_ids"][record["loss_mask"]], minlength=self.freqs.numel())
        self.pending.append(record)
        self.pending_tokens += record["input_ids"].numel()

    def boundary(self, final: bool = False) -> None:
        if self.pending and (final or self.pending_tokens >= self.shard_tokens):
            path = self.out_dir / f"shard-{len(self.entries):05d}.safetensors"
            kept = (f"{len(self.entries)} finished shards are kept in {self.out_dir}; free space there and run the "
                    "same prepare again: it resumes after them")
            if self.check_room:  # a disk that filled since the run began stops it before a shard, not inside one
                first = self.pending[0]
                hidden = first["verifier_last_hidden_states"].shape[-1]
                need = self.pending_tokens * token_bytes(hidden, first["hidden_states"].shape[-1] // hidden,
                                                         self.storage)
                require_free(self.out_dir, int(need * 1.05) + (1 << 20), what=f"the next shard ({path.name})",
                             fix=kept)
            try:
                with room_for(self.out_dir, space_fix=kept, size_fix=kept):
                    entry = write_shard(path, self.pending, self.storage)
            finally:
                path.with_suffix(".tmp").unlink(missing_ok=True)  # a shard cut short by a full disk
            self.entries.append(entry)
            self.pending, self.pending_tokens = [], 0
            atomic_write_text(self.out_dir / PROGRESS, json.dumps({"key": self.key, "shards": self.entries},
                                                                   indent=1))


def data_digest(manifest: dict) -> str:
    """sha256 over what defines the data: verifier, layers, and every shard's bytes (via their sha256)."""
    key = {"verifier": manifest["verifier"], "aux_layer_ids": manifest["aux_layer_ids"],
           "shards": [s["sha256"] for s in manifest["shards"]]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def write_manifest(out_dir: Path, manifest: dict) -> dict:
    manifest = {**manifest, "digest": data_digest(manifest)}
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


@dataclass
class PreparedData:
    root: Path  # manifest and token frequencies
    manifest: dict
    shard_root: Path | None = None  # where the shards are: root, or the location the manifest names

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    def token_freqs(self) -> torch.Tensor:
        return load_file(str(self.root / FREQS))["freqs"]

    def sample_lengths(self) -> list[int]:
        """Every sample's token count, from the shards' offsets alone (no hidden state is read)."""
        out: list[int] = []
        for entry in self.manifest["shards"]:
            path = (self.shard_root or self.root) / entry["file"]
            try:
                with safe_open(str(path), framework="pt") as f:
                    offs = f.get_tensor("offsets").tolist()
            except Exception as e:  # noqa: BLE001
                raise DataError(f"cannot read shard {path}: {e}") from None
            out += [b - a for a, b in zip(offs[:-1], offs[1:])]
        return out

    def records(self) -> list[Mapping[str, torch.Tensor]]:
        """Every sample as views into memory-mapped shards (nothing is copied until used)."""
        out: list[Mapping[str, torch.Tensor]] = []
        for entry in self.manifest["shards"]:
            path = (self.shard_root or self.root) / entry["file"]
            if not path.is_file():
                raise DataError(f"shard {path} is missing; prepare the data again or download it whole")
            try:
                with safe_open(str(path), framework="pt") as f:
                    t = {k: f.get_tensor(k) for k in f.keys()}
            except Exception as e:  # noqa: BLE001
                raise DataError(f"cannot read shard {path}: {e}") from None
            offs = t["offsets"].tolist()
            for a, b in zip(offs[:-1], offs[1:]):
                if "hidden_states" + fp8.SCALE_SUFFIX in t:
                    out.append(Fp8Sample(t, a, b))
                    continue
                out.append({
                    "input_ids": t["input_ids"][a:b],
                    "loss_mask": t["loss_mask"][a:b].to(torch.bool),
                    "hidden_states": t["hidden_states"][a:b],
                    "verifier_last_hidden_states": t["verifier_last_hidden_states"][a:b],
                })
        return out


class Fp8Sample(Mapping):
    """A sample of an fp8 shard, read as a bf16 one: its hidden states are dequantized each time they are read,
    so only the batch being built holds them in bf16 (the shard stays memory-mapped at half the bytes)."""

    KEYS = ("input_ids", "loss_mask", *HIDDEN)

    def __init__(self, tensors: dict[str, torch.Tensor], start: int, end: int):
        self.t, self.a, self.b = tensors, start, end

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in HIDDEN:
            return fp8.dequantize(self.t[key][self.a:self.b], self.t[key + fp8.SCALE_SUFFIX][self.a:self.b])
        if key == "loss_mask":
            return self.t[key][self.a:self.b].to(torch.bool)
        if key == "input_ids":
            return self.t[key][self.a:self.b]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)


def _shard_root(data_dir: Path, manifest: dict) -> Path:
    names = [e["file"] for e in manifest["shards"]]
    candidates = [data_dir] + ([Path(manifest["location"])] if manifest.get("location") else [])
    for root in candidates:
        if all((root / n).is_file() for n in names):
            return root
    where = f" nor at {manifest['location']}" if manifest.get("location") else ""
    raise DataError(f"the shards of data {manifest.get('digest', '?')[:12]} are neither in {data_dir}{where}: "
                    "prepare keeps shards where it wrote them and logs only their location, so run finetune "
                    "where that path is mounted, or prepare with --log-shards to copy them into MLflow")


def open_prepared(data_dir: Path, *, verify: bool = False) -> PreparedData:
    """The prepared data at ``data_dir`` (its shards there, or where the manifest says prepare wrote them);
    ``verify`` checks every shard against the sha256 the manifest (and so the data digest) names."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    shard_root = _shard_root(data_dir, manifest)
    if data_digest(manifest) != manifest.get("digest"):
        raise DataError(f"{data_dir / MANIFEST} does not match its own digest: it was edited; prepare again")
    data = PreparedData(data_dir, manifest, shard_root)
    if verify:
        verify_all(data)
    return data
