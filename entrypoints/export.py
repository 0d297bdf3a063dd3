"""MLproject entry point `export`: the `draftline export` command (see `draftline export --help`)."""

import sys

from draftline.cli import cli

if __name__ == "__main__":
    cli(["export", *sys.argv[1:]], prog_name="draftline")
