"""`python -m mtplx`: the command line."""

import sys

from mtplx.cli import main

sys.exit(main())
