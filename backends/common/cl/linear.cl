// Linear and MatMul templates, instantiated per dtype combination by the host, which defines
// before the template:
//   KNAME             the kernel name
//   ACC               float, or double for f64
//   XLD(p, i)         load element i of x / a (as ACC)
//   WLD(p, i)         load element i of w / b (as ACC)
//   OST(p, i, v)      store v into element i of the output
// and for LINEAR: MT (x rows per work-group) and, for 32-element block types with a float
// accumulator, WDEQ32(wv, p, e): dequantize the 32 elements from element e (a multiple of 32)
// into float wv[32]; without it WLD is used element by element (float weights of any
// strides, K-quants). LINEAR_SG (devices with sub-group shuffles, KILN_SG lanes) also takes
// MT, SGR (weight rows per work-group of SGR * KILN_SG) and, for block types, WDEQ8(wv, p, e):
// the 8 elements from element e (a multiple of 8) into float wv[8]. For MATMUL: TS (TS * TS =
// KILN_WG).

#if defined(LINEAR) || defined(LINEAR_SG)
// Meta: x TD (0), w off/stride_n/stride_k (18..20), out TD (21), M, N, K (39..41).
#define LINEAR_META                             \
  const long* m = mt.v;                         \
  cgptr px = b_x + TD_OFF(m, 0);                \
  cgptr pw = b_w + m[18];                       \
  gptr po = b_out + TD_OFF(m, 21);              \
  const long wsn = m[19], wsk = m[20];          \
  const long M = m[39], N = m[40], K = m[41];   \
  const long xsk = TD_STRIDE(m, 0, TD_RANK(m, 0) - 1)
// Where rows m0 .. m0 + MT - 1 of x start (0 past M). (Macros, not functions: a program may
// hold several instantiations of this file.)
#define LINEAR_ROWS(xrow) \
  for (int i_ = 0; i_ < MT; ++i_) xrow[i_] = m0 + i_ < M ? td_offset(m, 0, (m0 + i_) * K) : 0
// s += the dot product of x's row from xo with the B dequantized weights wv of elements k0..
// (fewer where K ends), in order.
#define LINEAR_DOT(s, xo, k0, wv, B)                                                           \
  do {                                                                                         \
    if (xsk == 1 && (k0) + (B) <= K) {                                                         \
      for (int j_ = 0; j_ < (B); ++j_) s += XLD(px, (xo) + (k0) + j_) * (ACC)(wv)[j_];        \
    } else {                                                                                   \
      for (int j_ = 0; j_ < (B) && (k0) + j_ < K; ++j_) {                                     \
        s += XLD(px, (xo) + ((k0) + j_) * xsk) * (ACC)(wv)[j_];                                \
      }                                                                                        \
    }                                                                                          \
  } while (0)
#endif

#ifdef LINEAR
// out[m, n] = sum_k x[m, k] * w[n, k]: dequantize-in-register dot products. A work-group
// computes NR weight rows for MT rows of x; its work-items split K (in 32-element blocks for
// block types where the host defines WDEQ32, element by element otherwise) and combine their
// partial sums in local memory.
// Weights are read once per MT rows of x.
#define NR 4
__kernel void KNAME(gptr b_out, cgptr b_x, cgptr b_w, const meta48 mt) {
  LINEAR_META;
  const int lid = get_local_id(0);
  const long n0 = get_group_id(0) * NR, m0 = get_group_id(1) * MT;
  long xrow[MT];
  LINEAR_ROWS(xrow);
  ACC acc[MT][NR];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = 0;
#ifdef WDEQ32
  // Block weights: each work-item dequantizes whole 32-element blocks.
  for (long k0 = (long)lid * 32; k0 < K; k0 += (long)KILN_WG * 32) {
    for (int r = 0; r < NR; ++r) {
      const long n = n0 + r;
      if (n >= N) break;
      float wv[32];
      WDEQ32(wv, pw, n * wsn + k0);
      for (int i = 0; i < MT; ++i) {
        if (m0 + i >= M) break;
        ACC s = 0;
        LINEAR_DOT(s, xrow[i], k0, wv, 32);
        acc[i][r] += s;
      }
    }
  }
#else
  // Element weights (f16, bf16, f32, K-quants): work-items take elements KILN_WG apart, so
  // neighbours read neighbouring weights (coalesced on GPUs) and every work-item has work
  // however small K is.
  for (long k = lid; k < K; k += KILN_WG) {
    for (int r = 0; r < NR; ++r) {
      const long n = n0 + r;
      if (n >= N) break;
      const ACC wv = WLD(pw, n * wsn + k * wsk);
      for (int i = 0; i < MT; ++i) {
        if (m0 + i >= M) break;
        acc[i][r] += XLD(px, xrow[i] + k * xsk) * wv;
      }
    }
  }
#endif
  // The NR rows' partial sums reduced together: one barrier per tree level for all of them.
  __local ACC red[NR * KILN_WG];
  for (int i = 0; i < MT; ++i) {
    for (int r = 0; r < NR; ++r) red[r * KILN_WG + lid] = acc[i][r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = KILN_WG / 2; s > 0; s >>= 1) {
      if (lid < s) {
        for (int r = 0; r < NR; ++r) red[r * KILN_WG + lid] += red[r * KILN_WG + lid + s];
      }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < NR && m0 + i < M && n0 + lid < N) {
      OST(po, td_offset(m, 21, (m0 + i) * N + n0 + lid), red[lid * KILN_WG]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}
#undef NR
#endif

#ifdef LINEAR_SG
// The decode GEMV on GPUs, out[m, n] = sum_k x[m, k] * w[n, k] for MT rows of x: one sub-group
// (a CUDA warp, a HIP wavefront: KILN_SG lanes) per weight row, SGR rows per work-group. The
// lanes split K — for block types with WDEQ8, 8 elements each (a quarter block in word loads,
// neighbouring lanes on neighbouring bytes; one round of loads for K up to 8 * KILN_SG),
// elements KILN_SG apart otherwise (coalesced) — and combine their sums with shuffles
// (sub_group_sum): no local memory and no barrier.
__kernel void KNAME(gptr b_out, cgptr b_x, cgptr b_w, const meta48 mt) {
  LINEAR_META;
  const int lane = (int)(get_local_id(0) % KILN_SG);
  const long n = get_group_id(0) * SGR + get_local_id(0) / KILN_SG;  // the same for a sub-group
  const long m0 = get_group_id(1) * MT;
  long xrow[MT];
  LINEAR_ROWS(xrow);
  ACC acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = 0;
  if (n < N) {
#ifdef WDEQ8
    for (long k0 = (long)lane * 8; k0 < K; k0 += (long)KILN_SG * 8) {
      float wv[8];
      WDEQ8(wv, pw, n * wsn + k0);
      for (int i = 0; i < MT; ++i) {
        if (m0 + i >= M) break;
        ACC s = 0;
        LINEAR_DOT(s, xrow[i], k0, wv, 8);
        acc[i] += s;
      }
    }
#else
    for (long k = lane; k < K; k += KILN_SG) {
      const ACC wv = WLD(pw, n * wsn + k * wsk);
      for (int i = 0; i < MT; ++i) {
        if (m0 + i >= M) break;
        acc[i] += XLD(px, xrow[i] + k * xsk) * wv;
      }
    }
#endif
  }
  // Every lane of the sub-group takes part in the shuffles (n and M are uniform across it).
  for (int i = 0; i < MT; ++i) {
    const ACC s = sub_group_sum(acc[i]);
    if (lane == 0 && n < N && m0 + i < M) OST(po, td_offset(m, 21, (m0 + i) * N + n), s);
  }
}
#endif

#ifdef MATMUL
// out[b, i, j] = sum_k a[b, i, k] * bm[b, k, j] with local-memory tiles of TS x TS (TS*TS =
// KILN_WG); any strides (broadcast batch dims have stride 0).
// Meta: a TD (0), b TD (18), out TD (36), M, N, K, batch (54..57).
__kernel void KNAME(gptr b_out, cgptr b_a, cgptr b_b, const meta64 mt) {
  const long* m = mt.v;
  cgptr pa = b_a + TD_OFF(m, 0);
  cgptr pb = b_b + TD_OFF(m, 18);
  gptr po = b_out + TD_OFF(m, 36);
  const long M = m[54], N = m[55], K = m[56];
  const int ra = TD_RANK(m, 0), rb = TD_RANK(m, 18);
  const long sam = TD_STRIDE(m, 0, ra - 2), sak = TD_STRIDE(m, 0, ra - 1);
  const long sbk = TD_STRIDE(m, 18, rb - 2), sbn = TD_STRIDE(m, 18, rb - 1);
  const int tx = get_local_id(0), ty = get_local_id(1);
  const long j = get_group_id(0) * TS + tx, i = get_group_id(1) * TS + ty;
  const long bidx = get_global_id(2);
  const long abase = td_offset(m, 0, bidx * M * K), bbase = td_offset(m, 18, bidx * K * N);
  __local ACC ta[TS][TS + 1];
  __local ACC tb[TS][TS + 1];
  ACC acc = 0;
  for (long k0 = 0; k0 < K; k0 += TS) {
    ta[ty][tx] = (i < M && k0 + tx < K) ? XLD(pa, abase + i * sam + (k0 + tx) * sak) : (ACC)0;
    tb[ty][tx] = (j < N && k0 + ty < K) ? WLD(pb, bbase + (k0 + ty) * sbk + j * sbn) : (ACC)0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 0; k < TS; ++k) acc += ta[ty][k] * tb[k][tx];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (i < M && j < N) OST(po, td_offset(m, 36, (bidx * M + i) * N + j), acc);
}
#endif
