"""A safetensors file's header, read as its format lays it out (8 bytes of little-endian length, then that many
bytes of JSON) from whatever reads the file's bytes: a local file, or range requests to an artifact store.
safetensors' own Python reader imports numpy or torch even to list the keys; the light install (``pull``,
``serve``, ``observe``) carries neither, and ``inspect`` reads remote headers without downloading the tensors."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from draftline.errors import CheckpointError


def parse_safetensors_header(read: Callable[[int, int], bytes], where: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` from a safetensors file's header; ``read(length, offset)`` returns the file's
    bytes, ``where`` names it in an error."""
    head = read(8, 0)
    if len(head) != 8:
        raise CheckpointError(f"{where} is shorter than a safetensors header")
    (size,) = struct.unpack("<Q", head)
    if size > 100 << 20:
        raise CheckpointError(f"{where} claims a {size}-byte header: not a safetensors file")
    try:
        header = json.loads(read(size, 8))
    except ValueError as e:
        raise CheckpointError(f"{where}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: the safetensors header is not a JSON object")
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def file_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """The header of a local safetensors file."""
    with open(path, "rb") as f:
        def read(length: int, offset: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return parse_safetensors_header(read, str(path))
