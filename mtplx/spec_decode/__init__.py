"""Speculative decoding: the one loop (`loop.py`), the `Proposer` protocol (`proposer.py`),
one file per proposer (`head_proposer.py`, `lookup_proposer.py`, `draft_model_proposer.py`,
`auto_proposer.py`), the choice of drafter and depth (`select.py`) and what a decode is
configured by (`settings.py`, standard library only: the CLI reads it before loading MLX).
"""
