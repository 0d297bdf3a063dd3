"""The DRAFTLINE_* variables: read when needed, typed, a wrong value one line naming the variable."""

import pytest
from click.testing import CliRunner

from draftline import environment
from draftline.cli import cli
from draftline.errors import ConfigError


def test_a_variable_is_read_when_it_is_needed_and_empty_is_its_default(monkeypatch):
    monkeypatch.setenv("DRAFTLINE_RETRY_S", "7.5")
    assert environment.RETRY_S.get() == 7.5
    monkeypatch.setenv("DRAFTLINE_RETRY_S", " ")
    assert environment.RETRY_S.get() == 120.0
    monkeypatch.setenv("DRAFTLINE_VERBOSE", "0")
    assert environment.VERBOSE.get() is False


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_value_of_the_wrong_type_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("DRAFTLINE_PROMOTION_WAIT_S", value)
    with pytest.raises(ConfigError, match=f"DRAFTLINE_PROMOTION_WAIT_S='{value}' is not seconds"):
        environment.PROMOTION_WAIT_S.get()


def test_the_cli_says_it_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTLINE_EXPERIMENT", "x")
    monkeypatch.setenv("DRAFTLINE_REGISTRY_POLICIES", str(tmp_path / "none"))
    monkeypatch.setenv("DRAFTLINE_RETRY_S", "soon")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    r = CliRunner().invoke(cli, ["pull", "m", "--version", "1", "--dest", str(tmp_path / "d")])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and errors == ["error: DRAFTLINE_RETRY_S='soon' is not seconds: set it to seconds or "
                                           "unset it (default: 120.0)"], r.output
