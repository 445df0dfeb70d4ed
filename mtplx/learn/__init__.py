"""Heads that learn from served traffic: the traffic log (`mtplx serve --learn DIR`), training from it
(`mtplx forge --from-traffic DIR`) and the server's background trainer (issue 54)."""
