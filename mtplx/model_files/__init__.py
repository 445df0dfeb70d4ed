"""The ground floor for model files on disk: safetensors headers, weight fingerprints, hub ids.

Imports nothing of mtplx but ``mtplx.errors``, so the trunk, the heads, the engine and the
checkpoint tools all read model files through it without importing upward.
"""
