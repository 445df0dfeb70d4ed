"""Drafters (proposers) for the one speculative loop in `mtplx.spec_decode.loop`; see `base.py`.

base.py: the `Proposer` protocol and `Draft`; head.py: the MTP head chain; lookup.py:
prompt lookup; draft_model.py: a separate small model; auto.py: lookup, else a model drafter.
This package module stays import-light (the CLI reads the kinds before loading MLX).
"""

DRAFT_KINDS = ("auto", "head", "lookup", "model", "none")
