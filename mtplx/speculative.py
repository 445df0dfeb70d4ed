"""Speculative-decoding math, re-exported from the oracle for callers that think in those terms."""

from mtplx.sampling import speculative_output_marginal

__all__ = ["speculative_output_marginal"]
