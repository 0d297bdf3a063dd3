"""What a person sees on the terminal: quiet by default, loud on request.

At the default verbosity (``DRAFTLINE_LOG`` unset or ``warning``) the libraries' warnings (FutureWarning,
UserWarning from transformers, torch, mlflow), MLflow's INFO lines, Hugging Face and MLflow download bars,
loguru (speculators) and DeepSpeed below ERROR are all off; ``-v`` (``DRAFTLINE_LOG=info``) brings them back,
``-vv`` (``DRAFTLINE_LOG=debug``) adds DEBUG. The choice travels to child processes (DeepSpeed's launcher and its
ranks, the runs ``main`` starts) through the environment. draftline's own progress bars show on a terminal only,
and only for work that lasts more than a second.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from draftline import environment

LOG_ENV = environment.LOG.name
LEVELS = ("warning", "info", "debug")
BAR_DELAY_S = 1.0  # a bar appears only for work that lasts longer than this


def level() -> str:
    value = environment.LOG.get()
    return value if value in LEVELS else "warning"


def verbose() -> bool:
    """Whether this process shows what -v asks for (info and debug), not only warnings."""
    return level() != "warning"


def configure(verbose: int = 0) -> str:
    """Set the verbosity for this process and its children (``verbose``: the count of ``-v`` flags; 0 leaves
    ``DRAFTLINE_LOG`` as it is). Call before torch, transformers, mlflow or deepspeed are imported."""
    if verbose:
        environment.LOG.set(LEVELS[min(verbose, 2)])
    name = level()
    environment.LOG.set(name)
    py_level = getattr(logging, name.upper())
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if name == "warning":
        env.update({"PYTHONWARNINGS": "ignore", "MLFLOW_LOGGING_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
                    "LOGURU_LEVEL": "ERROR", "DATASETS_VERBOSITY": "error"})
        warnings.simplefilter("ignore")
        for key, value in env.items():
            os.environ.setdefault(key, value)
    else:
        env.update({"MLFLOW_LOGGING_LEVEL": name.upper(), "LOGURU_LEVEL": name.upper(),
                    "TRANSFORMERS_VERBOSITY": "info" if name == "debug" else "warning"})
        warnings.simplefilter("default")
        for key, value in env.items():
            os.environ[key] = value
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # a no-op where a handler exists
    logging.getLogger().setLevel(py_level)
    for chatty in ("httpx", "httpcore", "urllib3", "alembic"):  # one line per HTTP request or migration otherwise
        logging.getLogger(chatty).setLevel(logging.DEBUG if name == "debug" else logging.WARNING)
    logging.getLogger("mlflow").setLevel(py_level)  # in case mlflow is imported already
    # DeepSpeed resets its logger's level when imported; a filter stays (its "Setting accelerator to CPU")
    ds = logging.getLogger("DeepSpeed")
    for f in [f for f in ds.filters if isinstance(f, _AtLeast)]:
        ds.removeFilter(f)
    ds.addFilter(_AtLeast(logging.ERROR if name == "warning" else py_level))
    return name


class _AtLeast(logging.Filter):
    def __init__(self, minimum: int):
        super().__init__()
        self.minimum = minimum

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.minimum


def bar_kwargs(progress: bool = True) -> dict:
    """tqdm keyword arguments for draftline's own bars: on a terminal only, after a second."""
    return {"disable": not (progress and _tty()), "delay": BAR_DELAY_S}


def _tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


PREFIX = "[draftline] "  # every line draftline itself prints starts so (the ranks' relay keeps only those)


def say(message: str) -> None:
    """One line for the person at the terminal, ``[draftline] `` first (stderr: stdout carries the command's
    result). Every line draftline prints goes through here."""
    print(PREFIX + message, file=sys.stderr, flush=True)
