"""MLproject entry point `finetune`: the `draftline finetune` command (see `draftline finetune --help`)."""

import sys

from draftline.cli import cli

if __name__ == "__main__":
    cli(["finetune", *sys.argv[1:]], prog_name="draftline")
