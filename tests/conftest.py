import os

# pytest puts tests/ (this conftest's folder, which has no __init__.py) on sys.path, so the shared
# helpers import as the package `support` (tests/support/) from any test file below it.

# Under pytest-xdist (`make test` runs 2 workers) each worker gets its share of the cores for
# OpenBLAS; a full-width pool per worker oversubscribes them (on 2 cores: 7 min 48 s with
# 2 threads per worker, 6 min 28 s with 1). Read when the library loads, so set before mtplx.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(_share))

# mtplx's config store (`mtplx.engine.tuned`: `mtplx tune`'s entries and the batch cost profiles
# an engine measures and saves) in one temp dir per test session, never the user's: made by the
# first process (xdist's controller, whose workers and servers inherit it), removed at its end.
# A server test after the first on the same model reuses the profile instead of measuring it.
_CONFIG_HOME_OWNED = "MTPLX_TEST_CONFIG_HOME" not in os.environ
if _CONFIG_HOME_OWNED:
    import tempfile

    os.environ["MTPLX_TEST_CONFIG_HOME"] = tempfile.mkdtemp(prefix="mtplx-test-config-")
os.environ["XDG_CONFIG_HOME"] = os.environ["MTPLX_TEST_CONFIG_HOME"]


def pytest_sessionfinish(session, exitstatus):
    if _CONFIG_HOME_OWNED:
        import shutil

        shutil.rmtree(os.environ["MTPLX_TEST_CONFIG_HOME"], ignore_errors=True)


# `import mtplx` first: it loads the optimized BLAS before any test module imports MLX.
import mtplx  # noqa: E402, F401

# --- default model (mtplx.checkpoints.load); shared by every test that needs a real trunk ---
import pytest as _pytest_default_model  # noqa: E402


@_pytest_default_model.fixture(scope="session")
def default_model_dir():
    """The float32 default model (SmolLM2-135M-Instruct) as an mlx-lm directory.

    Uses the normal cache (~/.cache/mtplx or $MTPLX_CACHE), so it converts once per
    machine, not once per test session.
    """
    from mtplx.checkpoints.load import default_model_dir as _default_model_dir

    return _default_model_dir("float32")


# --- the server tests' served checkpoint ---


@_pytest_default_model.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    """The checkpoint the server tests serve: a tiny random MiMo (plain attention, its own MTP head,
    context 256) with the default model's real tokenizer, one per test module (a module's server
    starts on its own copy). A module that serves another checkpoint defines its own ``model_dir``."""
    from support import checkpoints

    path = tmp_path_factory.mktemp("served") / "tiny-mimo"
    checkpoints.mimo(path, vocab_size=49152, seed=0)  # the default tokenizer's vocabulary
    checkpoints.copy_tokenizer(default_model_dir, path)
    return path
