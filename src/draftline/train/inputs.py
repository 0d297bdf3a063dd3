"""What finetune can check from the files its settings name, before torch, DeepSpeed or MLflow load: the data
and evaluation sets (a directory with a readable manifest, or a remote URI), the hostfile, the node's place in
a per-node job, and the DeepSpeed
config file (JSON whose sections are objects; DeepSpeed's own config class checks the rest in
``preflight.check_ds_config``, once it loads), and the parent's name. Standard library, YAML and pydantic only."""

from __future__ import annotations

import json
from pathlib import Path

from draftline.config import FinetuneConfig, shipped
from draftline.data.inputs import check_data_ref
from draftline.drafter.catalog import check_init
from draftline.errors import ConfigError, DataError, all_of
from draftline.train.nodes import Place, place


def check_visible(cfg: FinetuneConfig) -> None:
    """Every mistake the settings' files and names show, in one :class:`DraftlineError` (each naming the file
    or flag that is wrong and the fix): the data, the evaluation set, the parent, the hostfile, the node's
    place, the DeepSpeed config."""
    def hostfile() -> None:
        if cfg.hostfile and not Path(cfg.hostfile).is_file():
            raise DataError(f"hostfile {cfg.hostfile} does not exist: pass --hostfile <a DeepSpeed hostfile>")

    def eval_data() -> None:
        if cfg.eval_data:
            check_data_ref(cfg.eval_data)

    all_of([lambda: check_data_ref(cfg.data), eval_data, lambda: check_init(cfg.init), hostfile,
            lambda: job_place(cfg), lambda: read_ds_config_file(ds_config_path(cfg))])


def job_place(cfg: FinetuneConfig) -> Place:
    """This node's place in the job, from the settings or what the cluster set (:mod:`draftline.train.nodes`)."""
    return place(nnodes=cfg.nnodes, node_rank=cfg.node_rank, master_addr=cfg.master_addr,
                 master_port=cfg.master_port, hostfile=cfg.hostfile)


def ds_config_path(cfg: FinetuneConfig) -> Path:
    """The DeepSpeed config file a finetune starts from: ``--ds-config``, or the shipped one for its stage."""
    return Path(cfg.ds_config) if cfg.ds_config else shipped("configs", f"zero{max(cfg.zero_stage, 1)}.json")


def read_ds_config_file(path: Path) -> dict:
    """The file as JSON, its ``zero_optimization``, ``optimizer`` and ``optimizer.params`` objects."""
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist: pass --ds-config <a JSON file>")
    try:
        conf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"DeepSpeed config {path} is unreadable ({e}); pass ds_config=<a JSON file>") from None
    bad = next((k for k in ("zero_optimization", "optimizer") if not isinstance(conf.get(k, {}), dict)), None) \
        if isinstance(conf, dict) else "the file"
    if bad or not isinstance((conf.get("optimizer") or {}).get("params", {}), dict):
        raise ConfigError(f"DeepSpeed config {path}: {bad or 'optimizer.params'} must be a JSON object (see "
                          "configs/zero2.json); pass ds_config=<a DeepSpeed JSON config>")
    return conf
