"""A mistake prepare, finetune, evaluate or export can see before work begins is refused before torch, transformers, speculators, DeepSpeed,
MLflow, datasets or pyarrow load: asserted by which modules the process holds when the refusal is printed (what
cannot flake), with the wall time shown beside it."""

import json
import os
import subprocess
import sys
import time

import pytest

from draftline import names

from ...conftest import DEMO

HEAVY = ("torch", "transformers", "speculators", "deepspeed", "mlflow", "datasets", "pyarrow", "vllm")
# the CLI as `draftline` runs it; at exit, the exit code and which heavy modules were loaded
PROBE = """
import json, os, sys
from draftline.cli import cli
try:
    cli(sys.argv[1:], prog_name="draftline")
    code = 0
except SystemExit as e:
    code = e.code
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump({"code": code, "loaded": sorted(m for m in %r if m in sys.modules)}, f)
""" % (HEAVY,)


def _refusal(tmp_path, *args, env=None):
    out = tmp_path / "probe.json"
    env = {**os.environ, "PROBE_OUT": str(out), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           **(env or {})}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    wall = time.perf_counter() - t0
    probe = json.loads(out.read_text())
    print(f"{args[:3]}: refused in {wall:.2f} s, exit {probe['code']}")
    return probe, r.stderr


def _verifier(tmp_path, tiny, *, drop=(), config=None):
    d = tmp_path / "verifier"
    d.mkdir()
    for f in tiny["verifier"].iterdir():
        if f.name not in drop and f.is_file():
            (d / f.name).symlink_to(f)
    if config is not None:
        (d / "config.json").unlink()
        (d / "config.json").write_text(config)
    return d


CASES = {
    "conversations that do not exist": (lambda t, tiny: ("/nonexistent/convs.jsonl", tiny["verifier"]),
                                        "conversations /nonexistent/convs.jsonl does not exist"),
    "an empty conversations file": (lambda t, tiny: (_write(t / "empty.jsonl", ""), tiny["verifier"]),
                                    "empty.jsonl"),
    "a JSON list cut short": (lambda t, tiny: (_write(t / "cut.json", '[{"messages": ['), tiny["verifier"]),
                              "is not valid JSON"),
    "a verifier that is not a directory": (lambda t, tiny: (DEMO, t / "no-such-verifier"), "is not a directory"),
    "a verifier without config.json": (lambda t, tiny: (DEMO, _verifier(t, tiny, drop=("config.json",))),
                                       "has no config.json"),
    "a verifier whose config.json is broken": (lambda t, tiny: (DEMO, _verifier(t, tiny, config='{"model_type":')),
                                               "config.json is not valid JSON"),
    "a verifier without tokenizer files": (
        lambda t, tiny: (DEMO, _verifier(t, tiny, drop=("tokenizer.json", "tokenizer.model", "vocab.json"))),
        "has no tokenizer files"),
}


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_prepare_refuses_before_the_heavy_libraries_load(case, tiny, tmp_path):
    make, says = CASES[case]
    conversations, verifier = make(tmp_path, tiny)
    probe, stderr = _refusal(tmp_path, "prepare", "--conversations", conversations, "--verifier", verifier)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert probe["code"] == 1 and len(errors) == 1 and says in errors[0], stderr
    assert probe["loaded"] == [], f"loaded before the refusal: {probe['loaded']}"
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "work").exists()


def _data(tmp_path, manifest="{}"):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "manifest.json").write_text(manifest)
    return d


STAGE_CASES = {
    "finetune on data that does not exist": (lambda t: ["finetune", "--data", t / "nope"],
                                             "is neither a directory nor a runs:/ URI", 1),
    "finetune on a folder that is not prepared data": (lambda t: ["finetune", "--data", t],
                                                       "has no manifest.json", 1),
    "finetune on a broken manifest": (lambda t: ["finetune", "--data", _data(t, "{")], "is not valid JSON", 1),
    "finetune with an evaluation set that does not exist": (
        lambda t: ["finetune", "--data", _data(t), "--eval-data", t / "nope"], "data " + "{t}/nope", 1),
    "finetune with a DeepSpeed config that does not exist": (
        lambda t: ["finetune", "--data", _data(t), "--ds-config", t / "zero.json"], "does not exist", 2),
    "finetune with a DeepSpeed config that is not JSON": (
        lambda t: ["finetune", "--data", _data(t), "--ds-config", _write(t / "zero.json", "{")], "is unreadable", 2),
    "finetune with a hostfile that does not exist": (
        lambda t: ["finetune", "--data", _data(t), "--hostfile", t / "hosts"], "hostfile", 1),
    "finetune with a setting out of range": (lambda t: ["finetune", "--data", _data(t), "--steps", "0"],
                                             "steps: Input should be greater than or equal to 1", 2),
    "evaluate on data that does not exist": (lambda t: ["evaluate", "--target", "runs:/x", "--data", t / "nope"],
                                             "is neither a directory nor a runs:/ URI", 1),
    "export to a name MLflow cannot hold": (lambda t: ["export", "--run", "x", "--registered-model", "a/b"],
                                            "cannot be a registered model name", 2),
    "finetune on a run of a local store that does not exist": (
        lambda t: ["finetune", "--data", f"runs:/{'0' * 32}/data", "--init", "kimi-k25"], "no tracking store at", 1),
    "export of a run of a local store that does not exist": (lambda t: ["export", "--run", "0" * 32],
                                                             "no tracking store at", 1),
}


def test_a_run_the_store_does_not_hold_or_that_did_not_finish_is_refused_before_any_stage_loads(tmp_path):
    """Only the tracking store can tell: MLflow loads (under 4 s), torch and the stages do not, nothing is written."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    failed = client.create_run(client.create_experiment("e"), tags={names.STEP: "prepare"}).info.run_id
    client.set_terminated(failed, "FAILED")
    for args, says in ((["finetune", "--data", f"runs:/{'0' * 32}/data"], "does not exist in sqlite"),
                       (["finetune", "--data", f"runs:/{failed}/data"], "(prepare) is FAILED, not FINISHED"),
                       (["evaluate", "--target", f"runs:/{failed}", "--data", f"runs:/{'0' * 32}/data"],
                        "does not exist in sqlite"),
                       (["export", "--run", failed], "is FAILED, not FINISHED")):
        probe, stderr = _refusal(tmp_path, *args)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert probe["code"] == 1 and len(errors) == 1 and says in errors[0], stderr
        assert not {"torch", "deepspeed", "transformers", "speculators"} & set(probe["loaded"]), probe["loaded"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "probe.json"]


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_the_other_stages_refuse_before_the_heavy_libraries_load(case, tmp_path):
    make, says, code = STAGE_CASES[case]
    probe, stderr = _refusal(tmp_path, *make(tmp_path))
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert probe["code"] == code and len(errors) == 1 and says.format(t=tmp_path) in errors[0], stderr
    assert probe["loaded"] == [], f"loaded before the refusal: {probe['loaded']}"
    assert not (tmp_path / "mlflow.db").exists()


UNREACHABLE = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}  # the discard port: nothing listens, refused at once
REGISTRY_CASES = {
    "promote through a policy file that does not exist": (
        lambda t: ["promote", "m", "1", "--to", "Production", "--policy", t / "nope.yaml"], None,
        "policy file {t}/nope.yaml does not exist", 2),
    "promote through a policy that is not YAML": (
        lambda t: ["promote", "m", "1", "--to", "Production", "--policy", _write(t / "p.yaml", "stage: [")], None,
        "not valid YAML", 2),
    "promote through a policy with a misspelt rule": (
        lambda t: ["promote", "m", "1", "--to", "Staging", "--policy",
                   _write(t / "p.yaml", "stage: Staging\nrequire_tag: [a]\n")], None,
        "did you mean require_tags?", 2),
    "rollback through a policy file that does not exist": (
        lambda t: ["rollback", "m", "--reason", "r", "--policy", t / "nope.yaml"], None, "does not exist", 2),
    "a registered model name MLflow cannot hold": (lambda t: ["pull", "a/b", "--version", "1", "--dest", t / "d"],
                                                   None, "cannot be a registered model name", 2),
    "pull from a local store that does not exist": (lambda t: ["pull", "m", "--version", "1", "--dest", t / "d"],
                                                    None, "no tracking store at", 1),
    "pull from a tracking server that does not answer": (
        lambda t: ["pull", "m", "--version", "1", "--dest", t / "d"], UNREACHABLE, "is unreachable", 75),
    "promote on a tracking server that does not answer": (
        lambda t: ["promote", "m", "1", "--to", "Production"], UNREACHABLE, "is unreachable", 75),
    "list on a tracking server that does not answer": (lambda t: ["list"], UNREACHABLE, "is unreachable", 75),
    "export to a tracking server that does not answer": (
        lambda t: ["export", "--run", "x", "--registered-model", "m"], UNREACHABLE, "is unreachable", 75),
    "prepare for a tracking server that does not answer": (
        lambda t: ["prepare", "--conversations", DEMO, "--verifier", t / "v"], UNREACHABLE, "is not a directory", 1),
    "a DRAFTLINE_ variable of the wrong type": (lambda t: ["list"], {"DRAFTLINE_RETRY_S": "soon"},
                                                "DRAFTLINE_RETRY_S='soon' is not seconds", 2),
    "a log level draftline does not know": (lambda t: ["list"], {"DRAFTLINE_LOG": "verbose"},
                                            "DRAFTLINE_LOG='verbose' is not warning, info or debug", 2),
    "a tracking server named without its scheme": (
        lambda t: ["list"], {"MLFLOW_TRACKING_URI": "mlflow:5000"},
        "MLFLOW_TRACKING_URI=mlflow:5000 names no scheme: a tracking server is http://mlflow:5000", 1),
}


@pytest.mark.parametrize("case", list(REGISTRY_CASES))
def test_the_registry_and_the_tracking_store_refuse_before_mlflow_loads(case, tmp_path):
    make, env, says, code = REGISTRY_CASES[case]
    probe, stderr = _refusal(tmp_path, *make(tmp_path), env=env)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert probe["code"] == code and len(errors) == 1 and says.format(t=tmp_path) in errors[0], stderr
    assert probe["loaded"] == [], f"loaded before the refusal: {probe['loaded']}"
    assert not (tmp_path / "mlflow.db").exists()


def test_all_of_finetunes_mistakes_are_said_at_once(tmp_path):
    """A mistyped parent is not hidden behind a missing data run: every mistake finetune can see, in one error,
    before any stage loads, with nothing written."""
    probe, stderr = _refusal(tmp_path, "finetune", "--data", f"runs:/{'0' * 32}/data", "--init", "kimi-k2x",
                             "--ds-config", tmp_path / "nope.json")
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert probe["code"] == 2 and len(errors) == 1, stderr  # a usage mistake among them: usage's exit code
    assert errors[0].startswith("error: 3 problems: (1) init 'kimi-k2x' is not 'random'"), errors[0]
    assert "did you mean 'kimi-k25-mla'?" in errors[0] and f"(2) DeepSpeed config {tmp_path}/nope.json" in errors[0]
    assert f"(3) --data names run {'0' * 32}, and there is no tracking store" in errors[0]
    assert probe["loaded"] == [] and sorted(p.name for p in tmp_path.iterdir()) == ["probe.json"]
