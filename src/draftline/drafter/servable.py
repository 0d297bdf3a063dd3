"""The one check a drafter directory passes before a vLLM host loads it: ``pull`` (and ``serve``, which pulls)
refuses to put it in place, ``observe`` refuses to attribute a server's traffic to it.

Two things vLLM would get wrong without a word:

- aux-layer ids its two runners read differently, or not at all (:func:`draftline.drafter.aux_ids.require_served_ids`):
  a GPU host would capture other layers than the drafter was trained and measured on;
- a config saying ``fc_norm: true`` (EAGLE 3.1) whose tensors hold no ``fc_norm.{i}.weight`` per aux layer
  (:func:`draftline.drafter.form.check_tensors`): vLLM loads it and leaves the missing norms at ones. The other
  way round (``fc_norm.*`` tensors, a config without the flag) vLLM refuses at load itself, in its own words.

Light on purpose (no torch, no safetensors, no numpy): the tensor names come from the files' safetensors headers.
"""

from __future__ import annotations

from pathlib import Path

from draftline.drafter.aux_ids import FIX, aux_ids_by_runner, require_served_ids
from draftline.drafter.form import EagleForm, check_tensors
from draftline.safetensors_header import file_header


def tensor_names(directory: Path) -> list[str]:
    """Every tensor name in the directory's ``*.safetensors`` files, from their headers."""
    return [name for path in sorted(directory.glob("*.safetensors")) for name in file_header(path)]


def require_servable(directory: str | Path) -> None:
    """Refuse (:class:`CheckpointError`, one line naming the file and the fix) a drafter directory vLLM would
    serve other than as it was trained: aux layers its runners read apart, or 3.1's norms missing."""
    directory = Path(directory)
    config = require_served_ids(directory)
    form = EagleForm.of_config(config)
    if not form.fc_norm:  # nothing vLLM would load silently wrong: the headers need not be read
        return
    ids = aux_ids_by_runner(config)["v1"] or ()
    check_tensors(str(directory), form, tensor_names(directory), len(ids), fix=FIX)
