"""The command line: `mtplx.cli:main` is the entry point (`mtplx`, `python -m mtplx`)."""

from mtplx.cli.main import main

__all__ = ["main"]
