// mtplx shared device helpers, appended after the backend prelude.
// Written only against the MTPLX_* macros so Metal, CUDA and the CPU
// emulation compile the same text. Semantics: docs/sampling.md.
//
// Conventions:
//  * One threadgroup handles one sequence; TG threads, TG a multiple of 32.
//  * Every helper that synchronises must be called by all TG threads with the
//    same arguments where it says "uniform"; results are uniform.
//  * Reductions run in a fixed order (xor butterfly inside a SIMD group, then
//    SIMD-group partials summed serially), so a given TG gives the same bits
//    on every backend and in the emulation.
//  * Pointer arguments are template parameters because Metal gives inputs
//    different address spaces (device for large arrays, constant for small).

#define MTPLX_SIMD 32u
#define MTPLX_NONE 0xFFFFFFFFu
#define MTPLX_NSPLIT 15u  // split points per threshold-search pass (16-way)

// Order-preserving float -> uint map (larger float, larger key). Adding +0.0f
// first turns -0.0 into +0.0 so equal values always tie, as top-k requires.
MTPLX_FN uint mtplx_key(float x) {
  uint b = MTPLX_AS_UINT(x + 0.0f);
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// Filter state of one row (uniform across the threadgroup).
struct mtplx_row {
  float m;      // max logit
  uint amax;    // argmax, lowest id on ties
  float t;      // temperature (> 0 unless greedy)
  uint kmin;    // keep only keys >= kmin (top-k and top-p thresholds)
  float minp;   // keep only weights >= minp (min-p: p >= min_p * max p)
  float s;      // sum of kept weights
  int greedy;   // temperature == 0: one-hot at amax
};

// Unnormalised weight of token i under the filtered distribution.
template <typename P>
MTPLX_FN float mtplx_weight(mtplx_row r, P z, uint i) {
  if (r.greedy != 0) return i == r.amax ? 1.0f : 0.0f;
  float x = z[i];
  if (mtplx_key(x) < r.kmin) return 0.0f;
  float w = MTPLX_EXP((x - r.m) / r.t);
  return w >= r.minp ? w : 0.0f;
}

// Threadgroup sums of acc[0..16) (entries >= nv are ignored), results in
// bc[0..nv). Uniform. Inside a SIMD group a transposing butterfly halves the
// values each lane carries at every step (masks 8, 4, 2, 1: 15 shuffles
// instead of 16 * 5), leaving lane l with value l & 15 summed over its half;
// a last xor-16 step adds the two halves. red must hold 16 * TG/32 floats.
// Safe to call back to back: red is written before the first barrier and read
// between the two; bc is written between them and read after the second.
template <int TG>
MTPLX_FN void mtplx_tg_sum(MTPLX_THP(float) acc, uint nv, uint lid, MTPLX_TGP(float) red,
                           MTPLX_TGP(float) bc) {
  const uint nsg = (uint)TG / MTPLX_SIMD;
  const uint lane = lid % MTPLX_SIMD;
  const uint sg = lid / MTPLX_SIMD;
  for (uint half = 8u; half >= 1u; half >>= 1u) {
    const bool upper = (lane & half) != 0u;
    for (uint j = 0; j < half; ++j) {
      const float send = upper ? acc[j] : acc[j + half];
      const float keep = upper ? acc[j + half] : acc[j];
      acc[j] = keep + MTPLX_SHFL_XOR(send, half);
    }
  }
  const float v = acc[0] + MTPLX_SHFL_XOR(acc[0], 16u);
  if (lane < nv) red[lane * nsg + sg] = v;
#ifndef MTPLX_PLANT_MISSING_BARRIER  // negative control for the race test only
  MTPLX_BARRIER();
#endif
  if (lid < nv) {
    float s = 0.0f;
    for (uint g = 0; g < nsg; ++g) s += red[lid * nsg + g];
    bc[lid] = s;
  }
  MTPLX_BARRIER();
}

// Threadgroup (max key, lowest index) and (min a, min b) reductions. Uniform;
// redu holds 2 * TG/32 uints, results in bcu[0], bcu[1].
template <int TG>
MTPLX_FN void mtplx_tg_argmax(uint k, uint i, uint lid, MTPLX_TGP(uint) redu,
                              MTPLX_TGP(uint) bcu) {
  const uint nsg = (uint)TG / MTPLX_SIMD;
  for (uint m = 16u; m >= 1u; m >>= 1u) {
    uint k2 = MTPLX_SHFL_XOR(k, m);
    uint i2 = MTPLX_SHFL_XOR(i, m);
    if (k2 > k || (k2 == k && i2 < i)) {
      k = k2;
      i = i2;
    }
  }
  if (lid % MTPLX_SIMD == 0u) {
    redu[2u * (lid / MTPLX_SIMD)] = k;
    redu[2u * (lid / MTPLX_SIMD) + 1u] = i;
  }
  MTPLX_BARRIER();
  if (lid == 0u) {
    for (uint g = 1; g < nsg; ++g) {
      uint k2 = redu[2u * g], i2 = redu[2u * g + 1u];
      if (k2 > k || (k2 == k && i2 < i)) {
        k = k2;
        i = i2;
      }
    }
    bcu[0] = k;
    bcu[1] = i;
  }
  MTPLX_BARRIER();
}

template <int TG>
MTPLX_FN void mtplx_tg_min2(uint a, uint b, uint lid, MTPLX_TGP(uint) redu, MTPLX_TGP(uint) bcu) {
  const uint nsg = (uint)TG / MTPLX_SIMD;
  for (uint m = 16u; m >= 1u; m >>= 1u) {
    a = min(a, MTPLX_SHFL_XOR(a, m));
    b = min(b, MTPLX_SHFL_XOR(b, m));
  }
  if (lid % MTPLX_SIMD == 0u) {
    redu[2u * (lid / MTPLX_SIMD)] = a;
    redu[2u * (lid / MTPLX_SIMD) + 1u] = b;
  }
  MTPLX_BARRIER();
  if (lid == 0u) {
    for (uint g = 1; g < nsg; ++g) {
      a = min(a, redu[2u * g]);
      b = min(b, redu[2u * g + 1u]);
    }
    bcu[0] = a;
    bcu[1] = b;
  }
  MTPLX_BARRIER();
}

// Threshold search without sorting: the largest key K in [lo, hi] with
// F(K) >= target, where F(K) is the count (mass == 0) or the mass
// exp((z - m) / t) (mass != 0) of tokens with key >= K. F only changes at keys
// that occur, so K is the key of an actual token: for counts it is the k-th
// largest value, for mass it is the top-p cut t*. Requires F(lo) >= target.
// Each pass tests 15 evenly spaced split points, so 32-bit keys need at most
// 8 passes over the row. Uniform.
template <int TG, typename P>
MTPLX_FN uint mtplx_search(P z, uint V, uint lid, uint lo, uint hi, int mass, float m, float t,
                           float target, MTPLX_TGP(float) red, MTPLX_TGP(float) bc) {
  while (lo < hi) {
    const uint range = hi - lo;
    const uint step = range / 16u + ((range % 16u) != 0u ? 1u : 0u);
    float acc[16];
    for (uint j = 0; j < 16u; ++j) acc[j] = 0.0f;  // acc[15] stays 0: 15 splits
    for (uint i = lid; i < V; i += (uint)TG) {
      float x = z[i];
      uint k = mtplx_key(x);
      if (k <= lo) continue;  // every split point is > lo
      float w = mass != 0 ? MTPLX_EXP((x - m) / t) : 1.0f;
      for (uint j = 0; j < MTPLX_NSPLIT; ++j) {
        uint off = (j + 1u) * step;  // <= 15 * 2^28: no overflow
        if (off <= range && k >= lo + off) acc[j] += w;
      }
    }
    mtplx_tg_sum<TG>(acc, MTPLX_NSPLIT, lid, red, bc);
    uint nlo = lo, nhi = hi;
    for (uint j = 0; j < MTPLX_NSPLIT; ++j) {
      uint off = (j + 1u) * step;
      if (off > range) break;
      if (bc[j] >= target) {
        nlo = lo + off;
      } else {
        nhi = lo + off - 1u;
        break;
      }
    }
    lo = nlo;
    hi = nhi;
  }
  return lo;
}

// Plain threadgroup sum of the filtered weights (coalesced pass). Uniform.
template <int TG, typename P>
MTPLX_FN float mtplx_mass(mtplx_row r, P z, uint V, uint lid, MTPLX_TGP(float) red,
                          MTPLX_TGP(float) bc) {
  float acc[16];
  for (uint j = 0; j < 16u; ++j) acc[j] = 0.0f;
  for (uint i = lid; i < V; i += (uint)TG) acc[0] += mtplx_weight(r, z, i);
  mtplx_tg_sum<TG>(acc, 1u, lid, red, bc);
  return bc[0];
}

// docs/sampling.md steps 3-7 for one row of V logits. Uniform.
template <int TG, typename P>
MTPLX_FN mtplx_row mtplx_filter(P z, uint V, float temperature, float top_p, int top_k,
                                float min_p, uint lid, MTPLX_TGP(float) red,
                                MTPLX_TGP(float) bc, MTPLX_TGP(uint) redu,
                                MTPLX_TGP(uint) bcu) {
  uint bk = 0u, bi = MTPLX_NONE;
  for (uint i = lid; i < V; i += (uint)TG) {
    uint k = mtplx_key(z[i]);
    if (k > bk || (k == bk && i < bi)) {
      bk = k;
      bi = i;
    }
  }
  mtplx_tg_argmax<TG>(bk, bi, lid, redu, bcu);
  mtplx_row r;
  const uint kmax = bcu[0];
  r.amax = bcu[1];
  r.m = z[r.amax];
  r.t = temperature;
  r.kmin = 0u;
  r.minp = 0.0f;
  r.s = 1.0f;
  r.greedy = temperature == 0.0f ? 1 : 0;
  if (r.greedy != 0) return r;
  // top-k on z itself: dividing by t > 0 keeps the order and the ties.
  if (top_k > 0 && (uint)top_k < V) {
    r.kmin = mtplx_search<TG>(z, V, lid, 0u, kmax, 0, r.m, r.t, (float)top_k, red, bc);
  }
  if (top_p < 1.0f) {
    float kept = mtplx_mass<TG>(r, z, V, lid, red, bc);
    r.kmin = mtplx_search<TG>(z, V, lid, r.kmin, kmax, 1, r.m, r.t, top_p * kept, red, bc);
  }
  // p >= min_p * max(p)  <=>  exp((z - m) / t) >= min_p, the max having weight 1.
  r.minp = min_p;
  r.s = mtplx_mass<TG>(r, z, V, lid, red, bc);
  return r;
}

// Weight used when drawing: mode 0 the filtered weights; mode 1 the residual
// max(p - q, 0) against a dense draft row q; mode 2 the residual against a
// one-hot draft at token d.
template <typename P, typename Q>
MTPLX_FN float mtplx_draw_weight(int mode, mtplx_row r, P z, Q q, uint d, uint i) {
  float w = mtplx_weight(r, z, i);
  if (mode == 0) return w;
  float p = w / r.s;
  float qi = mode == 1 ? q[i] : (i == d ? 1.0f : 0.0f);
  return p > qi ? p - qi : 0.0f;
}

// Inverse-CDF draw in vocabulary order: the smallest i with w[i] > 0 and
// cumsum(w)[i] >= u * sum(w). Each thread owns a contiguous chunk of the
// vocabulary so the prefix is a scan of chunk sums. Returns MTPLX_NONE when
// all weights are 0 (the caller's zero-mass fallback). When rounding leaves
// u * sum past every partial sum, the last positive token is taken. Uniform;
// scan holds TG/32 floats.
template <int TG, typename P, typename Q>
MTPLX_FN uint mtplx_draw(int mode, mtplx_row r, P z, Q q, uint d, uint V, float u, uint lid,
                         MTPLX_TGP(float) scan, MTPLX_TGP(uint) redu, MTPLX_TGP(uint) bcu) {
  const uint nsg = (uint)TG / MTPLX_SIMD;
  const uint lane = lid % MTPLX_SIMD;
  const uint sg = lid / MTPLX_SIMD;
  const uint chunk = (V + (uint)TG - 1u) / (uint)TG;
  const uint beg = min(lid * chunk, V);
  const uint end = min(beg + chunk, V);
  float c = 0.0f;
  uint last1 = 0u;  // 1 + last positive index in the chunk, 0 if none
  for (uint i = beg; i < end; ++i) {
    float w = mtplx_draw_weight(mode, r, z, q, d, i);
    c += w;
    if (w > 0.0f) last1 = i + 1u;
  }
  // Inclusive scan of chunk sums inside the SIMD group, then across groups.
  float x = c;
  for (uint k = 1u; k < MTPLX_SIMD; k <<= 1u) {
    float y = MTPLX_SHFL_UP(x, k);
    if (lane >= k) x += y;
  }
  float before = MTPLX_SHFL_UP(x, 1u);
  if (lane == 0u) before = 0.0f;
  if (lane == MTPLX_SIMD - 1u) scan[sg] = x;
  MTPLX_BARRIER();
  float pre = 0.0f, total = 0.0f;
  for (uint g = 0; g < nsg; ++g) {
    if (g < sg) pre += scan[g];
    total += scan[g];
  }
  const float target = u * total;
  const float start = pre + before;
  uint cand = MTPLX_NONE;
  if (c > 0.0f && start + c >= target) {
    float run = start;
    for (uint i = beg; i < end; ++i) {
      float w = mtplx_draw_weight(mode, r, z, q, d, i);
      if (w > 0.0f) {
        run += w;
        if (run >= target) {
          cand = i;
          break;
        }
      }
    }
    if (cand == MTPLX_NONE) cand = last1 - 1u;
  }
  mtplx_tg_min2<TG>(cand, ~last1, lid, redu, bcu);
  if (bcu[0] != MTPLX_NONE) return bcu[0];
  const uint last = ~bcu[1];
  return last == 0u ? MTPLX_NONE : last - 1u;
}
