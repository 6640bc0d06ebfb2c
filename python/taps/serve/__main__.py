"""``python -m taps.serve [options]``: the same as ``taps serve [options]``."""

import sys

from taps.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
