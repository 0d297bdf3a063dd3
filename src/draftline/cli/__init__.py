"""``draftline``: the command line. Each command parses flags and calls one library function.

Options of the stage commands are generated from the stage's pydantic settings (their descriptions are the
help), and ``--config FILE`` supplies any of them from YAML (flag > file > default). Expected failures print one
line and exit 1 (2 for usage errors); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from draftline.cli import plan, registry, serve, stages  # noqa: F401  (their commands join the group)
from draftline.cli.common import _settings, cli, settings_options  # noqa: F401  (the public face)


def main() -> None:
    cli(prog_name="draftline")


if __name__ == "__main__":
    main()
