"""`python -m mtplx`: the command line."""

import sys

from mtplx.cli.main import main

sys.exit(main())
