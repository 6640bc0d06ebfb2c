"""``python -m taps.train tokenizer|target ...``: the ``taps train`` subcommands without the main CLI."""

import sys

from .cli import main

sys.exit(main())
