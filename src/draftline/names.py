"""Every name draftline writes into MLflow and another piece reads back: run params, tags, model-version tags and
metrics, each declared once with what it means and who writes it.

A name is a ``str`` (``PARENT_SOURCE == "parent.source"``), so it is a dict key, a filter and a log key as it is.
The stages, the export's model card, the promotion policies' reader and the tests import these;
``docs/names.md`` is rendered from this table (``python -m draftline.names``; a test keeps the page in step), and a
test refuses a string literal equal to a declared name anywhere else in ``src/``.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["param", "tag", "version tag", "metric"]
_ALL: list[Name] = []


class Name(str):
    """One name in the lineage contract: the string itself, its kind, the stage that writes it and its meaning."""

    kind: Kind
    writer: str
    meaning: str
    family: bool  # a prefix: the names are ``f"{NAME}{suffix}"``

    def __new__(cls, value: str, kind: Kind, writer: str, meaning: str, *, family: bool = False) -> Name:
        self = super().__new__(cls, value)
        self.kind, self.writer, self.meaning, self.family = kind, writer, meaning, family
        _ALL.append(self)
        return self

    def __reduce__(self):  # copied or pickled (a deep copy of a dict of tags, a rank's spec): the plain string
        return str, (str(self),)


def _param(value: str, writer: str, meaning: str, **kw) -> Name:
    return Name(value, "param", writer, meaning, **kw)


def _tag(value: str, writer: str, meaning: str, **kw) -> Name:
    return Name(value, "tag", writer, meaning, **kw)


def _metric(value: str, writer: str, meaning: str, **kw) -> Name:
    return Name(value, "metric", writer, meaning, **kw)


def _version(value: str, writer: str, meaning: str, **kw) -> Name:
    return Name(value, "version tag", writer, meaning, **kw)


# --- the parent: what a drafter was finetuned from (finetune's params, copied onto the version) -------------------
INIT = _param("init", "finetune", "the --init named: a catalog entry, a directory, an HF id, models:/… or random")
PARENT_NAME = _param("parent.name", "finetune", "the parent's name as the catalog or the registry knows it")
PARENT_SOURCE = _param("parent.source", "finetune", "where the parent came from: an HF repo id, models:/NAME/V, a path")
PARENT_REVISION = _param("parent.revision", "finetune", "the parent's revision: an HF commit or a registered version")
PARENT_SHA256 = _param("parent.sha256", "finetune", "sha256 over the parent's weight files, as loaded")
PARENT_LAYOUT = _param("parent.layout", "finetune", "the parent's tensor layout: speculators (layers.0.*) or midlayer "
                       "(SpecForge, AQ-MedAI)")
PARENT_KEY_REMAP = _param("parent.key_remap", "finetune", "the renaming its tensors needed to load strictly "
                          "(midlayer.* -> layers.0.*), or none")
PARENT_AUX_CONVENTION = _param("parent.aux_convention", "finetune", "whose layers the parent's aux ids name: vllm "
                               "(input of layer i) or sglang (output of layer i)")
PARENT_VAL = _metric("parent.val/", "finetune", "the parent's own validation figures on this run's data, before "
                     "step 1", family=True)
PARENT_VAL_ACCEPTANCE_LENGTH = _metric("parent.val/acceptance_length", "finetune",
                                       "the parent's validation acceptance length on this run's data")

# --- the drafter and its vocabulary ----------------------------------------------------------------------------------
DRAFTER_LAYER = _param("drafter.layer", "finetune", "the drafter's decoder layer: llama or mla")
DRAFTER_EAGLE = _param("drafter.eagle", "finetune", "the EAGLE form: 3.0, or 3.1 (fc_norm and norm_output)")
DRAFTER_FC_NORM = _param("drafter.fc_norm", "finetune", "one RMSNorm per aux hidden state before fc (EAGLE 3.1)")
DRAFTER_NORM_OUTPUT = _param("drafter.norm_output", "finetune", "the post-norm state fed on and to lm_head (EAGLE 3.1)")
VOCAB_POLICY = _param("vocab.policy", "finetune", "parent (the parent's draft vocabulary) or rebuild (from this data)")
VOCAB_DRAFT_SIZE = _param("vocab.draft_size", "finetune", "the draft vocabulary's size")
VOCAB_KEPT = _param("vocab.kept", "finetune", "draft tokens kept from the parent's vocabulary (their lm_head rows too)")
VOCAB_ADDED = _param("vocab.added", "finetune", "draft tokens new to this drafter")
VOCAB_DROPPED = _param("vocab.dropped", "finetune", "the parent's draft tokens this drafter no longer has")
TTT_STEPS = _param("ttt_steps", "finetune", "training-time-test steps: the draft positions trained")

# --- the verifier and the data ---------------------------------------------------------------------------------------
VERIFIER_NAME_OR_PATH = _param("verifier.name_or_path", "finetune", "the verifier's id as serving hosts load it "
                               "(never a training host's path)")
VERIFIER_PATH = _param("verifier.path", "finetune", "the verifier's directory on the host that prepared the data")
VERIFIER_REVISION = _param("verifier.revision", "finetune", "the verifier's HF revision, or none")
VERIFIER_AUX_LAYERS = _param("verifier.aux_layers", "finetune", "the verifier layers whose hidden states feed fc, "
                             "as vLLM counts them")
VERIFIER_TRUST_REMOTE_CODE = _param("verifier.trust_remote_code", "finetune", "whether the verifier's custom code "
                                    "was trusted")
VERIFIER_MODEL_TYPE = _param("verifier.model_type", "finetune", "the verifier config's model_type (kimi_k2, llama, …)")
VERIFIER_ARCHITECTURE = _param("verifier.architecture", "finetune", "the verifier config's architecture class")
DATA_DIGEST = _param("data.digest", "prepare, finetune", "the prepared data set's digest (its shards' sha256)")
DATA_URI = _param("data.uri", "finetune, evaluate", "the prepared data the run read: runs:/<prepare run>/data")
DATA_NAME = _param("data.name", "evaluate", "the evaluation set's name")
DATA_HIDDEN_STORAGE = _param("data.hidden_storage", "prepare", "how hidden states are stored: bf16 or fp8")
EVAL_DATA_DIGEST = _param("eval.data.digest", "finetune", "the held-out data validation ran on, or none")

# --- training ---------------------------------------------------------------------------------------------------------
ZERO_STAGE = _param("zero.stage", "finetune", "DeepSpeed ZeRO stage")
WORLD_SIZE = _param("world_size", "finetune", "ranks the run trained on")
TRAIN_STEPS = _param("train.steps", "finetune", "optimiser steps")
TRAIN_EPOCHS = _param("train.epochs", "finetune", "epochs asked for (none: --steps)")
TRAIN_TOKENS_PER_BATCH = _param("train.tokens_per_batch", "finetune", "tokens per optimiser step, all ranks")
TRAIN_MICRO_BATCH_TOKENS = _param("train.micro_batch_tokens", "finetune", "tokens per rank per micro-batch")
TRAIN_PRECISION = _param("train.precision", "finetune", "bf16 or fp32, as trained")
TRAIN_PRECISION_CHOICE = _param("train.precision_choice", "finetune", "why that precision (measured here, or asked)")
TRAIN_LR_SCHEDULE = _param("train.lr_schedule", "finetune", "linear, cosine or constant after warm-up")
TRAIN_TTT_LOSS_DECAY = _param("train.ttt_loss_decay", "finetune", "the weight of draft position k's loss is decay**k")
TRAIN_HIDDEN_NOISE = _param("train.hidden_noise", "finetune", "noise added to the verifier's hidden states")
TRAIN_SEED = _param("train.seed", "finetune", "the seed")
TRAIN_ATTN_IMPL = _param("train.attn_impl", "finetune", "the attention kernel trained with")
TRAIN_VAL_FRACTION = _param("train.val_fraction", "finetune", "the share of samples held out for validation")
PLAN_FITS = _param("plan.fits", "finetune", "whether the run fits the GPUs' memory as planned: true, false, unchecked "
                   "(no GPU) or error; plan.json beside it holds the table")
TRAIN_PAIRING = _param("train.pairing", "finetune", "how hidden states and target tokens were paired "
                       "(docs/pairing.md); versions of another pairing are not compared")
OPTIMIZER = _param("optimizer.", "finetune", "the optimiser as DeepSpeed ran it: name, lr, betas, eps, weight_decay, "
                   "warmup_steps, schedule, grad_clip", family=True)
OPTIMIZER_LR = _param("optimizer.lr", "finetune", "the peak learning rate")
OPTIMIZER_WARMUP_STEPS = _param("optimizer.warmup_steps", "finetune", "the warm-up steps")
TRAIN = _metric("train/", "finetune", "per step: loss, loss_k, full_acc_k, cond_acc_k, acceptance_length, lr, "
                "tokens_per_s", family=True)
TRAIN_LOSS = _metric("train/loss", "finetune", "the TTT loss over the draft positions")
TRAIN_ACCEPTANCE_LENGTH = _metric("train/acceptance_length", "finetune", "acceptance length the training batches "
                                  "predict")
TRAIN_FULL_ACC_0 = _metric("train/full_acc_0", "finetune", "first-position accuracy on the training batches")
TRAIN_TOKENS_PER_S = _metric("train/tokens_per_s", "finetune", "training tokens per second, all ranks")
VAL = _metric("val/", "finetune", "the same figures on the held-out data", family=True)
VAL_ACCEPTANCE_LENGTH = _metric("val/acceptance_length", "finetune", "acceptance length on the held-out data")
HEADLINE_METRICS = (VAL_ACCEPTANCE_LENGTH, PARENT_VAL_ACCEPTANCE_LENGTH, TRAIN_ACCEPTANCE_LENGTH, TRAIN_FULL_ACC_0,
                    TRAIN_LOSS)  # the finetune run's, onto the LoggedModel and the version

# --- what the verifier generated (prepare's metrics) ------------------------------------------------------------------
DATA = _metric("data/", "prepare", "the data set: samples, tokens, masked_tokens, bytes_per_token, shard_bytes, …",
               family=True)
DATA_REPLIES = _metric("data/replies", "prepare", "replies the verifier generated")
DATA_TRUNCATED_REPLIES = _metric("data/truncated_replies", "prepare", "replies cut at the generation limit")
DATA_TRUNCATED_SHARE = _metric("data/truncated_share", "prepare", "their share of the replies")
DATA_REASONING_REPLIES = _metric("data/reasoning_replies", "prepare", "replies with a reasoning part")
DATA_REASONING_SHARE = _metric("data/reasoning_share", "prepare", "the reasoning tokens' share of the reply tokens")
DATA_REPLY_TOKENS = _metric("data/reply_tokens", "prepare", "tokens the verifier generated, in all")
DATA_REPLY_TOKENS_P50 = _metric("data/reply_tokens_p50", "prepare", "median reply length")
DATA_REPLY_TOKENS_P90 = _metric("data/reply_tokens_p90", "prepare", "90th-percentile reply length")
DATA_REPLY_TOKENS_MAX = _metric("data/reply_tokens_max", "prepare", "longest reply")

# --- evaluation -----------------------------------------------------------------------------------------------------
EVAL_ACCEPTANCE_LENGTH = _metric("eval/acceptance_length", "evaluate", "the headline: measured if measured, else "
                                 "teacher-forced")
TEACHER_FORCED = _metric("eval/teacher_forced/", "evaluate", "teacher-forced figures on the evaluation set",
                         family=True)
TEACHER_FORCED_ACCEPTANCE_LENGTH = _metric("eval/teacher_forced/acceptance_length", "evaluate",
                                           "teacher-forced acceptance length")
MEASURED = _metric("eval/measured/", "evaluate", "what real speculative decoding accepted (vLLM's counters)",
                   family=True)
MEASURED_ACCEPTANCE_LENGTH = _metric("eval/measured/acceptance_length", "evaluate",
                                     "acceptance length served (1 + accepted drafts per step)")
MEASURED_LOW = _metric("eval/measured/acceptance_length_low", "evaluate", "its interval's lower end, over prompts")
MEASURED_HIGH = _metric("eval/measured/acceptance_length_high", "evaluate", "its interval's upper end")
MEASURED_CONFIDENCE = _metric("eval/measured/confidence", "evaluate", "the interval's confidence level")
MEASURED_PROMPTS = _metric("eval/measured/prompts", "evaluate", "prompts measured")
LOSSLESS = _metric("eval/measured/lossless", "evaluate", "1 if the drafted outputs equal the verifier's own")
INPROCESS = _metric("eval/inprocess/", "evaluate", "the in-process chain's figures beside vLLM's", family=True)
PREDICTED = _metric("eval/predicted/acceptance_length", "evaluate", "the walk over the served replies' prediction")
PREDICTED_DIFFERENCE = _metric("eval/predicted/difference", "evaluate", "prediction minus measurement")
PREDICTED_PROMPTS = _metric("eval/predicted/prompts", "evaluate", "prompts the prediction walked")
RECOMMENDED_K = _metric("eval/recommended_num_speculative_tokens", "evaluate", "the k to serve with")
RECOMMENDED_K_MEASURED = _metric("eval/recommended_num_speculative_tokens_measured", "evaluate",
                                 "1: k chosen from measured speed (--sweep-k), 0: from the cost model")
SPEED = _metric("eval/speed", "evaluate", "eval/speed/c<concurrency>/{speedup,speedup_low,…}", family=True)
SWEEP = _metric("eval/sweep", "evaluate", "eval/sweep/k<k>/…: speed by num_speculative_tokens", family=True)
EVAL_RECOMMENDED_K = _version("eval.recommended_num_speculative_tokens", "export",
                              "the k written into the drafter's config")
EVAL_RECOMMENDED_K_FROM = _version("eval.recommended_num_speculative_tokens.from", "export", "what chose it")
EVAL_RECOMMENDED_K_SET = _version("eval.recommended_num_speculative_tokens.set", "export",
                                  "the evaluation set it was measured on")

# --- export and the registered version --------------------------------------------------------------------------------
CHECKPOINT_STEP = _version("checkpoint.step", "export", "the finetune step the version's weights are from")
FINETUNE_RUN_ID = _version("finetune.run_id", "export", "the finetune run the version was exported from")
EXPORT_SHA256 = _version("export.sha256", "export", "sha256 over checksums.json: what pull checks")
EXPORT_CHECKSUMS = _version("export.checksums", "export", "the manifest itself: every file's sha256")
EXPORT_VALIDATED = _version("export.validated", "export", "true when the exported directory reloaded strictly")
EXPORT_VLLM_CHECK = _version("export.vllm_check", "export", "vLLM's check before registering: passed (drafts, acceptance length, the layers vLLM captured), skipped and why, or off")
EXPORT_LAYOUT = _param("export.layout", "export", "speculators or midlayer")
EXPORT_REGISTERED_MODEL = _param("export.registered_model", "export", "the registered model")
EXPORT_CHECKPOINT = _param("export.checkpoint", "export", "best, last or step<N>")
VERSION_TAG_PARAMS = (
    INIT, PARENT_NAME, PARENT_SOURCE, PARENT_REVISION, PARENT_SHA256, PARENT_LAYOUT, PARENT_KEY_REMAP,
    PARENT_AUX_CONVENTION, VOCAB_POLICY, VOCAB_DRAFT_SIZE, VERIFIER_NAME_OR_PATH, VERIFIER_AUX_LAYERS,
    VERIFIER_REVISION, VERIFIER_TRUST_REMOTE_CODE, VERIFIER_MODEL_TYPE, DATA_DIGEST, TRAIN_PAIRING, DRAFTER_LAYER,
    DRAFTER_EAGLE, DRAFTER_FC_NORM, DRAFTER_NORM_OUTPUT, EVAL_DATA_DIGEST,
)  # the finetune run's params copied onto every version it is exported as

# --- tags -------------------------------------------------------------------------------------------------------------
STEP = _tag("draftline.step", "every stage", "the stage a run is: prepare, finetune, evaluate, export, observe")
KIND = _tag("draftline.kind", "finetune, export", "a LoggedModel's kind: drafter or parent")
FINETUNE_RUN = _tag("draftline.finetune.run_id", "export, main", "the finetune run an export read")
PREPARE_RUN = _tag("draftline.prepare.run_id", "main", "main's prepare step")
EXPORT_RUN = _tag("draftline.export.run_id", "main", "main's export step")
MODEL_VERSION = _tag("draftline.model_version", "export, main", "the version an export registered")
MODEL_ID = _tag("draftline.model_id", "export", "the LoggedModel an export logged")
DATA_RUN = _tag("draftline.data.run_id", "finetune", "the prepare run whose data it trained on")
PARENT_MODEL_VERSION = _tag("draftline.parent.model_version", "finetune", "the registered version it started from")
PARENT_RUN = _tag("draftline.parent.run_id", "finetune", "that version's finetune run")
PARENT_SHA256_TAG = _tag("draftline.parent.sha256", "finetune", "the parent's sha256, on its external LoggedModel")
VLLM_ARGS = _tag("draftline.vllm.args", "every stage", "DRAFTLINE_VLLM_ARGS as the run saw them")
OBSERVE_VERSION = _tag("draftline.observe.version", "observe", "the version an observe run watched")
SERVED_ACCEPTANCE_LENGTH = _version("served.acceptance_length", "observe", "what the fleet served, last window")
SERVED_VERDICT = _version("served.verdict", "observe", "that figure against the evaluation's interval")
SERVED_OBSERVE_RUN = _version("served.observe_run_id", "observe", "the observe run that said it")
SERVED_OBSERVED_AT = _version("served.observed_at", "observe", "when")
SERVED_AT = _version("served.", "serve", "served.<host>.since / served.<host>.until: when a host started and "
                     "stopped serving the version", family=True)


def declared() -> tuple[Name, ...]:
    """Every declared name, in the order above."""
    return tuple(_ALL)


def markdown() -> str:
    """docs/names.md: one table per kind."""
    lines = ["# Names", "",
             "Every name draftline writes into MLflow and reads back, as declared in `src/draftline/names.py` "
             "(this page is rendered from it: `python -m draftline.names > docs/names.md`). A name ending in `/` "
             "or `.` is a family: its members follow it. [The lineage contract](lineage.md) says how they fit "
             "together.", ""]
    titles = {"param": "Run params", "version tag": "Model-version tags", "tag": "Run and model tags",
              "metric": "Metrics"}
    for kind, title in titles.items():
        lines += [f"## {title}", "", "| name | written by | meaning |", "|---|---|---|"]
        lines += [f"| `{n}`{' …' if n.family else ''} | {n.writer} | {n.meaning} |" for n in _ALL if n.kind == kind]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
