"""`python -m mtplx` (and `mlx.launch ... mtplx/__main__.py`): the `mtplx` command line."""

import sys

from mtplx.cli import main

sys.exit(main())
