"""float64 reference of docs/sampling.md that also reports, per row, whether a
float32 implementation could legitimately disagree (a uniform, a mass or a
probability within rounding of a decision boundary).

It exists for the kernel tests: ``mtplx.sampling`` is the project's oracle
and is compared against when present, but only a reference that walks the
same decisions can say *which* rows sit on a boundary so the tests can skip
exactly those rows and no others.
"""

from __future__ import annotations

import numpy as np

# float32 kernels sum up to ~150k terms per row in a fixed order; relative
# error stays well below these margins, which only flag true near-ties.
MASS_TOL = 2e-5  # on normalised masses (top-p cut, min-p ratio)
CDF_TOL = 4e-6  # on CDF values in [0, 1]: 150k-token rows have steps below MASS_TOL
LOG_TOL = 2e-4  # on log-ratios in the accept test


def dist(z, temperature, top_p, top_k, min_p):
    """(p float64[V], ambiguous) for one row of logits."""
    z = np.asarray(z, np.float64)
    V = z.shape[0]
    if temperature == 0:
        p = np.zeros(V)
        p[int(np.argmax(z))] = 1.0  # argmax returns the lowest id on ties
        return p, False
    y = z / temperature
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        kth = np.sort(y)[::-1][top_k - 1]
        keep &= y >= kth
    w = np.where(keep, np.exp(y - y.max()), 0.0)
    p = w / w.sum()
    amb = False
    if top_p < 1.0:
        vals = np.unique(p[keep])[::-1]  # distinct kept probabilities, descending
        order = np.sort(p[keep])[::-1]
        cs = np.cumsum(order)
        mass = cs[np.searchsorted(-order, -vals, side="right") - 1]  # mass of p >= each value
        j = int(np.argmax(mass >= top_p)) if np.any(mass >= top_p) else len(vals) - 1
        amb |= abs(mass[j] - top_p) < MASS_TOL
        if j > 0:
            amb |= abs(mass[j - 1] - top_p) < MASS_TOL
        keep &= p >= vals[j]
    if min_p > 0.0:
        pm = p.max()
        near = keep & (np.abs(p - min_p * pm) < MASS_TOL * pm)
        amb |= bool(near.any())
        keep &= p >= min_p * pm
    w = np.where(keep, w, 0.0)
    return w / w.sum(), amb


def draw(w, u):
    """(token, ambiguous): smallest i with w>0 and cumsum(w)[i] >= u*sum(w)."""
    w = np.asarray(w, np.float64)
    cdf = np.cumsum(w) / w.sum()
    pos = w > 0
    i = int(np.argmax(pos & (cdf >= u))) if np.any(pos & (cdf >= u)) else int(np.nonzero(pos)[0][-1])
    amb = abs(cdf[i] - u) < CDF_TOL
    prev = np.nonzero(pos[:i])[0]
    if len(prev):
        amb |= abs(cdf[prev[-1]] - u) < CDF_TOL
    return i, bool(amb)


def sample_row(z, prm, u):
    """(token, probs, ambiguous) for one row; prm = (temperature, top_p, min_p, top_k)."""
    t, top_p, min_p, top_k = (float(x) for x in prm)
    p, amb = dist(z, t, top_p, int(top_k), min_p)
    if t == 0:
        return int(np.argmax(p)), p, amb
    tok, amb2 = draw(p, u)
    return tok, p, amb or amb2


def verify_row(zrows, d, q, prm, a, s):
    """(n, next_token, accept_probs, ambiguous, row_ambiguous[k]) for one
    sequence; row_ambiguous[i] says accept_probs[i] itself may differ."""
    t, top_p, min_p, top_k = (float(x) for x in prm)
    k = len(d)
    amb = False
    n = k
    aps = np.zeros(k)
    row_amb = np.zeros(k, bool)
    ps = []
    for i in range(k):
        p, a_i = dist(zrows[i], t, top_p, int(top_k), min_p)
        ps.append(p)
        row_amb[i] = a_i
        pd = p[d[i]]
        qd = 1.0 if q is None else float(q[i][d[i]])
        aps[i] = min(1.0, pd / qd)
        ratio = (np.log(pd) if pd > 0 else -np.inf) - np.log(qd)
        acc = np.log(a[i]) <= ratio
        if n == k:
            amb |= a_i
            if np.isfinite(ratio):
                amb |= abs(np.log(a[i]) - ratio) < LOG_TOL
            if not acc:
                n = i
    if n < k:
        p = ps[n]
        if t == 0:
            return n, int(np.argmax(p)), aps, amb, row_amb
        qrow = np.zeros_like(p)
        if q is None:
            qrow[d[n]] = 1.0
        else:
            qrow = np.asarray(q[n], np.float64)
        r = np.maximum(p - qrow, 0.0)
        if r.sum() < 1e-6:
            amb |= r.sum() > 0.0
        if r.sum() <= 0.0:
            r = p
        tok, a2 = draw(r, s)
        return n, tok, aps, amb or a2, row_amb
    p, a_k = dist(zrows[k], t, top_p, int(top_k), min_p)
    if t == 0:
        return n, int(np.argmax(p)), aps, amb or a_k, row_amb
    tok, a2 = draw(p, s)
    return n, tok, aps, amb or a_k or a2, row_amb
