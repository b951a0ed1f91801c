"""``python -m flashcore.serve [options]``: the same as ``flashcore serve [options]``."""

import sys

from flashcore.serve.cli import serve_main

sys.exit(serve_main(prog="python -m flashcore.serve"))
