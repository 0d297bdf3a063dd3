"""The mistakes a newcomer makes in the first hour: each one sentence, a non-zero exit, and nothing left behind
(no failed run for a typo, no tracking store created by a command that only reads)."""

from click.testing import CliRunner

from draftline.cli import cli


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _one_message(r) -> str:
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 or r.exit_code == 2, r.output  # click's usage errors add the usage line
    return r.output


def test_five_input_mistakes_each_say_one_thing_and_leave_no_run(workspace, prepared, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient()
    client.create_registered_model("tiny-drafter")
    typo_config = tmp_path / "finetune.yaml"
    typo_config.write_text("learning_rate: 0.01\n")
    mistakes = {
        "unknown init": (["finetune", "--data", str(prepared), "--init", "aq-media"], "did you mean 'aq-medai'?"),
        "data run that does not exist": (["finetune", "--data", "runs:/0123456789abcdef0123456789abcdef/data",
                                          "--init", "tiny"], "cannot download runs:/0123456789abcdef"),
        "stage typo": (["finetune", "--data", str(prepared), "--init", "models:/tiny-drafter/Prodution"],
                       "did you mean 'Production'?"),
        "config key typo": (["finetune", "--config", str(typo_config), "--data", str(prepared)],
                            "did you mean 'lr'?"),
        "missing path": (["finetune", "--data", str(tmp_path / "no-such-data"), "--init", "tiny"],
                         "is neither a directory nor a runs:/ URI"),
        "evaluate: unknown target": (["evaluate", "--target", "tinyy", "--data", str(prepared)],
                                     "did you mean 'tiny'?"),
        "export: no such run": (["export", "--run", "0123456789abcdef0123456789abcdef"], "does not exist on"),
    }
    for what, (args, message) in mistakes.items():
        out = _one_message(_invoke(*args))
        assert message in out, (what, out)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []
