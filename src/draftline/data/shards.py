"""Prepared data on disk: safetensors shards of packed samples plus a manifest.

Each shard holds its samples back to back: ``input_ids`` [T], ``loss_mask`` [T] (uint8), ``hidden_states``
[T, aux*H] (bf16), ``verifier_last_hidden_states`` [T, H] (bf16) and ``offsets`` [n+1]; per token that is
(aux+1) x H x 2 bytes of hidden state, the bf16 minimum. ``manifest.json`` names the verifier, the layer ids,
the shapes, the counts, each shard's sha256, and the data digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from draftline.checkpoints import file_sha256
from draftline.errors import DataError

MANIFEST = "manifest.json"
FREQS = "token_freqs.safetensors"
FORMAT_VERSION = 1


def write_shard(path: Path, records: list[dict[str, torch.Tensor]]) -> dict:
    """Write one shard atomically (temp file + rename); returns its manifest entry."""
    from safetensors.torch import save_file

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
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return {"file": path.name, "samples": len(records), "tokens": int(offsets[-1]),
            "masked_tokens": int(tensors["loss_mask"].sum()), "sha256": file_sha256(path)}


def data_digest(manifest: dict) -> str:
    """sha256 over what defines the data: verifier, layers, and every shard's bytes (via their sha256)."""
    key = {"verifier": manifest["verifier"], "aux_layer_ids": manifest["aux_layer_ids"],
           "shards": [s["sha256"] for s in manifest["shards"]]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def write_manifest(out_dir: Path, manifest: dict) -> dict:
    manifest = {**manifest, "digest": data_digest(manifest)}
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out_dir / MANIFEST)
    return manifest


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{data_dir} has no {MANIFEST}: pass the output of `draftline prepare` "
                        "(runs:/<prepare run id>/data or its local directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); prepare the data again") from None


@dataclass
class PreparedData:
    root: Path
    manifest: dict

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    def token_freqs(self) -> torch.Tensor:
        from safetensors.torch import load_file

        return load_file(str(self.root / FREQS))["freqs"]

    def records(self) -> list[dict[str, torch.Tensor]]:
        """Every sample as views into memory-mapped shards (nothing is copied until used)."""
        from safetensors import safe_open

        out = []
        for entry in self.manifest["shards"]:
            path = self.root / entry["file"]
            if not path.is_file():
                raise DataError(f"shard {path} is missing; prepare the data again or download it whole")
            try:
                with safe_open(str(path), framework="pt") as f:
                    t = {k: f.get_tensor(k) for k in f.keys()}
            except Exception as e:  # noqa: BLE001
                raise DataError(f"cannot read shard {path}: {e}") from None
            offs = t["offsets"].tolist()
            for a, b in zip(offs[:-1], offs[1:]):
                out.append({
                    "input_ids": t["input_ids"][a:b],
                    "loss_mask": t["loss_mask"][a:b].to(torch.bool),
                    "hidden_states": t["hidden_states"][a:b],
                    "verifier_last_hidden_states": t["verifier_last_hidden_states"][a:b],
                })
        return out


def open_prepared(data_dir: Path, *, verify: bool = False) -> PreparedData:
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    if verify:
        for entry in manifest["shards"]:
            if file_sha256(data_dir / entry["file"]) != entry["sha256"]:
                raise DataError(f"shard {entry['file']} in {data_dir} does not match its manifest sha256")
    return PreparedData(data_dir, manifest)
