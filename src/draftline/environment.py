"""Every ``DRAFTLINE_*`` environment variable draftline reads, declared once: its type, its default and what it
does. Code reads a variable through its :class:`Var` (``environment.WORK.get()``), at the moment it needs it, so
a test or a parent process that sets one is heard; a value of the wrong type is one :class:`ConfigError` naming
the variable. The CLI reference's table of variables is :func:`markdown_table` (a test keeps the two equal).

Standard library only: the CLI reads these before anything heavy loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from draftline.errors import ConfigError

T = TypeVar("T")

__all__ = ["VARS", "Var", "check", "markdown_table"]


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    return text.lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var(Generic[T]):
    """One variable: ``name``, how its text is read (``parse``, raising ValueError), the ``default`` when it is
    unset or empty, what it is (``kind``, for messages and the table) and what it does (``help``)."""

    name: str
    parse: Callable[[str], T]
    default: T
    kind: str
    help: str

    def raw(self) -> str:
        return os.environ.get(self.name, "").strip()

    def is_set(self) -> bool:
        return bool(self.raw())

    def get(self) -> T:
        text = self.raw()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ConfigError(f"{self.name}={text!r} is not {self.kind}: set it to {self.kind} or unset it "
                              f"(default: {self.default if self.default not in (None, '') else 'unset'})") from None

    def set(self, value: str) -> None:
        """Set it for this process and the ones it starts (ranks, vLLM, the stages ``main`` runs)."""
        os.environ[self.name] = value


def _var(name: str, parse: Callable[[str], T], default: T, kind: str, help: str) -> Var[T]:
    return Var(f"DRAFTLINE_{name}", parse, default, kind, help)


# where things live
WORK = _var("WORK", str, "work", "a folder", "The work directory: finetune's checkpoints and spec, prepared data "
            "when --output-dir is not given, the parents downloaded from the registry.")
ROOT = _var("ROOT", str, "", "a folder", "The checkout whose configs/ and registry_policies/ are read (default: "
            "the one draftline is installed from, else the installed package's copies).")
CACHE_DIR = _var("CACHE_DIR", str, "", "a folder", "Where the caches live (default ~/.cache/draftline): the pull "
                 "cache's blobs (set: every pull fills it), regenerated answers, built verifiers.")
PARENTS = _var("PARENTS", str, "", "a YAML file", "The parent catalog (default: configs/parents.yaml).")
PARENTS_DIR = _var("PARENTS_DIR", str, "", "a folder", "Where the catalog looks for the hub parents' directories "
                   "(aq-medai, kimi-k25-mla) before the Hugging Face cache.")
TINY_DIR = _var("TINY_DIR", str, "", "a folder", "Where `init=tiny` finds the Llama family's tiny parent "
                "(`draftline make-tiny OUT_DIR`; default work/tiny).")
TINY_KIMI_DIR = _var("TINY_KIMI_DIR", str, "", "a folder", "Where `init=tiny-kimi`, `init=tiny-kimi-mla` and "
                     "`init=tiny-kimi-mla31` find the Kimi family's tiny parents (`draftline make-tiny OUT_DIR "
                     "--family kimi`).")
REGISTRY_POLICIES = _var("REGISTRY_POLICIES", str, "", "a folder or a shipped set", "The team's promotion "
                         "policies, one <stage>.yaml each, or the name of a set draftline ships (`gpu`: gates on "
                         "speed, for a deployment on GPUs); default: the shipped registry_policies/.")
HOST = _var("HOST", str, "", "a name", "The serving host's name in the served.<host>.since/until tags "
            "`draftline serve` records on the versions it serves (default: the hostname).")
# tracking
EXPERIMENT = _var("EXPERIMENT", str, "draftline", "a name", "The MLflow experiment the stages' runs go to.")
# vLLM
VLLM_PYTHON = _var("VLLM_PYTHON", str, "", "a python executable", "The python of the venv with vLLM (default: "
                   ".venv-vllm in the checkout); `off` turns vLLM off.")
VLLM_ARGS = _var("VLLM_ARGS", str, "", "shell-quoted vLLM flags", "Flags for every vLLM draftline starts, as a "
                 "large verifier needs them (`--tensor-parallel-size 8 --trust-remote-code`); recorded in the serve "
                 "line of the versions it exports.")
REGENERATE_API_KEY = _var("REGENERATE_API_KEY", str, "", "a key", "The key of the regenerating or capturing "
                          "vLLM endpoint (else OPENAI_API_KEY); never logged.")
TRUST_REMOTE_CODE = _var("TRUST_REMOTE_CODE", str, "", "folders", "The verifier directories this process was "
                         "told to trust (--trust-remote-code), carried to the processes it starts; set by draftline.")
# output
def _level(text: str) -> str:
    if text.lower() not in ("warning", "info", "debug"):
        raise ValueError(text)
    return text.lower()


LOG = _var("LOG", _level, "", "warning, info or debug", "How much the libraries say: warning (quiet, the "
           "default), info (-v) or debug (-vv).")
VERBOSE = _var("VERBOSE", _flag, False, "0 or 1", "1: every rank's whole output (as -vv).")
PROGRESS_S = _var("PROGRESS_S", _seconds, 10.0, "seconds", "How often a finetune without a terminal prints its "
                  "progress line.")
# waiting and giving up
TRACKING_WAIT_S = _var("TRACKING_WAIT_S", _seconds, 600.0, "seconds", "How long a finetune waits for a tracking "
                       "server that went away before it stops (its metrics are kept and sent when it returns).")
STOP_GRACE_S = _var("STOP_GRACE_S", _seconds, 600.0, "seconds", "How long finetune waits for its ranks to save "
                    "after SIGTERM before it kills them.")
RETRY_S = _var("RETRY_S", _seconds, 120.0, "seconds", "How long pull, promote and export retry a tracking server "
               "that does not answer.")
PROMOTION_WAIT_S = _var("PROMOTION_WAIT_S", _seconds, 120.0, "seconds", "How long a promoter waits for another's "
                        "promotion lock.")
NODE_STALE_S = _var("NODE_STALE_S", _seconds, 30.0, "seconds", "How long a node of a multi-node finetune may go "
                    "silent before the others stop the job.")

VARS: tuple[Var, ...] = (WORK, ROOT, CACHE_DIR, PARENTS, PARENTS_DIR, TINY_DIR, TINY_KIMI_DIR, REGISTRY_POLICIES,
                         HOST, EXPERIMENT, VLLM_PYTHON, VLLM_ARGS, REGENERATE_API_KEY, TRUST_REMOTE_CODE, LOG, VERBOSE,
                         PROGRESS_S, TRACKING_WAIT_S, STOP_GRACE_S, RETRY_S, PROMOTION_WAIT_S, NODE_STALE_S)


def check() -> None:
    """Read every variable once: a value of the wrong type is refused before any work begins."""
    for v in VARS:
        v.get()


def markdown_table() -> str:
    """The variables as the CLI reference shows them."""
    rows = ["| variable | value | default | what it does |", "| --- | --- | --- | --- |"]
    for v in VARS:
        default = {False: "0", "": "unset"}.get(v.default, v.default) if not isinstance(v.default, float) else \
            f"{v.default:g}"
        rows.append(f"| `{v.name}` | {v.kind} | {default} | {v.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # the CLI reference's table: python -m draftline.environment
    print(markdown_table(), end="")
