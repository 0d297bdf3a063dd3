"""MLproject entry point `main`: the `draftline main` command (see `draftline main --help`)."""

import sys

from draftline.cli import cli

if __name__ == "__main__":
    cli(["main", *sys.argv[1:]], prog_name="draftline")
