"""The hostile-user battery: bad inputs through the CLI, as a careful but unlucky user makes them. For each:
a non-zero exit, one `error:` line naming the input (no traceback), no MLflow run, no folder under work/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from draftline.cli import cli

# 25 cases (24 CLI runs), ~70 s on 2 cores: the full suite's (the quick loop keeps its 3 minutes)
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo" / "conversations.jsonl"
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


def _write(tmp: Path, name: str, content: str | bytes) -> Path:
    p = tmp / "inputs" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def _lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _broken_verifier(tiny, tmp: Path, how: str) -> Path:
    out = shutil.copytree(tiny["verifier"], tmp / f"verifier-{how}")
    if how == "no-tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (out / f).unlink()
    else:
        text = (out / "config.json").read_text()
        (out / "config.json").write_text(text[: len(text) // 2])
    return out


# (case, input file maker or None, extra flags, expected exit code, text the message must contain)
CASES = [
    ("non-utf8", lambda t: _write(t, "latin1.jsonl", _lines(GOOD).encode() + b'{"prompt": "caf\xe9"}\n'), [], 1,
     "not UTF-8: line 2, byte offset"),
    ("parquet-invalid", lambda t: _write(t, "x.parquet", b"PAR1 not really"), [], 1, "not a readable Parquet file"),
    ("empty", lambda t: _write(t, "empty.jsonl", ""), [], 1, "no usable conversation"),
    ("whitespace", lambda t: _write(t, "ws.jsonl", "  \n\n \n"), [], 1, "no usable conversation"),
    ("array-of-strings", lambda t: _write(t, "a.json", '["hello", "world"]'), [], 1, "not a JSON object"),
    ("unknown-role", lambda t: _write(t, "r.jsonl", _lines({"messages": [{"role": "robot", "content": "x"}]})), [],
     1, "role in system|user|assistant"),
    ("system-only", lambda t: _write(t, "s.jsonl", _lines({"messages": [{"role": "system", "content": "x"}]})), [],
     1, "no user or assistant turn"),
    ("sharegpt-no-from", lambda t: _write(t, "g.jsonl", _lines({"conversations": [{"value": "x"}]})), [], 1,
     "ShareGPT turn needs from"),
    ("csv", lambda t: _write(t, "c.csv", "prompt,answer\nhi,hello\n"), [], 1, ".csv files are not read"),
    ("broken-line", lambda t: _write(t, "b.jsonl", _lines(GOOD, '{"messages": [', {**GOOD, "id": "2"})), [], 1,
     "line 2: invalid JSON"),
    ("duplicate-ids", lambda t: _write(t, "d.jsonl", _lines(*({**GOOD, "id": "same"} for _ in range(4)))), [], 1,
     "id 'same' is used already by line 1"),
    ("empty-assistant", lambda t: _write(t, "e.jsonl", _lines(
        GOOD, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]})), [], 1,
     "empty assistant turn"),
    ("aux-out-of-range", None, ["--aux-layers", "2,4,99"], 1, "within [0, 8]"),
    ("aux-duplicate", None, ["--aux-layers", "2,2,5"], 1, "must be distinct"),
    ("endpoint-unreachable", None, ["--regenerate-endpoint", "http://127.0.0.1:9/v1"], 1, "is unreachable"),
]


@pytest.mark.parametrize("case,make,flags,code,text", CASES, ids=[c[0] for c in CASES])
def test_prepare_refuses_each_bad_input_in_one_line_leaving_nothing(workspace, tiny, tmp_path, case, make, flags,
                                                                    code, text):
    source = make(tmp_path) if make else DEMO
    r = CliRunner().invoke(cli, ["prepare", "--conversations", str(source), "--verifier", str(tiny["verifier"]),
                                 *flags])
    _one_clean_error(r, code, text, workspace)


@pytest.mark.parametrize("how,text", [("no-tokenizer", "has no tokenizer files"),
                                      ("truncated-config", "config.json is not valid JSON (line")])
def test_prepare_refuses_a_broken_verifier_in_one_line(workspace, tiny, tmp_path, how, text):
    verifier = _broken_verifier(tiny, tmp_path, how)
    r = CliRunner().invoke(cli, ["prepare", "--conversations", str(DEMO), "--verifier", str(verifier)])
    _one_clean_error(r, 1, text, workspace)


def test_a_random_folder_is_not_a_dataset(workspace, tiny, tmp_path):
    folder = tmp_path / "random"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"\x00\x01")
    r = CliRunner().invoke(cli, ["prepare", "--conversations", str(folder), "--verifier", str(tiny["verifier"])])
    _one_clean_error(r, 1, "not a Hugging Face dataset", workspace)


def test_skip_bad_records_skips_and_counts_them(tmp_path):
    from draftline.data.conversations import load_conversations

    src = _write(tmp_path, "mixed.jsonl", _lines(GOOD, '{"messages": [', {**GOOD, "id": "x"}, {**GOOD, "id": "x"}))
    convs = load_conversations(src, skip_bad=True)
    assert [s["id"] for s in convs.samples] == ["mixed-1", "x", "x~4"]
    assert [n for n, _ in convs.skipped] == [2, 4]


def test_a_valid_parquet_file_is_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from draftline.data.conversations import load_conversations

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "id": "1"}, {"prompt": "yo", "id": "2"}]), path)
    assert [s["id"] for s in load_conversations(path, prompts=True).samples] == ["1", "2"]


@pytest.mark.parametrize("name,why", [("team/drafter", "it has '/'"), ("my drafter", "it has a space")])
def test_export_to_a_name_the_rule_refuses_is_refused_before_any_work(workspace, name, why):
    r = CliRunner().invoke(cli, ["export", "--run", "0" * 32, "--registered-model", name])
    _one_clean_error(r, 2, f"error: {name!r} cannot be a registered model name ({why}): use only letters a-z A-Z, "
                           "digits 0-9, '-', '_' and '.', beginning with a letter or digit", workspace)


def test_finetune_refuses_a_bad_ds_config_and_a_tiny_token_budget_before_its_run(workspace, prepared, tmp_path):
    bad = _write(tmp_path, "ds.json", '{"zero_optimization": 3}')
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", "tiny", "--ds-config", str(bad)])
    _one_clean_error(r, 2, "zero_optimization must be a JSON object", workspace)  # a bad config file: usage
    no_batch = _write(tmp_path, "ds-no-batch.json", '{"zero_optimization": {"stage": 2}}')
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", "tiny", "--ds-config", str(no_batch)])
    _one_clean_error(r, 2, f"DeepSpeed config {no_batch}: Either train_batch_size or train_micro_batch_size_per_gpu "
                           "needs to be provided", workspace)
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", "tiny", "--tokens-per-batch", "16"])
    _one_clean_error(r, 1, "is below the shortest sample", workspace)


def test_a_parent_whose_config_disagrees_with_its_weights_is_refused(workspace, prepared, tiny, tmp_path):
    parent = shutil.copytree(tiny["parent"], tmp_path / "parent")
    cfg = json.loads((parent / "config.json").read_text())
    (parent / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", str(parent)])
    _one_clean_error(r, 1, f"says hidden size {2 * cfg['hidden_size']} but its weights have hidden size "
                           f"{cfg['hidden_size']}", workspace)


def test_an_html_error_page_is_summed_up_in_one_line():
    from draftline.data.regenerate import first_line

    page = "<!DOCTYPE html>\n<html>\n<head><title>502 Bad Gateway</title></head>\n<body>\n<h1>Bad</h1>\n</body></html>"
    assert first_line(page) == "an HTML page: 502 Bad Gateway"


def _one_clean_error(r, code: int, text: str, workspace: Path, lines: int = 1) -> None:
    out = r.output.strip()
    assert r.exit_code == code, out
    assert "Traceback" not in out and text in out, out
    assert len(out.splitlines()) <= lines, out
    assert not (workspace / "mlflow.db").exists() or _runs(workspace) == 0, "a run was left behind"
    prepared = workspace / "work" / "prepared"
    assert not prepared.exists() or not any(prepared.iterdir()), list(prepared.iterdir())


def _runs(workspace: Path) -> int:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
