"""mtplx: exact multi-token-prediction speculative decoding on MLX."""

from mtplx.blas import load_optimized_blas

# Before anything imports mlx: MLX binds cblas_* on first import.
BLAS = load_optimized_blas()

__version__ = "0.1.0"

from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.sample.params import SamplerConfig  # noqa: E402


def __getattr__(name: str):
    # The engine pulls in mlx-lm; keep `import mtplx` cheap for tools that only need sampling.
    if name in ("Engine", "GenerationResult", "GenerationChunk", "MtplxError"):
        from mtplx.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mtplx' has no attribute {name!r}")


__all__ = [
    "Engine",
    "GenerationRequest",
    "GenerationResult",
    "GenerationChunk",
    "MtplxError",
    "SamplerConfig",
    "BLAS",
]
