"""Typed settings of each stage. Field descriptions are the CLI's help; unknown keys are refused.

Precedence is flag > config file > default, applied by :func:`resolve` (pure: it never reads argv).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftline import environment
from draftline.errors import ConfigError, UsageError

MODEL_NAME_RULE = "letters a-z A-Z, digits 0-9, '-', '_' and '.', beginning with a letter or digit"
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_model_name(name: str) -> str:
    """The one rule for registered model names, in every command that takes one (export, main, promote,
    rollback, pull, list, compare, lineage): exactly :data:`MODEL_NAME_RULE`, so the name is safe in
    ``models:/NAME/VERSION`` URIs, shell commands and file names. Returns ``name``; raises :class:`UsageError`."""
    if _MODEL_NAME.fullmatch(name):
        return name
    odd = sorted({c for c in name if not _MODEL_NAME.fullmatch("a" + c)})
    why = ("it is empty" if not name else
           "it has " + ", ".join("a space" if c == " " else repr(c) for c in odd) if odd else
           f"it begins with {name[0]!r}")
    raise UsageError(f"{name!r} cannot be a registered model name ({why}): use only {MODEL_NAME_RULE}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


AuxConvention = Literal["auto", "vllm", "sglang"]
AUX_CONVENTION_HELP = ("Whose layers the parent's aux-layer ids name: vllm (the input of layer i: vLLM, speculators, "
                       "draftline) or sglang (the output of layer i: SpecForge, ModelOpt, TorchSpec). auto: the "
                       "catalog's, draftline's registry or config, speculators' format; else refused.")


class PrepareConfig(_Strict):
    conversations: str = Field(description="Conversations or prompts: a JSONL/JSON file or a Hugging Face "
                               "dataset directory (save_to_disk) of OpenAI `messages`, ShareGPT `conversations`, "
                               "MT-Bench `turns` or plain `prompt` records. Records without an assistant turn "
                               "(prompts) need --regenerate-endpoint.")
    skip_bad_records: bool = Field(False, description="Skip malformed records (invalid JSON, unknown roles, empty "
                                   "assistant turns) and make repeated ids unique, counting them in the manifest, "
                                   "instead of stopping at the first one.")
    categories: str | None = Field(None, description="Filter records by their `category` field, before "
                                   "max_samples: `writing,coding` keeps only those categories, `!math,!coding` "
                                   "drops those (one form or the other, not both); a name no record has is an "
                                   "error.")
    verifier: str = Field(description="Verifier: a local Hugging Face directory (model + tokenizer with a chat "
                                      "template) or a repo id already in the local cache.")
    trust_remote_code: bool = Field(False, description="Run the code a verifier directory ships for its config, "
                                    "model or tokenizer (`auto_map`, as Kimi-K2-Instruct's kimi_k2 does), in "
                                    "transformers and in every vLLM draftline starts; recorded as "
                                    "verifier.trust_remote_code and inherited by the stages that read this data. "
                                    "Without it such a directory is refused. Read its .py files first.")
    verifier_id: str | None = Field(None, description="The id serving hosts load the verifier by (a Hugging Face "
                                    "repo id), recorded as verifier.name_or_path and written into the exported "
                                    "config. Default: read from the Hugging Face cache path or the verifier's "
                                    "config.json `_name_or_path`; a plain local directory needs it.")
    aux_layers: list[int] | None = Field(None, description="Verifier layers whose hidden states EAGLE-3 reads "
                                                           "(default [2, N//2, N-3]).")
    max_length: int = Field(2048, ge=16, le=1 << 20, description="Tokens per conversation (longer ones are cut).")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many conversations.")
    batch_size: int = Field(8, ge=1, le=4096, description="Conversations per verifier forward pass.")
    shard_tokens: int = Field(1 << 20, ge=1, description="Tokens per safetensors shard.")
    name: str = Field("conversations", description="Data set name shown in the MLflow UI.")
    output_dir: str | None = Field(None, description="Where the shards are written and stay (shared storage "
                                   "for a cluster; default $DRAFTLINE_WORK/prepared/<key>). A rerun with the "
                                   "same inputs and settings resumes there after the last finished shard.")
    disk_check: bool = Field(True, description="Before capturing, estimate the shards' bytes ((aux layers + 1) x "
                             "hidden x 2 bytes a token, the tokens measured with the verifier's tokenizer) and "
                             "refuse when the --output-dir file system has less free; check again before each "
                             "shard, so a disk that fills stops the run with its finished shards kept. false: "
                             "skip both, for file systems that report their free space wrongly.")
    hidden_storage: Literal["bf16", "fp8"] = Field("bf16", description="How the shards hold the hidden states: "
                                                   "bf16 as the verifier computed them, or fp8 (E4M3 with a scale "
                                                   "per token and layer, read back to bf16 for training): half "
                                                   "the disk; what it costs in served acceptance: docs/results.md.")
    capture_backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="Who computes the hidden states: transformers in this process, or vLLM with "
        "its extract_hidden_states method (a verifier only vLLM runs, such as Kimi-K2.5): a loopback server "
        "prepare starts from the vLLM venv, or the one --capture-endpoint names.")
    capture_endpoint: str | None = Field(None, description="vLLM base URL for capture_backend=vllm (e.g. "
                                         "http://127.0.0.1:8000/v1), a server extracting the aux layers plus the "
                                         "last into a folder this host reads (draftline's connector: "
                                         "kv_connector_module_path draftline_hs_connector, class "
                                         "CpuSafeHiddenStatesConnector; docs/vllm.md). Default: a loopback "
                                         "server started here.")
    capture_model: str | None = Field(None, description="Model name the vLLM server serves (default: the verifier).")
    log_shards: bool = Field(False, description="Also copy the shards into the MLflow artifact store (by "
                                                "default the run logs their location and sha256s only).")
    regenerate_endpoint: str | None = Field(None, description="OpenAI-compatible base URL serving the verifier "
                                            "(e.g. http://127.0.0.1:8000/v1 from `vllm serve`): regenerate every "
                                            "assistant turn with it, and answer every user turn no assistant turn "
                                            "follows, before tokenising (API key from OPENAI_API_KEY or "
                                            "DRAFTLINE_REGENERATE_API_KEY).")
    regenerate_model: str | None = Field(None, description="Model name to request (default: the first model "
                                                           "the endpoint lists).")
    regenerate_max_tokens: int | None = Field(None, ge=1, description="Most tokens the verifier generates per "
                                              "regenerated turn, thinking included; a reply cut there is counted "
                                              "(data/truncated_replies). Default: --max-length for a reasoning "
                                              "verifier (its tokenizer has </think>: Kimi-K2.5 thinks 2,000-4,000 "
                                              "tokens), 512 otherwise.")
    regenerate_keep_truncated: bool = Field(True, description="Keep replies cut at --regenerate-max-tokens (they "
                                            "are still the verifier's tokens); false: each conversation ends before "
                                            "its first cut reply.")
    regenerate_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="JSON object sent as chat_template_kwargs with every regeneration request, as the "
        "deployment sends it (e.g. '{\"thinking\": true}'); recorded with the data. A key the verifier's chat "
        "template ignores is refused.")
    regenerate_concurrency: int = Field(8, ge=1, le=4096, description="Conversations regenerated at once.")
    regenerate_temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature for "
                                                                           "regeneration (0: greedy).")

    @field_validator("regenerate_chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, v: object) -> object:
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise ValueError(f"expected a JSON object such as '{{\"thinking\": true}}', got {v!r}") from None
            if not isinstance(v, dict):
                raise ValueError(f"expected a JSON object such as '{{\"thinking\": true}}', got {v!r}")
        return v or None

    @field_validator("categories", mode="before")
    @classmethod
    def _categories(cls, v: object) -> object:
        if isinstance(v, list | tuple):  # a YAML list
            v = ",".join(str(x) for x in v)
        if isinstance(v, str):
            parse_categories(v)  # ValueError -> one ConfigError line
            v = ",".join(n.strip() for n in v.split(",") if n.strip()) or None
        return v


class FinetuneData(_Strict):
    """Data: what it trains and validates on."""

    GROUP: ClassVar[str] = "Data"

    data: str = Field(description="Prepared data: `runs:/<prepare run id>/data` or a local directory.")
    eval_data: str | None = Field(None, description="A fixed evaluation set (`runs:/<prepare run>/data` or a "
                                  "directory) to validate on instead of a held-out val_fraction of the data, so "
                                  "runs on different data compare.")
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of samples held out for validation "
                                                                  "(0 disables it).")
    verify_data: bool = Field(False, description="Check every shard's sha256 before launch (a full pass; "
                              "otherwise each shard is checked once while training reads it).")


class FinetuneDrafter(_Strict):
    """Parent and drafter: what it starts from and what it builds."""

    GROUP: ClassVar[str] = "Parent and drafter"

    init: str = Field("random", description="Parent drafter: random | a catalog name (configs/parents.yaml) | "
                                            "a local directory | a cached HF repo id | models:/NAME/VERSION|STAGE "
                                            "| models:/NAME@alias.")
    vocab: Literal["parent", "rebuild"] = Field("parent", description="Draft vocabulary: keep the parent's "
                                                "d2t/t2d, or rebuild them from the data and permute lm_head rows.")
    drafter_layer: Literal["auto", "llama", "mla"] = Field(
        "auto", description="The drafter's decoder layer: llama (a Llama/Qwen3 verifier's own layer, else a Llama "
                            "layer), mla (DeepSeek-V3's MLA with a dense MLP, vLLM's Eagle3DeepseekV2ForCausalLM; "
                            "an MLA verifier only), or auto: the parent's, and for init=random MLA for an MLA "
                            "verifier (Kimi, DeepSeek-V3), Llama otherwise.")
    parent_aux_convention: AuxConvention = Field("auto", description=AUX_CONVENTION_HELP + " The data must be "
                                                 "captured at the layers the parent was trained on, and the export "
                                                 "names them as vLLM reads them.")
    fc_norm: bool | None = Field(None, description="EAGLE 3.1: one RMSNorm per aux hidden state before fc "
                                 "(fc_norm.{i}.weight) [default: the parent's; from random init, false: "
                                 "docs/kimi.md says why].")
    norm_output: bool | None = Field(None, description="EAGLE 3.1: feed the next draft step the post-norm state "
                                     "lm_head reads [default: the parent's; from random init, false].")
    draft_vocab_size: int | None = Field(None, ge=2, description="Draft vocabulary size when it is built from "
                                         "data (init=random or vocab=rebuild); default: the parent's, or "
                                         "min(32000, verifier vocabulary).")
    ttt_steps: int = Field(3, ge=1, le=16, description="Test-time-training steps (draft positions).")
    allow_pickle: bool = Field(False, description="Allow a pickle-only parent (loaded with weights_only=True).")


class FinetuneOptimisation(_Strict):
    """Optimisation: the optimiser, the schedule, the batches and the precision."""

    GROUP: ClassVar[str] = "Optimisation"

    steps: int = Field(200, ge=1, description="Optimiser steps (--epochs sets them from the data instead).")
    epochs: float | None = Field(None, gt=0, le=1000, description="Passes over the prepared data: steps = "
                                 "ceil(epochs x training tokens / (ranks x --tokens-per-batch)), said before "
                                 "training and recorded as train.epochs; replaces --steps.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="Peak learning rate (AdamW); how the default was "
                      "chosen: docs/real-tier.md, the recipe sweep.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="After warm-up: linear decay to 0 (DeepSpeed WarmupDecayLR), cosine decay "
        "(WarmupCosineLR) or constant (WarmupLR).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(0.5, gt=0, description="Gradient clipping norm.")
    tokens_per_batch: int = Field(4096, ge=16, description="Packed tokens per rank per step.")
    micro_batch_tokens: int = Field(0, ge=0, description="Split each rank's step into micro-batches of at most "
                                    "this many tokens (whole samples, as many on every rank), their losses "
                                    "weighted by their share of the step's trained tokens: the same gradient, "
                                    "the packed attention over shorter sequences. 0: the whole step at once "
                                    "(what it buys: docs/training-speed.md).")
    ttt_loss_decay: float = Field(1.0, gt=0, le=1.0, description="Loss weight of draft position k is decay^k "
                                  "(1.0: every position weighs the same, speculators' default).")
    hidden_noise: float = Field(0.0, ge=0, le=1.0, description="Gaussian noise on the verifier's hidden states "
                                "while training, relative to each token's RMS (EAGLE's augmentation; 0: none).")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Training precision. auto: bf16 on GPUs; on CPUs whichever a short matmul "
        "measurement at the drafter's shape finds faster on this machine (CPUs differ by orders of magnitude "
        "in bf16).")
    attn_impl: Literal["auto", "blockwise", "sdpa", "eager", "simple_flex_attention"] = Field(
        "auto", description="Draft attention: auto is blockwise on CPU ranks (per packed sample, the draft "
        "positions' keys as diagonals; equal to sdpa within rounding, faster on a CPU) and sdpa on GPUs; "
        "flex attention needs a GPU.")
    seed: int = Field(0, description="Seed for weights and batch order.")


class FinetunePlacement(_Strict):
    """ZeRO and ranks: deepSpeed's partitioning and the ranks of this job."""

    GROUP: ClassVar[str] = "ZeRO and ranks"

    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    gpus: int = Field(0, ge=0, description="Ranks on this node (0: all GPUs, or 1 CPU rank without GPUs).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile: launch every node from this one over "
                                 "pdsh/ssh (or run one finetune per node with --nnodes).")
    ds_config: str | None = Field(None, description="DeepSpeed JSON config (default configs/zero<stage>.json).")


class FinetuneNode(_Strict):
    """This node in a multi-node job: where this node is; each node sets these for itself (the job's other
    settings must agree)."""

    GROUP: ClassVar[str] = "This node in a multi-node job"

    nnodes: int | None = Field(None, ge=1, description="Nodes in the job, each running this same finetune (one "
                               "Slurm task or Kubernetes pod per node) [default: NNODES, PET_NNODES or "
                               "SLURM_NNODES, else 1].")
    node_rank: int | None = Field(None, ge=0, description="This node's index in the job; node 0 opens the MLflow "
                                  "run [default: NODE_RANK, PET_NODE_RANK or SLURM_NODEID].")
    master_addr: str | None = Field(None, description="Node 0's address, the same on every node [default: "
                                    "MASTER_ADDR].")
    master_port: int | None = Field(None, ge=1024, le=65534, description="The ranks' rendezvous port on node 0; "
                                    "the launchers also use the next one [default: MASTER_PORT, else 29500].")
    rendezvous_timeout: float = Field(300.0, gt=0, description="Seconds a node waits for node 0 to answer and "
                                      "node 0 for every node to join, before it gives up.")


class FinetuneCheckpoints(_Strict):
    """Validation, checkpoints and logging: how often it validates, saves and logs, and what it keeps."""

    GROUP: ClassVar[str] = "Validation, checkpoints and logging"

    val_every: int = Field(50, ge=1, description="Validate every N steps (and at the end) under val/; the parent "
                           "is validated before step 1. The best checkpoint by val/acceptance_length is kept "
                           "beside the newest, and handed on.")
    save_every: int = Field(50, ge=1, description="Save a DeepSpeed checkpoint every N steps (and at the end).")
    log_every: int = Field(1, ge=1, description="Log metrics every N steps.")
    log_checkpoints: bool = Field(False, description="Also log the ZeRO checkpoints (fp32 master weights and "
                                  "Adam's two moments: several times the weights) as artifacts; by default only the selected bf16 weights are logged "
                                  "and the checkpoints stay in the work directory for --resume.")


class FinetuneConfig(FinetuneCheckpoints, FinetuneNode, FinetunePlacement, FinetuneOptimisation, FinetuneDrafter, FinetuneData):
    """finetune's settings, grouped as speculators groups its arguments (data, drafter, optimisation, placement);
    one flat model to its readers (``cfg.lr``), the groups' order the fields' order."""


class ExportConfig(_Strict):
    run: str = Field(description="Finetune run: its id or `runs:/<id>`.")
    registered_model: str = Field("draftline-drafter", description="Registered model the version is added to "
                                  f"({MODEL_NAME_RULE}).")
    verifier_id: str | None = Field(None, description="The id serving hosts load the verifier by (Hugging Face "
                                    "repo id), written into the exported config.json and checked by `pull "
                                    "--verifier` [default: the one the data recorded].")
    layout: Literal["speculators", "midlayer"] = Field("speculators", description="Extra layout to write "
                                                       "(speculators is always written; midlayer adds SGLang's).")
    checkpoint: str = Field("best", pattern=r"^(best|last|step\d+)$", description="Which checkpoint of the "
                            "finetune run: best (by val/acceptance_length; the newest when no validation ran), "
                            "last, or step<N>.")
    @field_validator("registered_model")
    @classmethod
    def _model_name(cls, v: str) -> str:
        return check_model_name(v)  # a UsageError passes through pydantic: the same line as every command's

    vllm_check: Literal["auto", "on", "off"] = Field("auto", description="Before registering, load the export in "
                                                     "real vLLM beside the verifier and draft with it (auto: when "
                                                     "the vLLM venv of `./setup.sh --vllm` is there; on: required; "
                                                     "off: the speculators reload only).")


class EvaluateConfig(_Strict):
    target: str = Field(description="The drafter: a finetune run (`runs:/<id>` or its id), models:/NAME/VERSION|"
                                    "STAGE, models:/NAME@alias, a catalog parent (configs/parents.yaml), a local "
                                    "directory or a cached HF repo id.")
    data: str = Field(description="The evaluation set: `runs:/<prepare run>/data` or a prepared directory. Keep it "
                                  "fixed and out of training, so every drafter is measured on the same prompts.")
    checkpoint: str = Field("best", pattern=r"^(best|last|step\d+)$", description="For a finetune run: which "
                            "checkpoint (best, last or step<N>).")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Draft tokens per step (vLLM's "
                                        "num_speculative_tokens), also the teacher-forced positions.")
    measured: bool = Field(True, description="Also measure real greedy chain speculative decoding against the "
                           "verifier (--no-measured: teacher-forced only).")
    max_new_tokens: int = Field(128, ge=1, le=8192, description="Tokens generated per prompt when measuring.")
    max_prompts: int | None = Field(None, ge=1, description="Measure on at most this many prompts (default: "
                                    "every sample's prompt).")
    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="Where the measured figure comes from: vllm (a loopback vLLM server from the vLLM venv "
        "of `./setup.sh --vllm`, float32, its output checked token for token against a plain vLLM server), "
        "transformers (greedy chain decoding in this process), auto (vllm when its venv is there).")
    cross_check: bool = Field(False, description="With the vllm backend, also measure in this process and log "
                              "that figure too (eval/inprocess/*), with the difference.")
    vllm_endpoint: str | None = Field(None, description="Measure on a vLLM server serving the verifier with this "
                                      "drafter (its OpenAI base URL, e.g. http://127.0.0.1:8000/v1), reading its "
                                      "spec-decode counters, instead of in this process.")
    vllm_model: str | None = Field(None, description="Model name the vLLM server serves (default: its first).")
    concurrency: int = Field(8, ge=1, le=1024, description="Requests in flight on the vLLM server.")
    speed_concurrency: str = Field("1", description="Also decode the same prompts "
                                   "with the verifier alone and report the speed-up the drafter buys (tokens/s, "
                                   "per-token time, latency) at each of these concurrencies, e.g. 1,8; off to skip. "
                                   "On vLLM only: loopback, or --vllm-endpoint with --plain-endpoint.")
    sweep_k: str | None = Field(None, description="Measure the speed-up at each of these "
                                "num_speculative_tokens too (1..4, or 1,2,4) and recommend the one that decodes "
                                "fastest here, instead of the cost model's guess. Loopback vLLM only: each k "
                                "starts a drafted server of its own.")
    plain_endpoint: str | None = Field(None, description="With --vllm-endpoint: a vLLM server of the same "
                                       "verifier without a drafter (its OpenAI base URL), for the speed-up.")
    verifier: str | None = Field(None, description="The verifier's directory on this machine (default: where the "
                                 "evaluation set was captured from).")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Confidence level of the interval around the "
                              "measured acceptance length (a seeded bootstrap over prompts).")
    draft_cost_ratio: float = Field(0.05, gt=0.0, le=1.0, description="Cost of one draft step relative to one "
                                    "verifier step, for the recommended num_speculative_tokens.")
    tokens_per_batch: int = Field(4096, ge=16, description="Packed tokens per teacher-forced batch.")
    parent_aux_convention: AuxConvention = Field("auto", description=AUX_CONVENTION_HELP + " For a parent "
                                                 "target: it is served and loaded with the ids vLLM captures for "
                                                 "those layers.")

    @field_validator("speed_concurrency")
    @classmethod
    def _concurrencies(cls, v: str) -> str:
        if not re.fullmatch(r"off|[1-9]\d*(,[1-9]\d*)*", v.strip()):
            raise UsageError(f"--speed-concurrency {v!r}: give comma-separated request counts of at least 1, "
                             "e.g. 1,8 (or off)")
        return v.strip()

    @field_validator("sweep_k")
    @classmethod
    def _sweep(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        text = v.strip()
        span = re.fullmatch(r"(\d+)\.\.(\d+)", text)
        if span:
            ks = list(range(int(span[1]), int(span[2]) + 1))
        elif re.fullmatch(r"\d+(,\d+)*", text):
            ks = sorted({int(x) for x in text.split(",")})
        else:
            ks = []
        if not ks or ks[0] < 1 or ks[-1] > 16:
            raise UsageError(f"--sweep-k {v!r}: give num_speculative_tokens from 1 to 16 as a range (1..4) or a "
                             "list (1,2,4)")
        return ",".join(map(str, ks))

    @property
    def speed_at(self) -> list[int]:
        """The concurrencies the speed-up is measured at (``[]``: off)."""
        return [] if self.speed_concurrency == "off" else sorted({int(x) for x in self.speed_concurrency.split(",")})

    @property
    def sweep(self) -> list[int]:
        """The num_speculative_tokens ``--sweep-k`` measures (``[]``: none)."""
        return [int(x) for x in self.sweep_k.split(",")] if self.sweep_k else []

    @model_validator(mode="after")
    def _plain_needs_drafted(self) -> EvaluateConfig:
        if self.plain_endpoint and not self.vllm_endpoint:
            raise UsageError("--plain-endpoint is the verifier without a drafter, compared with --vllm-endpoint: "
                             "pass both, or neither (loopback starts its own pair)")
        if self.sweep and self.vllm_endpoint:
            raise UsageError("--sweep-k starts a drafted vLLM server per k, and a server's k is fixed when it "
                             "starts: drop --vllm-endpoint (loopback), or evaluate each served k on its endpoint")
        if self.sweep and not self.speed_at:
            raise UsageError("--sweep-k picks the k that decodes fastest, so it measures speed: give "
                             "--speed-concurrency (e.g. 1), not off")
        if self.sweep and not self.measured:
            raise UsageError("--sweep-k measures decoding on vLLM: drop --no-measured")
        return self


def parse_categories(spec: str | None) -> tuple[set[str], set[str]]:
    """``"a,b"`` -> ({a, b}, {}) (keep only these); ``"!a,!b"`` -> ({}, {a, b}) (drop these). Mixing both
    forms, or an empty name, is a ValueError."""
    names = [n.strip() for n in (spec or "").split(",") if n.strip()]
    keep = {n for n in names if not n.startswith("!")}
    drop = {n[1:].strip() for n in names if n.startswith("!")}
    if "" in drop:
        raise ValueError("'!' must be followed by a category name")
    if keep and drop:
        raise ValueError("name the categories to keep (writing,coding) or those to drop (!writing,!coding), "
                         "not both")
    return keep, drop


CACHE_ENV = environment.CACHE_DIR.name  # where the caches live (cache_root); a pull keeps its downloads there
VLLM_ARGS_ENV = environment.VLLM_ARGS.name  # flags for every vLLM draftline starts (draftline.serving.engine)
SHIPPED = Path(__file__).parent / "shipped"  # configs/ and registry_policies/: links in a checkout, copies in a wheel


def shipped(*parts: str) -> Path:
    """A file draftline ships: ``shipped("configs", "zero2.json")``, ``shipped("registry_policies")``. The same
    path in a checkout (where ``shipped/`` links to the top-level folders) and in an installed wheel."""
    return SHIPPED.joinpath(*parts)


def project_root() -> Path | None:
    """The checkout draftline runs from (the folder holding ``MLproject``), or None for an installed wheel.
    ``DRAFTLINE_ROOT`` overrides it."""
    if environment.ROOT.is_set():
        return Path(environment.ROOT.get())
    root = Path(__file__).resolve().parents[2]
    return root if (root / "MLproject").is_file() else None


def work_dir() -> Path:
    """Scratch and cache space of this machine: $DRAFTLINE_WORK, default ./work."""
    return Path(environment.WORK.get()).resolve()


def cache_root() -> Path:
    """Caches shared by runs on this machine (pulled blobs, regenerated conversations): $DRAFTLINE_CACHE_DIR,
    default ~/.cache/draftline."""
    return Path(environment.CACHE_DIR.get() or "~/.cache/draftline").expanduser()


def load_file(file: str | Path) -> dict[str, Any]:
    """A YAML settings file as ``{setting: value}``. Raises :class:`ConfigError`."""
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must be a mapping of setting: value")
    return loaded


def resolve(model: type[BaseModel], *, flags: dict[str, Any] | None = None, file: str | Path | None = None):
    """flag > config file > default. ``None`` flags do not override. Raises :class:`ConfigError`."""
    values: dict[str, Any] = load_file(file) if file else {}
    if file:
        check_keys(model, values, f"config file {file}")
    values.update({k: v for k, v in (flags or {}).items() if v is not None})
    try:
        return model(**values)
    except ValidationError as e:
        stage = model.__name__.removesuffix("Config").lower()
        problems = [f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"invalid {stage} settings: {'; '.join(problems)} (`draftline {stage} --help` "
                          "lists them)") from None


# names other trainers give a setting (Hugging Face TrainingArguments, DeepSpeed, speculators) -> ours
SYNONYMS = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "train_steps": "steps",
            "num_train_steps": "steps", "warmup": "warmup_steps", "lr_warmup_steps": "warmup_steps",
            "max_grad_norm": "grad_clip", "gradient_clipping": "grad_clip", "clip_grad_norm": "grad_clip",
            "logging_steps": "log_every", "save_steps": "save_every", "eval_steps": "val_every",
            "num_gpus": "gpus", "world_size": "gpus", "stage": "zero_stage", "zero": "zero_stage",
            "parent": "init", "init_from": "init", "dataset": "data", "train_data": "data", "model": "target",
            "num_draft_tokens": "num_speculative_tokens", "ttt": "ttt_steps", "dtype": "precision",
            "max_seq_len": "max_length", "max_seq_length": "max_length", "model_name": "registered_model"}


def suggest(name: str, known) -> str | None:
    """The known name closest to ``name`` (a synonym from other trainers first), or None."""
    known = list(known)
    key = name.replace("-", "_")
    if key in known:
        return key
    if SYNONYMS.get(key) in known:
        return SYNONYMS[key]
    near = difflib.get_close_matches(key, known, n=1)
    return near[0] if near else None


def check_keys(model: type[BaseModel], values: dict[str, Any], where: str) -> None:
    """Refuse a key ``model`` does not have, in one sentence naming the closest one."""
    stage = model.__name__.removesuffix("Config").lower()
    unknown = [k for k in values if k not in model.model_fields]
    if not unknown:
        return
    hints = []
    for k in unknown:
        near = suggest(str(k), model.model_fields)
        hints.append(f"{k!r}" + (f" (did you mean {near!r}?)" if near else ""))
    raise ConfigError(f"{where}: {stage} has no setting {', '.join(hints)}; `draftline {stage} --help` lists "
                      "them")


def groups(model: type[BaseModel]) -> list[tuple[str, list[str]]]:
    """A grouped settings model's groups, in its fields' order: ``[(title, [field names])]`` (``[]`` for a model
    without groups)."""
    out = []
    for base in reversed(model.__mro__):
        title = base.__dict__.get("GROUP")
        if title:
            out.append((title, [n for n in base.__dict__.get("__annotations__", {}) if n in model.model_fields]))
    return out
