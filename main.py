"""Play DOOM through the neural engine: `python main.py` = `neuraldoom play` (see `--help`)."""

import sys

from neuraldoom.cli import main

if __name__ == "__main__":
    sys.exit(main(["play", *sys.argv[1:]]))
