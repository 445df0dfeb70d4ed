"""Speculative decoding: the one cycle (`loop.py`, `BatchDecoder`: one row or many), the `Proposer`
protocol (`proposer.py`), one file per proposer (`head_proposer.py`, batch-first `HeadChain` and the
single-row `HeadProposer`; `lookup_proposer.py`, `draft_model_proposer.py`, `auto_proposer.py`),
drafting decided in one module (`drafting.py`: drafter, depth defaults, the per-row drafter table),
the draft-length policy (`draft_policy.py`), a cycle's rows and data (`rows.py`, `block.py`,
`step.py`) and what a decode is configured by (`settings.py`, standard library only: the CLI reads
it before loading MLX).
"""
