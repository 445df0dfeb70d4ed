"""Fused kernels on a machine without Metal or CUDA: the shared kernel bodies run
under the CPU emulation (real threads, real barriers, exact SIMD shuffles) and
must match the NumPy mirror token for token; rows whose outcome sits within
rounding of a boundary are detected (tests/support/kernel_ref.py) and skipped
explicitly, and the skip rate is bounded so the comparison cannot go vacuous."""

import secrets

import mtplx  # noqa: F401  (before mlx: BLAS loader)
from mtplx.sample import emulation as E

import numpy as np
import pytest
from support import kernel_ref as ref

PARAMS = {
    "plain": (1.0, 1.0, 0.0, 0),
    "temp": (0.6, 1.0, 0.0, 0),
    "top_k": (1.0, 1.0, 0.0, 20),
    "top_p": (0.8, 0.9, 0.0, 0),
    "min_p": (1.3, 1.0, 0.05, 0),
    "all": (0.7, 0.85, 0.02, 40),
    "greedy": (0.0, 1.0, 0.0, 0),
}


def _uniforms(rng, shape):
    return (1.0 - rng.random(shape)).astype(np.float32)  # (0, 1]


def make_verify_case(rng, B, k, V, kinds, draft, ties=False, masked=False):
    scale = rng.uniform(1.0, 6.0)
    z = (rng.standard_normal((B, k + 1, V)) * scale).astype(np.float32)
    if ties:  # coarse logits: many exact ties at top-k / top-p / argmax boundaries
        z = np.round(z * 2) / 2
    if masked:
        z[rng.random(z.shape) < 0.05] = -np.inf
    params = np.array([PARAMS[kinds[b % len(kinds)]] for b in range(B)], np.float32)
    drafts = np.zeros((B, k), np.int32)
    q = np.zeros((B, k, V), np.float32) if draft != "onehot" else None
    for b in range(B):
        t, top_p, min_p, top_k = params[b]
        for i in range(k):
            # Drafts from a perturbed target row so acceptance walks get long.
            zq = z[b, i] + rng.standard_normal(V).astype(np.float32) * rng.uniform(0.0, 1.5)
            if draft == "dense":
                tq = t if t > 0 else 1.0
                qi, _ = ref.dist(zq, tq, top_p, int(top_k), min_p)
                qi = qi.astype(np.float32)
                q64 = qi.astype(np.float64)
                drafts[b, i] = rng.choice(V, p=q64 / q64.sum())
                q[b, i] = qi
            else:
                drafts[b, i] = int(np.argmax(np.where(np.isfinite(zq), zq, -1e30)))
                if draft == "dense_onehot":
                    q[b, i, drafts[b, i]] = 1.0
    return z, drafts, q, params, _uniforms(rng, (B, k)), _uniforms(rng, (B,))


def check_verify(case, tg, defines=()):
    """(checked rows, skipped rows); asserts on every unambiguous row."""
    z, d, q, params, a, s = case
    n, tok, ap = E.emulate_verify(z, d, q, params, a, s, tg=tg, defines=defines)
    rn, rtok, rap = E.numpy_mirror_verify(z, d, q, params, a, s)
    checked = skipped = 0
    for b in range(z.shape[0]):
        ln, ltok, lap, amb, row_amb = ref.verify_row(
            z[b], d[b], None if q is None else q[b], params[b], a[b], s[b]
        )
        ok = ~row_amb
        np.testing.assert_allclose(
            ap[b][ok], rap[b][ok], rtol=2e-4, atol=1e-6, err_msg=f"accept_probs row {b}"
        )
        if amb:
            skipped += 1
            continue
        # The boundary detector must agree with the project oracle where it
        # claims the row is unambiguous, or its skips could hide anything.
        assert (ln, ltok) == (rn[b], rtok[b]), f"reference disagrees with sampling.py, row {b}"
        assert (n[b], tok[b]) == (rn[b], rtok[b]), (
            f"row {b}: kernel (n={n[b]}, tok={tok[b]}) vs oracle (n={rn[b]}, tok={rtok[b]}), "
            f"params={params[b].tolist()}"
        )
        checked += 1
    return checked, skipped


def check_sample(logits, params, u, tg):
    tok, probs = E.emulate_sample(logits, params, u, tg=tg)
    rtok, rprobs = E.numpy_mirror_sample(logits, params, u)
    checked = skipped = 0
    for b in range(logits.shape[0]):
        ltok, lp, amb = ref.sample_row(logits[b], params[b], u[b])
        if amb:
            skipped += 1
            continue
        assert ltok == rtok[b]
        assert tok[b] == rtok[b], f"row {b}: kernel {tok[b]} vs oracle {rtok[b]}"
        np.testing.assert_allclose(probs[b], rprobs[b], rtol=2e-4, atol=2e-7)
        checked += 1
    return checked, skipped


# (B, k, V, param kinds, draft kind, TG, ties, masked)
VERIFY_SHAPES = [
    (1, 1, 37, ["plain"], "dense", 32, False, False),
    (2, 3, 37, ["top_k", "top_p"], "onehot", 32, True, False),
    (3, 8, 37, ["all", "greedy", "min_p"], "dense", 64, False, True),
    (4, 2, 100, ["temp", "top_k", "top_p", "min_p"], "dense", 64, False, False),
    (2, 3, 257, ["all"], "dense_onehot", 128, True, False),
    (1, 8, 1000, ["top_p"], "dense", 64, False, False),
    (2, 4, 1000, ["greedy", "plain"], "onehot", 32, True, True),
    (3, 6, 4099, ["min_p", "all", "top_k"], "dense", 64, False, False),
    (1, 2, 4099, ["all"], "onehot", 256, False, True),
    (2, 2, 32000, ["top_k", "temp"], "dense", 64, False, False),
    (4, 1, 32000, ["plain", "greedy", "top_p", "all"], "dense_onehot", 32, False, False),
    (1, 3, 151936, ["all"], "dense", 256, False, False),
    (2, 2, 151936, ["plain", "greedy"], "onehot", 64, False, False),
]


def test_verify_matches_oracle_fixed_seeds():
    checked = skipped = 0
    for seed, (B, k, V, kinds, draft, tg, ties, masked) in enumerate(VERIFY_SHAPES):
        rng = np.random.default_rng(1000 + seed)
        c, s = check_verify(make_verify_case(rng, B, k, V, kinds, draft, ties, masked), tg)
        checked, skipped = checked + c, skipped + s
    assert checked >= 0.8 * (checked + skipped), f"too many boundary skips: {skipped}/{checked + skipped}"


def test_verify_matches_oracle_fresh_random():
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    checked = skipped = 0
    for _ in range(4):
        B, k = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        V = int(rng.choice([37, 50, 513, 2000, 8191]))
        kinds = list(rng.choice(list(PARAMS), size=B))
        draft = str(rng.choice(["dense", "onehot", "dense_onehot"]))
        case = make_verify_case(
            rng, B, k, V, kinds, draft, bool(rng.random() < 0.3), bool(rng.random() < 0.3)
        )
        try:
            c, s = check_verify(case, int(rng.choice([32, 64])))
        except AssertionError as e:
            raise AssertionError(f"fresh-random seed {seed}: {e}") from e
        checked, skipped = checked + c, skipped + s
    assert checked >= 1, f"seed {seed}: every row skipped"


def test_sample_matches_oracle():
    checked = skipped = 0
    for seed, (B, V, tg) in enumerate(
        [(4, 37, 32), (4, 1000, 64), (3, 4099, 128), (4, 32000, 64), (2, 151936, 256)]
    ):
        rng = np.random.default_rng(2000 + seed)
        logits = (rng.standard_normal((B, V)) * rng.uniform(1, 6)).astype(np.float32)
        if seed == 1:
            logits = np.round(logits)  # ties
        kinds = list(PARAMS)
        params = np.array([PARAMS[kinds[(seed + b) % len(kinds)]] for b in range(B)], np.float32)
        c, s = check_sample(logits, params, _uniforms(rng, (B,)), tg)
        checked, skipped = checked + c, skipped + s
    assert checked >= 0.8 * (checked + skipped)


def test_uniform_exactly_one_and_single_survivor():
    # u = 1 must land on the last kept token despite float32 partial sums;
    # top_k = 1 leaves a single token whatever the uniform.
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 500)).astype(np.float32)
    params = np.array([PARAMS["top_p"], (1.0, 1.0, 0.0, 1)], np.float32)
    u = np.ones(2, np.float32)
    tok, _ = E.emulate_sample(logits, params, u, tg=64)
    rtok, _ = E.numpy_mirror_sample(logits, params, u)
    assert tok.tolist() == rtok.tolist()


def test_planted_accept_off_by_one_fails_oracle():
    # Negative control: the same comparison must catch a walk that reports one
    # position too many after a rejection.
    rng = np.random.default_rng(11)
    case = make_verify_case(rng, 4, 6, 300, ["plain", "top_p", "temp", "all"], "dense")
    assert check_verify(case, 32)[0] >= 2  # clean body passes on this case
    with pytest.raises(AssertionError, match="kernel"):
        check_verify(case, 32, defines=["MTPLX_PLANT_ACCEPT_OFF_BY_ONE"])


# ---------------------------------------------------------------- sanitizer


def _tsan_case():
    rng = np.random.default_rng(5)
    return make_verify_case(rng, 2, 2, 200, ["all", "plain"], "dense")


def test_tsan_clean_and_matches_oracle():
    z, d, q, params, a, s = _tsan_case()
    (n, tok, ap), rc, err = E.emulate_verify(z, d, q, params, a, s, tg=64, tsan=True)
    assert rc == 0 and "ThreadSanitizer" not in err, err[-4000:]
    ln, ltok, _ = E.numpy_mirror_verify(z, d, q, params, a, s)
    assert n.tolist() == ln.tolist() and tok.tolist() == ltok.tolist()
    (tok2, _), rc, err = E.emulate_sample(z[:, 0], params, s, tg=64, tsan=True)
    assert rc == 0 and "ThreadSanitizer" not in err, err[-4000:]


def test_tsan_reports_planted_missing_barrier():
    z, d, q, params, a, s = _tsan_case()
    _, rc, err = E.emulate_verify(
        z, d, q, params, a, s, tg=64, tsan=True, defines=["MTPLX_PLANT_MISSING_BARRIER"]
    )
    assert rc == 66 and "data race" in err, (rc, err[-2000:])
