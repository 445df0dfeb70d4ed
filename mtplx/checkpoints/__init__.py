"""Checkpoints on disk: safetensors headers, GGUF, Hub resolution, loading through mlx-lm, fingerprints, conversion, inspection."""
