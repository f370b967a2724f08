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
//
// BACKWARD instead instantiates attention's backward (flash attention's, from the forward's
// log-sum-exp; no score_mod), with D_PER = ceil(HEAD_D / KILN_WG), loaders OLD, DOLD (o and
// its gradient) and LSELD, and stores DQST, DKST, DVST. One launch without atomics over
// B*Hq*Tq + B*Hkv*Tk rows, one work-group per row: a query row's dq (summing over its keys),
// then a key row's dk and dv (summing over every query row of every query head of its kv
// head). Both recompute P = exp(score - lse) and dS = P (dP - D_i), dP = do . v,
// D_i = do . o; where P is 0 (masked, or the row fully masked) the pair adds nothing, as in
// the reference.
//
// Block tables (BLOCKS, masks other than a plain causal or sliding-window one): CLASSIFY
// instantiates the pre-pass that evaluates mask_mod once per (query, key) pair and classifies
// each tile of KILN_WG query rows x KILN_WG keys as empty (0), full (1) or partial (2), per
// batch row and head where the mask reads them. The kernels then skip empty blocks whole (no
// key loaded, no mask evaluated), skip the mask in full ones, and store the number of blocks
// each work-group row visited (the launch's diagnostics). The paged form's tiles are KILN_WG
// query tokens (each with its own sequence and position) x KILN_WG key positions, per head
// where the mask reads it; key blocks past the table (no block-table slot) hold no key.

// KEEP(b, h, q, kv): the mask, or 1. Keys it hides are never loaded: their score is -inf and
// their P 0 without a dot product.
#ifdef MASK
#define KEEP(b, h, q, kv) MASK(b, h, q, kv)
#else
#define KEEP(b, h, q, kv) 1
#endif

#ifdef BLOCKS
// BLOCK_META: the table's byte offset, its batch and head strides (0 where the mask reads
// neither; the paged table has no batch rows), its key blocks per query tile, the visit
// counts' byte offset (one uint per row).
#define BLOCK_SETUP                                                                    \
  cgptr ptbl = b_tbl + m[BLOCK_META];                                                  \
  const long tsb = m[BLOCK_META + 1], tsh = m[BLOCK_META + 2], tnkb = m[BLOCK_META + 3]; \
  __global uint* pvis = (__global uint*)(b_tbl + m[BLOCK_META + 4]);
// The class of the block holding query row (paged: token) i and key j (empty past the table);
// the first block to walk from key jb.
#define BLOCK_CLASS(b, h, i, j)                                                           \
  ((j) / KILN_WG < tnkb                                                                   \
       ? (int)ptbl[(b) * tsb + (h) * tsh + ((i) / KILN_WG) * tnkb + (j) / KILN_WG] \
       : 0)
#define BLOCK_START(jb) ((jb) - (jb) % KILN_WG)
#define BLOCK_VISITS(row, n) \
  if (lid == 0) pvis[row] = (uint)(n);
#else
#define BLOCK_SETUP
#define BLOCK_CLASS(b, h, i, j) 2
#define BLOCK_START(jb) (jb)
#define BLOCK_VISITS(row, n)
#endif
#ifdef BLOCKS
#define BLOCK_PARAM , gptr b_tbl
#else
#define BLOCK_PARAM
#endif

#ifdef PAGED
// The last sequence whose queries contain token t (the reference writes sequences in order),
// from query_start (pqs, element stride qss) over S sequences: sets seq (-1: none) and its
// query tokens [q0, q1).
#define PAGED_SEQ(t, T, S, pqs, qss, seq, q0, q1)                \
  for (long s_ = 0; s_ < (S); ++s_) {                           \
    const long a_ = clamp(QS_LD(pqs, s_ * (qss)), 0L, (T));     \
    const long e_ = clamp(QS_LD(pqs, (s_ + 1) * (qss)), a_, (T)); \
    if ((t) >= a_ && (t) < e_) {                                \
      seq = s_;                                                 \
      q0 = a_;                                                  \
      q1 = e_;                                                  \
    }                                                           \
  }
#endif

#ifdef CLASSIFY
// The class of a block from each work-item's flags (whether the mask kept any / all of its
// pairs), reduced over the work-group in __local any_kept and all_kept, stored by work-item 0
// to `dst`: empty (0), full (1), partial (2).
#define CLASSIFY_STORE(any, all, dst)                                          \
  any_kept[lid] = (any);                                                       \
  all_kept[lid] = (all);                                                       \
  barrier(CLK_LOCAL_MEM_FENCE);                                                \
  for (int w = KILN_WG / 2; w > 0; w >>= 1) {                                  \
    if (lid < w) {                                                             \
      any_kept[lid] |= any_kept[lid + w];                                      \
      all_kept[lid] &= all_kept[lid + w];                                      \
    }                                                                          \
    barrier(CLK_LOCAL_MEM_FENCE);                                              \
  }                                                                            \
  if (lid == 0) (dst) = (uchar)(any_kept[0] ? (all_kept[0] ? 1 : 2) : 0);     \
  barrier(CLK_LOCAL_MEM_FENCE);
#endif

#if defined(CLASSIFY) && defined(PAGED)
// Meta: the table's byte offset (0), T (1), key blocks per token tile (2), the heads it has
// (3: 1 where the mask reads no h), S (4), seq_lens off/s0 (5, 6), query_start off/s0 (7, 8),
// aux off/len/stride (9 + 3k). One work-group per (head, token tile): it finds its tokens'
// sequences, positions and key counts once, classifies the key blocks up to the tile's
// longest sequence, and marks the blocks past it empty (no token of the tile has such keys;
// the attention kernel never walks them). A block is full when every token keeps every key
// of it that its sequence has.
__kernel void KNAME(gptr b_tbl, cgptr b_sl, cgptr b_qs KERNEL_AUX_PARAMS, const meta32 mt) {
  const long* m = mt.v;
  AUX_SETUP
  gptr pt = b_tbl + m[0];
  cgptr psl = b_sl + m[5];
  cgptr pqs = b_qs + m[7];
  const long T = m[1], nkb = m[2], TH = m[3], S = m[4];
  const long nqt = (T + KILN_WG - 1) / KILN_WG;
  const int lid = get_local_id(0);
  __local long tseq[KILN_WG];  // the tile's tokens: sequence (-1: none), position, key count
  __local long tpos[KILN_WG];
  __local long tlen[KILN_WG];
  __local long longest[KILN_WG];
  __local int any_kept[KILN_WG];
  __local int all_kept[KILN_WG];
  for (long g = get_group_id(0); g < TH * nqt; g += get_num_groups(0)) {
    const long qt = g % nqt, h = g / nqt;
    {
      const long t = qt * KILN_WG + lid;
      long seq = -1, q0 = 0, q1 = 0;
      if (t < T) PAGED_SEQ(t, T, S, pqs, m[8], seq, q0, q1)
      const long len = seq < 0 ? 0 : max(SL_LD(psl, seq * m[6]), 0L);
      tseq[lid] = seq;
      tpos[lid] = len - (q1 - q0) + (t - q0);
      tlen[lid] = len;
      longest[lid] = len;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = KILN_WG / 2; w > 0; w >>= 1) {
      if (lid < w) longest[lid] = max(longest[lid], longest[lid + w]);
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    const long kbn = min(nkb, (longest[0] + KILN_WG - 1) / KILN_WG);
    gptr row = pt + (h * nqt + qt) * nkb;
    for (long kb = 0; kb < kbn; ++kb) {
      const long j = kb * KILN_WG + lid;
      int any = 0, all = 1;
      for (int r = 0; r < KILN_WG; ++r) {
        if (tseq[r] < 0 || j >= tlen[r]) continue;
        if (KEEP(tseq[r], h, tpos[r], j)) {
          any = 1;
        } else {
          all = 0;
        }
      }
      CLASSIFY_STORE(any, all, row[kb])
    }
    for (long kb = kbn + lid; kb < nkb; kb += KILN_WG) row[kb] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}
#elif defined(CLASSIFY)
// Meta: the table's byte offset (0), Tq, Tk (1, 2), the batch rows and heads it has (3, 4:
// 1 where the mask reads no b or h), aux off/len/stride (5 + 3k). One work-group per table
// entry: its work-items take one key each and walk the tile's query rows.
__kernel void KNAME(gptr b_tbl KERNEL_AUX_PARAMS, const meta32 mt) {
  const long* m = mt.v;
  AUX_SETUP
  gptr pt = b_tbl + m[0];
  const long Tq = m[1], Tk = m[2], TB = m[3], TH = m[4];
  const long nqt = (Tq + KILN_WG - 1) / KILN_WG, nkb = (Tk + KILN_WG - 1) / KILN_WG;
  const long n = TB * TH * nqt * nkb;
  const int lid = get_local_id(0);
  __local int any_kept[KILN_WG];
  __local int all_kept[KILN_WG];
  for (long e = get_group_id(0); e < n; e += get_num_groups(0)) {
    const long kb = e % nkb, qt = (e / nkb) % nqt, h = (e / (nkb * nqt)) % TH;
    const long b = e / (nkb * nqt * TH);
    const long j = kb * KILN_WG + lid;
    int any = 0, all = 1;
    if (j < Tk) {
      const long i1 = min(Tq, (qt + 1) * KILN_WG);
      for (long i = qt * KILN_WG; i < i1; ++i) {
        if (KEEP(b, h, i, j)) {
          any = 1;
        } else {
          all = 0;
        }
      }
    }
    CLASSIFY_STORE(any, all, pt[e])
  }
}
#elif !defined(BACKWARD)
#ifdef PAGED
// Meta: q TD (0), k cache TD (18), v cache TD (36), out TD (54), block table off/s0/s1/S/MB
// (72), seq_lens off/s0 (77), query_start off/s0 (79), scale as double bits (81) and float
// bits (82), [BLOCKS: BLOCK_META's five values (83)], aux off/len/stride (after them, + 3k).
#define SCALE_META 81
#else
// Meta: q TD (0), k TD (18), v TD (36), out TD (54), scale as double bits (72) and float bits
// (73), [LSE: lse byte offset and strides (74..77)], [BLOCKS: BLOCK_META's five values
// (74 or 78)], aux off/len/stride (after them, + 3k).
#define SCALE_META 72
#endif
#if defined(LSE) || defined(BLOCKS)
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
                    BLOCK_PARAM KERNEL_AUX_PARAMS, const ATTN_META mt) {
  const long* m = mt.v;
  cgptr pq = b_q + TD_OFF(m, 0);
  cgptr pk = b_k + TD_OFF(m, 18);
  cgptr pv = b_v + TD_OFF(m, 36);
  gptr po = b_out + TD_OFF(m, 54);
  AUX_SETUP
  BLOCK_SETUP
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
    long seq = -1, q0 = 0, q1 = 0;
    PAGED_SEQ(t, T, S, pqs, m[80], seq, q0, q1)
    const long kvlen = seq < 0 ? 0 : max(SL_LD(psl, seq * m[78]), 0L);
    const long qi = kvlen - (q1 - q0) + (t - q0);
    const long bb = seq;
    const long tb = 0, ti = t;  // the block table's row: the token's tile
    const long qbase = t * TD_STRIDE(m, 0, 0) + h * TD_STRIDE(m, 0, 1);
    const long obase = t * TD_STRIDE(m, 54, 0) + h * TD_STRIDE(m, 54, 1);
#else
    const long i = row % Tq, h = (row / Tq) % Hq, b = row / (Tq * Hq);
    const long qi = i, bb = b;
    const long tb = b, ti = i;
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
    long visited = 0;
    for (long j0 = BLOCK_START(jb); j0 < je; j0 += KILN_WG) {
      const int cls = BLOCK_CLASS(tb, h, ti, j0);
      if (cls == 0) continue;  // the mask hides the whole block (the same for every work-item)
      ++visited;
      const long j = j0 + lid;
      ACC s = -INFINITY;
      long ko = -1, vo = -1;  // element offsets of key j's rows (-1: no such key)
      if (j >= jb && j < je) {
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
      if (ko >= 0 && (cls == 1 || KEEP(bb, h, qi, j))) {
        ACC dot = 0;
        for (int e = 0; e < HEAD_D; ++e) dot += qv[e] * KLD(pk, ko + e * ske);
        s = dot * scale;
#ifdef SCORE
        s = SCORE(s, bb, h, qi, j);
#endif
      } else {
        vo = -1;
      }
      vrow[lid] = vo;
      red[lid] = s;
      barrier(CLK_LOCAL_MEM_FENCE);
      for (int w = KILN_WG / 2; w > 0; w >>= 1) {
        if (lid < w) red[lid] = ACC_MAX(red[lid], red[lid + w]);
        barrier(CLK_LOCAL_MEM_FENCE);
      }
      const ACC chunk_max = red[0];
      const ACC mn = ACC_MAX(mx, chunk_max);
      barrier(CLK_LOCAL_MEM_FENCE);
      if (chunk_max == -INFINITY) continue;  // every key of the block hidden: nothing to add
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
    BLOCK_VISITS(row, visited)
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
#else  // BACKWARD

// Meta: B, Hq, Tq, Hkv, Tk (0..4); for q, k, v, o, do, dq, dk, dv (t = 0..7) the byte offset
// and the 4 element strides (5 + 5t); lse's byte offset and 3 strides (45); scale as double
// bits (49) and float bits (50); [BLOCKS: BLOCK_META's five values (51)]; aux off/len/stride
// (after them, + 3k).
#define BW_OFF(t) m[5 + 5 * (t)]
#define BW_S(t, d) m[6 + 5 * (t) + (d)]
#define BW_ROW(t, b, h, r) ((b) * BW_S(t, 0) + (h) * BW_S(t, 1) + (r) * BW_S(t, 2))
// P of a pair the mask keeps (KEEP) from its q . k: 0 where the row is fully masked (lse
// -inf).
#define BW_P(dot, lse) ((lse) != -INFINITY ? exp((dot) * scale - (lse)) : (ACC)0)
// acc[dd] (dim d = lid + dd * KILN_WG < DIM) += w[n] * LD(p, rows[n] + d * s) over the
// block's cnt pairs whose P (wp) is not 0.
#define BW_ACCUMULATE(acc, PER, DIM, w, LD, p, rows, s)                   \
  for (int dd = 0; dd < PER; ++dd) {                                      \
    const long d = lid + (long)dd * KILN_WG;                              \
    ACC a = acc[dd];                                                      \
    if (d < DIM) {                                                        \
      for (long n = 0; n < cnt; ++n) {                                    \
        if (wp[n] != (ACC)0) a += w[n] * LD(p, rows[n] + d * (s));        \
      }                                                                   \
    }                                                                     \
    acc[dd] = a;                                                          \
  }

__kernel void KNAME(gptr b_dq, gptr b_dk, gptr b_dv, cgptr b_q, cgptr b_k, cgptr b_v,
                    cgptr b_o, cgptr b_do, cgptr b_lse BLOCK_PARAM KERNEL_AUX_PARAMS,
                    const meta96 mt) {
  const long* m = mt.v;
  cgptr pq = b_q + BW_OFF(0);
  cgptr pk = b_k + BW_OFF(1);
  cgptr pv = b_v + BW_OFF(2);
  cgptr po = b_o + BW_OFF(3);
  cgptr pdo = b_do + BW_OFF(4);
  gptr pdq = b_dq + BW_OFF(5);
  gptr pdk = b_dk + BW_OFF(6);
  gptr pdv = b_dv + BW_OFF(7);
  cgptr plse = b_lse + m[45];
  AUX_SETUP
  BLOCK_SETUP
  const int lid = get_local_id(0);
#ifdef KILN_FP64
  const ACC scale = (ACC)as_double(m[49]);
#else
  const ACC scale = (ACC)as_float((int)m[50]);
#endif
  const long B = m[0], Hq = m[1], Tq = m[2], Hkv = m[3], Tk = m[4];
  const long group = Hq / Hkv;
  const long sqe = BW_S(0, 3), ske = BW_S(1, 3), sve = BW_S(2, 3), soe = BW_S(3, 3),
             sdoe = BW_S(4, 3);
  // The row this group holds: q and do (a dq group), or k and v (a dk/dv group). +1: the
  // head dims may be 0.
  __local ACC xrow[HEAD_D + 1];
  __local ACC yrow[HEAD_DV + 1];
  // Per work-item of a block: P and dS * scale of its pair, and the element offsets of the
  // other side's rows (k, or q and do; -1: no pair).
  __local ACC wp[KILN_WG];
  __local ACC wds[KILN_WG];
  __local long wrow[KILN_WG];
  __local long wrow2[KILN_WG];
  __local ACC red[KILN_WG];
  const long qrows = B * Hq * Tq, krows = B * Hkv * Tk;
  // The groups walk the rows [0, qrows + krows): dq rows, then dk/dv rows. One loop per kind,
  // not one loop with a branch: PoCL 3.1 ran the barriers of such an if/else wrongly (work-
  // items past HEAD_D stored dq).
  const long ng = get_num_groups(0), g0 = get_group_id(0);
  for (long g = g0; g < qrows; g += ng) {
    // dq of query row i of head h: sum over keys j of dS_ij * scale * k_j.
    const long i = g % Tq, h = (g / Tq) % Hq, b = g / (Tq * Hq);
    const long kh = h / group;
    const long qb = BW_ROW(0, b, h, i), ob = BW_ROW(3, b, h, i), dob = BW_ROW(4, b, h, i);
    for (int e = lid; e < HEAD_D; e += KILN_WG) xrow[e] = QLD(pq, qb + e * sqe);
    ACC part = 0;
    for (int e = lid; e < HEAD_DV; e += KILN_WG) {
      const ACC gd = DOLD(pdo, dob + e * sdoe);
      yrow[e] = gd;
      part += gd * OLD(po, ob + e * soe);
    }
    red[lid] = part;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = KILN_WG / 2; w > 0; w >>= 1) {
      if (lid < w) red[lid] += red[lid + w];
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    const ACC di = red[0];
    const ACC lse = LSELD(plse, b * m[46] + h * m[47] + i * m[48]);
    ACC acc[D_PER];
    for (int d = 0; d < D_PER; ++d) acc[d] = 0;
    const long jb = max(KV_BEGIN(i), 0L), je = min(KV_END(i, Tk), Tk);
    long visited = 0;
    for (long j0 = BLOCK_START(jb); j0 < je; j0 += KILN_WG) {
      const int cls = BLOCK_CLASS(b, h, i, j0);
      if (cls == 0) continue;
      ++visited;
      const long j = j0 + lid;
      ACC p = 0, ds = 0;
      long ko = -1;
      if (j >= jb && j < je) {
        ko = BW_ROW(1, b, kh, j);
        ACC dot = 0;
        if (cls == 1 || KEEP(b, h, i, j)) {
          for (int e = 0; e < HEAD_D; ++e) dot += xrow[e] * KLD(pk, ko + e * ske);
          p = BW_P(dot, lse);
        }
        if (p != (ACC)0) {
          const long vo = BW_ROW(2, b, kh, j);
          ACC dp = 0;
          for (int e = 0; e < HEAD_DV; ++e) dp += yrow[e] * VLD(pv, vo + e * sve);
          ds = p * (dp - di) * scale;
        }
      }
      wp[lid] = p;
      wds[lid] = ds;
      wrow[lid] = ko;
      barrier(CLK_LOCAL_MEM_FENCE);
      const long cnt = min((long)KILN_WG, je - j0);
      BW_ACCUMULATE(acc, D_PER, HEAD_D, wds, KLD, pk, wrow, ske);
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    const long dqb = BW_ROW(5, b, h, i);
    for (int dd = 0; dd < D_PER; ++dd) {
      const long d = lid + (long)dd * KILN_WG;
      if (d < HEAD_D) DQST(pdq, dqb + d * BW_S(5, 3), acc[dd]);
    }
    BLOCK_VISITS(g, visited)
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const long kfirst = g0 >= qrows ? g0 : g0 + (qrows - g0 + ng - 1) / ng * ng;
  for (long g = kfirst; g < qrows + krows; g += ng) {
    // dk and dv of key row j of kv head kh: sums over the query rows i of its query heads
    // of dS_ij * scale * q_i and P_ij * do_i.
    const long r = g - qrows;
    const long j = r % Tk, kh = (r / Tk) % Hkv, b = r / (Tk * Hkv);
    const long kb = BW_ROW(1, b, kh, j), vb = BW_ROW(2, b, kh, j);
    for (int e = lid; e < HEAD_D; e += KILN_WG) xrow[e] = KLD(pk, kb + e * ske);
    for (int e = lid; e < HEAD_DV; e += KILN_WG) yrow[e] = VLD(pv, vb + e * sve);
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC acck[D_PER], accv[DV_PER];
    for (int d = 0; d < D_PER; ++d) acck[d] = 0;
    for (int d = 0; d < DV_PER; ++d) accv[d] = 0;
    long visited = 0;
    for (long h = kh * group; h < (kh + 1) * group; ++h) {
      for (long i0 = 0; i0 < Tq; i0 += KILN_WG) {
        const int cls = BLOCK_CLASS(b, h, i0, j);
        if (cls == 0) continue;
        ++visited;
        const long i = i0 + lid;
        ACC p = 0, ds = 0;
        long qo = -1, doo = -1;
        // KV_BEGIN/KV_END only narrow what the mask allows.
        if (i < Tq && j >= KV_BEGIN(i) && j < KV_END(i, Tk) && (cls == 1 || KEEP(b, h, i, j))) {
          const ACC lse = LSELD(plse, b * m[46] + h * m[47] + i * m[48]);
          qo = BW_ROW(0, b, h, i);
          ACC dot = 0;
          for (int e = 0; e < HEAD_D; ++e) dot += QLD(pq, qo + e * sqe) * xrow[e];
          p = BW_P(dot, lse);
          if (p != (ACC)0) {
            doo = BW_ROW(4, b, h, i);
            const long ob = BW_ROW(3, b, h, i);
            // dP - D_i = do . (v - o)
            ACC dpd = 0;
            for (int e = 0; e < HEAD_DV; ++e) {
              dpd += DOLD(pdo, doo + e * sdoe) * (yrow[e] - OLD(po, ob + e * soe));
            }
            ds = p * dpd * scale;
          }
        }
        wp[lid] = p;
        wds[lid] = ds;
        wrow[lid] = qo;
        wrow2[lid] = doo;
        barrier(CLK_LOCAL_MEM_FENCE);
        const long cnt = min((long)KILN_WG, Tq - i0);
        BW_ACCUMULATE(acck, D_PER, HEAD_D, wds, QLD, pq, wrow, sqe);
        BW_ACCUMULATE(accv, DV_PER, HEAD_DV, wp, DOLD, pdo, wrow2, sdoe);
        barrier(CLK_LOCAL_MEM_FENCE);
      }
    }
    const long dkb = BW_ROW(6, b, kh, j), dvb = BW_ROW(7, b, kh, j);
    for (int dd = 0; dd < D_PER; ++dd) {
      const long d = lid + (long)dd * KILN_WG;
      if (d < HEAD_D) DKST(pdk, dkb + d * BW_S(6, 3), acck[dd]);
    }
    for (int dd = 0; dd < DV_PER; ++dd) {
      const long d = lid + (long)dd * KILN_WG;
      if (d < HEAD_DV) DVST(pdv, dvb + d * BW_S(7, 3), accv[dd]);
    }
    BLOCK_VISITS(g, visited)
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}
#undef BW_OFF
#undef BW_S
#undef BW_ROW
#undef BW_ACCUMULATE
#undef BW_P
#endif  // CLASSIFY, forward, BACKWARD
#undef KEEP
#undef BLOCK_SETUP
#undef BLOCK_CLASS
#undef BLOCK_START
#undef BLOCK_VISITS
#undef BLOCK_PARAM
#ifdef CLASSIFY
#undef CLASSIFY_STORE
#endif
#ifdef PAGED
#undef PAGED_SEQ
#endif
