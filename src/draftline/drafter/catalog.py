"""The parent catalog (``configs/parents.yaml``, or ``$DRAFTLINE_PARENTS``): the names ``--init`` takes, each with
its source, revision and layout; and what can be told of an ``--init`` value without loading anything (YAML and
pydantic only, so a command checks it before its heavy stage loads). Finding and fetching a parent is
:mod:`draftline.drafter.parents`."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftline import environment
from draftline.config import shipped
from draftline.errors import ConfigError, ParentNotFound

RANDOM = ("", "random", "none")
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


class CatalogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    revision: str = "main"
    layout: str = Field("midlayer", pattern="^(midlayer|speculators)$")
    verifier: str | None = None
    description: str = ""
    local_dirs: list[str] = Field(default_factory=list)
    # whose layers its aux-layer ids name (drafter/aux_ids.py): vllm, the input of layer i; sglang, the output
    aux_convention: str | None = Field(None, pattern="^(vllm|sglang)$")


def catalog_path() -> Path:
    return Path(environment.PARENTS.get() or shipped("configs", "parents.yaml"))


def load_catalog(path: Path | None = None) -> dict[str, CatalogEntry]:
    path = path or catalog_path()
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        return {k: CatalogEntry(**v) for k, v in (raw.get("parents") or {}).items()}
    except FileNotFoundError:
        raise ConfigError(f"parent catalog {path} does not exist (set {environment.PARENTS.name})") from None
    except (yaml.YAMLError, ValidationError, TypeError, AttributeError) as e:
        raise ConfigError(f"parent catalog {path} is invalid: {e}") from None


def not_a_parent(init: str, catalog: dict[str, CatalogEntry], *, offline: bool = False) -> ParentNotFound:
    """The one line for an ``--init`` that names nothing draftline can find."""
    near = difflib.get_close_matches(init, list(catalog), n=1)
    return ParentNotFound(
        f"init '{init}' is not 'random', a catalog name ({', '.join(sorted(catalog))}), a local directory, a "
        "Hugging Face repo id, or a models:/ URI" + (f"; did you mean '{near[0]}'?" if near else "")
        + ("; HF_HUB_OFFLINE is set, so only the local Hugging Face cache was searched" if offline else ""))


def check_init(init: str) -> None:
    """Refuse an ``--init`` that can be seen to name nothing: not random, a models:/ URI, a catalog name, an
    existing path or something shaped like a Hugging Face repo id (whether that repo exists is the hub's to
    say, later)."""
    init = init.strip()
    if init in RANDOM or init.startswith("models:/"):
        return
    catalog = load_catalog()
    if init in catalog or Path(init).expanduser().exists() or REPO_ID.fullmatch(init):
        return
    raise not_a_parent(init, catalog)
