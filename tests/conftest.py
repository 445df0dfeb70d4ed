# `import mtplx` first: it loads the optimized BLAS before any test module imports MLX.
import mtplx  # noqa: F401

# --- default model (mtplx.loading); shared by every test that needs a real trunk ---
import pytest as _pytest_default_model


@_pytest_default_model.fixture(scope="session")
def default_model_dir():
    """The float32 default model (SmolLM2-135M-Instruct) as an mlx-lm directory.

    Uses the normal cache (~/.cache/mtplx or $MTPLX_CACHE), so it converts once per
    machine, not once per test session.
    """
    from mtplx.loading import default_model_dir as _default_model_dir

    return _default_model_dir("float32")
