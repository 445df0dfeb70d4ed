"""`mtplx bench` and `mtplx tune`: interleaved speed sweeps against stock mlx-lm (a command; the engine never imports it)."""
