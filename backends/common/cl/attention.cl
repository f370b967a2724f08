// Attention templates (dense and paged), instantiated per node by the host, which defines:
//   KNAME               the kernel name
//   ACC, ACC_MAX        float/nmaxf, or double/nmaxd for f64 queries
//   QLD/KLD/VLD(p, i)   load a query / key / value element as ACC; OST(p, i, v) stores output
//   HEAD_D, HEAD_DV     the (constant) head dims; DV_PER = ceil(HEAD_DV / KILN_WG)
//   KERNEL_AUX_PARAMS   ", cgptr b_aux0, ..." (may be empty)
//   AUX_SETUP           statements defining px<k>, xn<k>, xs<k> for each aux tensor
//   AUX_ARGS            ", px0, xn0, xs0, ..." (may be empty)
//   MASK(b, h, q, kv)   (optional) mask_mod, true keeps the score
//   SCORE(s, b, h, q, kv) (optional) score_mod
//   KV_BEGIN(q), KV_END(q, len)  the keys that can be unmasked (causal and sliding-window masks
//                       skip whole blocks; the mask is still applied inside)
// and for the paged form PAGED plus BT_LD, SL_LD, QS_LD (block table, seq_lens and
// query_start loaders, as long). The dense form with LSE (and LST(p, i, v), the store of an
// ACC as the log-sum-exp's dtype) also writes each row's log-sum-exp, max + log(sum), to a
// second output [B, Hq, Tq] (-inf for fully masked rows).
//
// One work-group per query row and head. Its work-items take one key each per block of
// KILN_WG keys (score, then the block's softmax against the running maximum: flash
// attention's online rescaling) and own DV_PER output dims each for the weighted sum of
// values. Semantics of the reference: fully masked rows give zeros, NaN scores propagate, a
// paged query row that belongs to no sequence gives zeros, invalid block-table entries mask
// their keys.

#ifdef PAGED
// Meta: q TD (0), k cache TD (18), v cache TD (36), out TD (54), block table off/s0/s1/S/MB
// (72), seq_lens off/s0 (77), query_start off/s0 (79), scale as double bits (81) and float
// bits (82), aux off/len/stride (83 + 3k).
#define SCALE_META 81
#else
// Meta: q TD (0), k TD (18), v TD (36), out TD (54), scale as double bits (72) and float bits
// (73), [LSE: lse byte offset and strides (74..77)], aux off/len/stride (74 or 78 + 3k).
#define SCALE_META 72
#endif
#ifdef LSE
#define ATTN_META meta120
#else
#define ATTN_META meta96
#endif

__kernel void KNAME(gptr b_out, cgptr b_q, cgptr b_k, cgptr b_v
#ifdef PAGED
                    , cgptr b_bt, cgptr b_sl, cgptr b_qs
#endif
#ifdef LSE
                    , gptr b_lse
#endif
                    KERNEL_AUX_PARAMS, const ATTN_META mt) {
  const long* m = mt.v;
  cgptr pq = b_q + TD_OFF(m, 0);
  cgptr pk = b_k + TD_OFF(m, 18);
  cgptr pv = b_v + TD_OFF(m, 36);
  gptr po = b_out + TD_OFF(m, 54);
  AUX_SETUP
  const int lid = get_local_id(0);
#ifdef KILN_FP64
  const ACC scale = (ACC)as_double(m[SCALE_META]);
#else
  const ACC scale = (ACC)as_float((int)m[SCALE_META + 1]);
#endif
  __local ACC qv[HEAD_D];
  __local ACC sc[KILN_WG];
  __local ACC red[KILN_WG];
  __local long vrow[KILN_WG];
  const long ske = TD_STRIDE(m, 18, 3), sve = TD_STRIDE(m, 36, 3);
  const long sqe = TD_STRIDE(m, 0, TD_RANK(m, 0) - 1), soe = TD_STRIDE(m, 54, TD_RANK(m, 54) - 1);
#ifdef PAGED
  cgptr pbt = b_bt + m[72];
  cgptr psl = b_sl + m[77];
  cgptr pqs = b_qs + m[79];
  const long T = TD_SHAPE(m, 0, 0), Hq = TD_SHAPE(m, 0, 1);
  const long NB = TD_SHAPE(m, 18, 0), BS = TD_SHAPE(m, 18, 1), Hkv = TD_SHAPE(m, 18, 2);
  const long S = m[75], MB = m[76];
  const long rows = T * Hq;
#else
  const long B = TD_SHAPE(m, 0, 0), Hq = TD_SHAPE(m, 0, 1), Tq = TD_SHAPE(m, 0, 2);
  const long Hkv = TD_SHAPE(m, 18, 1), Tk = TD_SHAPE(m, 18, 2);
  const long rows = B * Hq * Tq;
#endif
  for (long row = get_group_id(0); row < rows; row += get_num_groups(0)) {
#ifdef PAGED
    const long t = row / Hq, h = row % Hq;
    // The last sequence whose queries contain t (the reference writes sequences in order).
    long seq = -1, q0 = 0, q1 = 0;
    for (long s = 0; s < S; ++s) {
      const long a = clamp(QS_LD(pqs, s * m[80]), 0L, T);
      const long e = clamp(QS_LD(pqs, (s + 1) * m[80]), a, T);
      if (t >= a && t < e) {
        seq = s;
        q0 = a;
        q1 = e;
      }
    }
    const long kvlen = seq < 0 ? 0 : max(SL_LD(psl, seq * m[78]), 0L);
    const long qi = kvlen - (q1 - q0) + (t - q0);
    const long bb = seq;
    const long qbase = t * TD_STRIDE(m, 0, 0) + h * TD_STRIDE(m, 0, 1);
    const long obase = t * TD_STRIDE(m, 54, 0) + h * TD_STRIDE(m, 54, 1);
#else
    const long i = row % Tq, h = (row / Tq) % Hq, b = row / (Tq * Hq);
    const long qi = i, bb = b;
    const long kvlen = Tk;
    const long qbase = b * TD_STRIDE(m, 0, 0) + h * TD_STRIDE(m, 0, 1) + i * TD_STRIDE(m, 0, 2);
    const long obase = b * TD_STRIDE(m, 54, 0) + h * TD_STRIDE(m, 54, 1) + i * TD_STRIDE(m, 54, 2);
#endif
    const long kh = h / (Hq / Hkv);
    for (int e = lid; e < HEAD_D; e += KILN_WG) qv[e] = QLD(pq, qbase + e * sqe);
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC mx = -INFINITY, l = 0;
    ACC acc[DV_PER];
    for (int d = 0; d < DV_PER; ++d) acc[d] = 0;
    const long jb = max(KV_BEGIN(qi), 0L), je = min(KV_END(qi, kvlen), kvlen);
    for (long j0 = jb; j0 < je; j0 += KILN_WG) {
      const long j = j0 + lid;
      ACC s = -INFINITY;
      long ko = -1, vo = -1;  // element offsets of key j's rows (-1: no such key)
      if (j < je) {
#ifdef PAGED
        const long slot = j / BS;
        const long blk = slot < MB ? BT_LD(pbt, bb * m[73] + slot * m[74]) : -1;
        if (blk >= 0 && blk < NB) {
          ko = blk * TD_STRIDE(m, 18, 0) + (j % BS) * TD_STRIDE(m, 18, 1) + kh * TD_STRIDE(m, 18, 2);
          vo = blk * TD_STRIDE(m, 36, 0) + (j % BS) * TD_STRIDE(m, 36, 1) + kh * TD_STRIDE(m, 36, 2);
        }
#else
        ko = bb * TD_STRIDE(m, 18, 0) + kh * TD_STRIDE(m, 18, 1) + j * TD_STRIDE(m, 18, 2);
        vo = bb * TD_STRIDE(m, 36, 0) + kh * TD_STRIDE(m, 36, 1) + j * TD_STRIDE(m, 36, 2);
#endif
      }
      if (ko >= 0) {
        ACC dot = 0;
        for (int e = 0; e < HEAD_D; ++e) dot += qv[e] * KLD(pk, ko + e * ske);
        s = dot * scale;
#ifdef SCORE
        s = SCORE(s, bb, h, qi, j);
#endif
#ifdef MASK
        if (!MASK(bb, h, qi, j)) s = -INFINITY;
#endif
      }
      vrow[lid] = vo;
      red[lid] = s;
      barrier(CLK_LOCAL_MEM_FENCE);
      for (int w = KILN_WG / 2; w > 0; w >>= 1) {
        if (lid < w) red[lid] = ACC_MAX(red[lid], red[lid + w]);
        barrier(CLK_LOCAL_MEM_FENCE);
      }
      const ACC mn = ACC_MAX(mx, red[0]);
      barrier(CLK_LOCAL_MEM_FENCE);
      const ACC p = (mn == -INFINITY || s == -INFINITY) ? (ACC)0 : exp(s - mn);
      sc[lid] = p;
      red[lid] = p;
      barrier(CLK_LOCAL_MEM_FENCE);
      for (int w = KILN_WG / 2; w > 0; w >>= 1) {
        if (lid < w) red[lid] += red[lid + w];
        barrier(CLK_LOCAL_MEM_FENCE);
      }
      if (mn != -INFINITY) {
        const ACC corr = mx == -INFINITY ? (ACC)0 : exp(mx - mn);
        l = l * corr + red[0];
        const long cnt = min((long)KILN_WG, je - j0);
        for (int dd = 0; dd < DV_PER; ++dd) {
          const long d = lid + (long)dd * KILN_WG;
          ACC a = acc[dd] * corr;
          if (d < HEAD_DV) {
            for (long jj = 0; jj < cnt; ++jj) {
              const ACC w = sc[jj];
              if (w == (ACC)0) continue;
              a += w * VLD(pv, vrow[jj] + d * sve);
            }
          }
          acc[dd] = a;
        }
        mx = mn;
      }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int dd = 0; dd < DV_PER; ++dd) {
      const long d = lid + (long)dd * KILN_WG;
      if (d < HEAD_DV) OST(po, obase + d * soe, mx == -INFINITY ? (ACC)0 : acc[dd] / l);
    }
#ifdef LSE
    if (lid == 0) {
      LST(b_lse + m[74], b * m[75] + h * m[76] + i * m[77], mx == -INFINITY ? mx : mx + log(l));
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}
#undef SCALE_META
#undef ATTN_META
