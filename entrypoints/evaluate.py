"""MLproject entry point `evaluate`: the `draftline evaluate` command (see `draftline evaluate --help`)."""

import sys

from draftline.cli import cli

if __name__ == "__main__":
    cli(["evaluate", *sys.argv[1:]], prog_name="draftline")
