"""Speculative decoding: the one cycle (`loop.py`, `BatchDecoder`: one row or many), the drafter
contract (`draft_block.py`: drafters return a `DraftBlock`; `sources.py`: the `Source` vocabulary),
one module per drafter, each batch-first (`head_chain.py`, `lookup_proposer.py`,
`draft_model_proposer.py`, the grammar's forced tokens in `constraint.py`; their shared draw in
`proposer.py`), drafting resolved in one module (`drafting.py`: drafter, depth defaults, a row's
sources), the draft-length policy (`draft_policy.py`), a cycle's rows and data (`rows.py`,
`block.py`, `step.py`) and what a decode is configured by (`settings.py`, standard library only:
the CLI reads it before loading MLX).
"""
