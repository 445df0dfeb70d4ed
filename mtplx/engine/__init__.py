"""The engine layer: requests, the `Engine`, text assembly, stats, sessions, tuned settings.

`from mtplx.engine import Engine` works as it always did, but lazily: the request module
(`mtplx.engine.request`) needs no MLX, so the CLI and the server can validate a request
before anything heavy loads.
"""

_PUBLIC = ("Engine", "GenerationChunk", "GenerationResult", "GenerationStats")


def __getattr__(name: str):
    if name in _PUBLIC:
        from mtplx.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mtplx.engine' has no attribute {name!r}")


__all__ = list(_PUBLIC)
