"""Where a prepared data set comes from: a local directory, or a ``runs:/`` URI downloaded once into the work
directory's cache (artifacts never change, so one copy serves every finetune and evaluation that names it)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from mlflow.exceptions import MlflowException

from draftline import tracking
from draftline.config import work_dir
from draftline.data.inputs import MANIFEST, REMOTE_PREFIXES, check_data_ref
from draftline.errors import DataError
from draftline.mlflow_errors import absent, raise_failure
from draftline.tracking import download, parse_run_ref


def data_cache(ref: str) -> Path:
    """Where the data set ``ref`` is kept once downloaded."""
    return work_dir() / "cache" / "data" / hashlib.sha256(ref.encode()).hexdigest()[:16]


def resolve_data(ref: str, dest: Path | None = None) -> Path:
    """A local prepared-data directory, or ``ref`` downloaded into ``dest`` (default :func:`data_cache`), once;
    concurrent callers each download into a scratch folder and the first to finish wins."""
    if not ref.startswith(REMOTE_PREFIXES):
        check_data_ref(ref)
        return Path(ref).expanduser().resolve()
    dest = dest or data_cache(ref)
    if (dest / MANIFEST).is_file():
        return dest
    _require_finished(ref)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
    try:
        got = download(ref, partial)
        if not (got / MANIFEST).is_file():
            raise DataError(f"data {ref} holds no {MANIFEST}: pass the data_uri that prepare printed")
        with contextlib.suppress(OSError):  # another process may have put it there meanwhile: theirs is as good
            os.replace(got, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def _require_finished(ref: str) -> None:
    """A ``runs:/`` reference to a prepare run that did not finish names that run and the fix."""
    if not ref.startswith("runs:/"):
        return

    run_id = parse_run_ref(ref)[0]
    try:
        run = tracking.client().get_run(run_id)
    except MlflowException as e:
        if absent(e):
            return  # the download below names the missing run
        raise_failure(e, f"read prepare run {run_id}", "READ permission on its experiment")
    if run.info.status != "FINISHED":
        raise DataError(f"data {ref}: prepare run {run_id} is {run.info.status}, not FINISHED; rerun that prepare "
                        "(same inputs: it resumes) and pass the data_uri it prints")


def dataset_name(client, ref: str) -> str:
    """The name prepare gave the data set (its run's dataset input), so the runs that use it log the same name;
    a local directory's folder name."""
    if not ref.startswith("runs:/"):
        return Path(ref).name

    with contextlib.suppress(Exception):
        return client.get_run(parse_run_ref(ref)[0]).inputs.dataset_inputs[0].dataset.name
    return "prepared"
