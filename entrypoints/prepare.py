"""MLproject entry point `prepare`: the `draftline prepare` command (see `draftline prepare --help`)."""

import sys

from draftline.cli import cli

if __name__ == "__main__":
    cli(["prepare", *sys.argv[1:]], prog_name="draftline")
