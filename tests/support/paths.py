"""Where the checkout is, for tests that run its files (scripts, the README, subprocesses)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/paths.py -> the repository root
