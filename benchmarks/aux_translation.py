"""aux-translation: a parent trained where SGLang counts its aux layers, finetuned with and without the translation
to vLLM's count, judged by what vLLM serves. After ``./demo_kimi.sh`` (its vLLM-answered, vLLM-captured data and
held-out evaluation set in ``mlflow.db``, captured at layers A as vLLM counts them).

The parent: an MLA drafter from random init trained on the same answers captured one layer later, at A + 1 as vLLM
counts them (the *output* of layers A: what SGLang, SpecForge, ModelOpt and TorchSpec mean by ids A), written as
those trainers write it: its config names ids A and says nothing of whose. Two children are finetuned from it at
equal steps, seed and recipe:

* **translated**: ``--parent-aux-convention sglang`` (what draftline asks for): the data captured at A + 1, the
  layers the parent was trained on; the export names them as vLLM reads them;
* **literal**: ``--parent-aux-convention vllm`` (the ids read as they stand, what a pipeline that does not ask
  does): the data captured at A, every aux input one layer earlier than the parent learned.

Each child, and the parent read each way, is served by vLLM beside the Kimi-shaped verifier on the same held-out
prompts: served acceptance with its interval, and the paired difference translated minus literal, prompt by prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.demo_runs import KIMI_RECIPE, finetune_kimi, latest_run
from benchmarks.layers_served import evaluate_served, paired_by_prompt, served_figures
from draftline import names

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = ROOT / "work" / "tiny-kimi" / "verifier"
COMMON = ["--verifier", str(VERIFIER), "--trust-remote-code", "--regenerate-max-tokens", "48", "--max-length", "320",
          "--capture-backend", "vllm"]  # demo_kimi.sh's
SETS = {"conversations": ("configs/demo/gsm8k_train_prompts.jsonl", 48),
        "evaluation": ("configs/demo/gsm8k_test_prompts.jsonl", 12)}
LABEL = "translated - literal"


def _cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "draftline.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"draftline {' '.join(args[:2])} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def _prepare_shifted(aux: list[int], endpoint: str) -> dict[str, str]:
    """The demo's two sets again, the same conversations and settings (its answers come back from the
    regeneration cache), captured at ``aux``."""
    out = {}
    for name, (conversations, n) in SETS.items():
        out[name] = _cli("prepare", "--conversations", conversations, "--max-samples", str(n), "--name",
                         f"{name}-aux-shifted", "--aux-layers", ",".join(map(str, aux)), "--regenerate-endpoint",
                         endpoint, *COMMON)["data_uri"]
    return out


def _sglang_parent(run_id: str, ids: list[int], dest: Path) -> Path:
    """The finetune run's drafter, exported as vLLM serves it, then written as an SGLang-side trainer writes it:
    its config names ``ids`` (the layers whose output it was trained on) and says nothing of whose count."""
    version = _cli("export", "--run", run_id, "--registered-model", "aux-translation-parent",
                   "--vllm-check", "off")["version"]
    _cli("pull", "aux-translation-parent", "--version", version, "--dest", str(dest), "--json")
    from draftline.drafter.aux_ids import CONVENTION_KEY, served_aux_fields

    config = {**json.loads((dest / "config.json").read_text()), **served_aux_fields(ids)}
    config.pop(CONVENTION_KEY)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for stale in ("checksums.json", "lineage.json", "README.md", "training_metadata.json"):
        (dest / stale).unlink(missing_ok=True)  # a directory from elsewhere, as a trainer ships it
    return dest


def run(steps: int = 100, parent_steps: int = 200, seed: int = 0, max_new_tokens: int = 24) -> dict:
    os.environ.setdefault("DRAFTLINE_TINY_KIMI_DIR", str(ROOT / "work" / "tiny-kimi"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")
    from mlflow import MlflowClient

    from draftline.data.refs import resolve_data
    from draftline.data.shards import open_prepared
    from draftline.serving.engine import ServeSpec, VllmServer
    from draftline.serving.hf_model import allow_custom_code

    client = MlflowClient()
    literal = {name: f"runs:/{latest_run('prepare', name)}/data" for name in SETS}
    ids = list(open_prepared(resolve_data(literal["conversations"]), verify=False).manifest["aux_layer_ids"])
    later = [i + 1 for i in ids]
    allow_custom_code(str(VERIFIER))
    with VllmServer(ServeSpec(model=str(VERIFIER), served_name="kimi", max_model_len=1024)) as served:
        shifted = _prepare_shifted(later, served.endpoint)

    # the parent: trained on the outputs of layers `ids` (vLLM's inputs of `later`), written naming `ids`
    parent_run = finetune_kimi(shifted["conversations"], shifted["evaluation"], steps=parent_steps, seed=seed + 1,
                               side=["--init", "random", "--drafter-layer", "mla"])
    parent = _sglang_parent(parent_run, ids, Path(tempfile.mkdtemp(prefix="aux-translation-")) / "parent")

    sides: dict[str, dict] = {}
    for name, convention in (("parent read as trained (sglang)", "sglang"), ("parent read literally", "vllm")):
        evalset = shifted["evaluation"] if convention == "sglang" else literal["evaluation"]
        evaluated = evaluate_served(str(parent), evalset, max_new_tokens, "off", parent_aux_convention=convention)
        sides[name] = {"convention": convention, "evaluation_set": evalset, **served_figures(client, evaluated)}
    children = {"translated": ("sglang", shifted), "literal": ("vllm", literal)}
    for name, (convention, data) in children.items():
        run_id = finetune_kimi(data["conversations"], data["evaluation"], steps=steps, seed=seed,
                               side=["--init", str(parent), "--vocab", "rebuild", "--parent-aux-convention",
                                     convention])
        train = client.get_run(run_id).data
        evaluated = evaluate_served(f"runs:/{run_id}", data["evaluation"], max_new_tokens, "off")
        sides[name] = {"finetune_run": run_id, "convention": convention, "data": data["conversations"],
                       "aux_layers": train.params.get(names.VERIFIER_AUX_LAYERS),
                       "val_acceptance_length": train.metrics.get(names.VAL_ACCEPTANCE_LENGTH),
                       "parent_val_acceptance_length": train.metrics.get(names.PARENT_VAL_ACCEPTANCE_LENGTH),
                       **served_figures(client, evaluated)}
    paired = {LABEL: paired_by_prompt(client, sides["translated"], sides["literal"]),
              "parent: as trained - literally": paired_by_prompt(client, sides["parent read as trained (sglang)"],
                                                                 sides["parent read literally"])}
    return {"summary": summarize(sides, paired), "shape": "kimi", "sides": sides, "paired": paired,
            "aux_layers": {"parent_config": ids, "trained_on_as_vllm_counts": later}, "parent_run": parent_run,
            "steps": steps, "parent_steps": parent_steps, "seed": seed, "max_new_tokens": max_new_tokens,
            "method": f"Kimi miniature, demo_kimi.sh's answers; the parent: MLA from random init, {parent_steps} steps "
                      f"on captures at {later} (vLLM's count), written naming {ids}; each child {steps} steps from "
                      f"it at the Kimi demo's recipe ({' '.join(KIMI_RECIPE)}, --vocab rebuild); served by vLLM (bf16) "
                      "on the same 12 held-out prompts, k=3; intervals: bootstrap over prompts (95%), paired by "
                      "prompt for the differences"}


def summarize(sides: dict[str, dict], paired: dict[str, dict | None]) -> dict[str, str]:
    summary = {f"{name} served": f"{s['served']:.3f} [{s['served_low']:.3f}, {s['served_high']:.3f}] on "
                                 f"{s['prompts']} prompts" for name, s in sides.items()}
    for label, d in paired.items():
        if d:
            summary[f"{label}, paired by prompt"] = f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
    return summary


if __name__ == "__main__":  # rewrite a result's summary from its figures
    path = Path(sys.argv[1])
    result = json.loads(path.read_text())
    result["summary"] = summarize(result["sides"], result["paired"])
    path.write_text(json.dumps(result, indent=2) + "\n")
