// The hand-written library of the xpu backend: data-movement and indexing kernels that serve
// every dtype (the dtype is a run-time value; these kernels move data, they do not compute
// much), plus rope. Built once per device as one program.
//
// Tensors are described by TD blocks in the metadata (prelude.cl): byte offset, rank, shape,
// strides. Semantics follow the reference kernels (backends/ref/ref_kernels.cc): bad indices
// read as 0 and are skipped on writes.

// Element offset of position `pos` (row-major over shape[first..rank)) of a TD.
inline long td_offset_from(const long* m, int at, long pos, int first) {
  long off = 0;
  for (int d = TD_RANK(m, at) - 1; d >= first; --d) {
    const long s = TD_SHAPE(m, at, d);
    if (s > 0) {
      off += (pos % s) * TD_STRIDE(m, at, d);
      pos /= s;
    }
  }
  return off;
}

// out[0] = the launch's symbolic size.
__kernel void dim_value(gptr b_out, const meta8 mt) {
  const long* m = mt.v;
  if (get_global_id(0) != 0) return;
  const int dt = (int)m[1];
  if (is_int_like(dt)) {
    sti_any(dt, b_out + m[0], 0, m[2]);
  } else {
    str_any(dt, b_out + m[0], 0, (real)m[2]);
  }
}

// out[i] = x[i] over the output's shape (any strides; dtype conversion as copy_elem).
// Meta: out TD, x TD, out dtype, x dtype, n.
__kernel void copy_strided(gptr b_out, cgptr b_x, const meta48 mt) {
  const long* m = mt.v;
  gptr po = b_out + TD_OFF(m, 0);
  cgptr px = b_x + TD_OFF(m, 18);
  const int odt = (int)m[36], xdt = (int)m[37];
  const long n = m[38];
  for (long g = get_global_id(0); g < n; g += get_global_size(0)) {
    copy_elem(xdt, px, td_offset(m, 18, g), odt, po, td_offset(m, 0, g));
  }
}

// out[i..., e...] = table[idx[i...], e...]; quantized tables dequantize (rows contiguous).
// Meta: table TD, idx TD, out TD, table dt, idx dt, out dt, row elements, index count.
__kernel void gather(gptr b_out, cgptr b_table, cgptr b_idx, const meta64 mt) {
  const long* m = mt.v;
  cgptr pt = b_table + TD_OFF(m, 0);
  cgptr pi = b_idx + TD_OFF(m, 18);
  gptr po = b_out + TD_OFF(m, 36);
  const int tdt = (int)m[54], idt = (int)m[55], odt = (int)m[56];
  const long row = m[57], n = m[58] * row;
  const long rows = TD_SHAPE(m, 0, 0), stride0 = TD_STRIDE(m, 0, 0);
  const bool quant = tdt >= DT_Q4_0;
  for (long g = get_global_id(0); g < n; g += get_global_size(0)) {
    const long i = g / row, e = g % row;
    const long r = ldi_any(idt, pi, td_offset(m, 18, i));
    const long oo = td_offset(m, 36, g);
    if (r < 0 || r >= rows) {
      str_any(odt, po, oo, (real)0);
    } else if (quant) {
      str_any(odt, po, oo, (real)ldf_any(tdt, pt, r * stride0 + e));
    } else {
      copy_elem(tdt, pt, r * stride0 + td_offset_from(m, 0, e, 1), odt, po, oo);
    }
  }
}

// out = zeros [V, E...]; out[idx[i...], e...] += src[i..., e...] in index order (one
// work-item per row element, so the additions happen in the reference's order).
// Meta: idx TD, src TD, out TD, idx dt, src dt, out dt, row elements, index count.
__kernel void scatter_add_rows(gptr b_out, cgptr b_idx, cgptr b_src, const meta64 mt) {
  const long* m = mt.v;
  cgptr pi = b_idx + TD_OFF(m, 0);
  cgptr ps = b_src + TD_OFF(m, 18);
  gptr po = b_out + TD_OFF(m, 36);
  const int idt = (int)m[54], sdt = (int)m[55], odt = (int)m[56];
  const long row = m[57], count = m[58];
  const long rows = TD_SHAPE(m, 36, 0), ostride0 = TD_STRIDE(m, 36, 0);
  for (long e = get_global_id(0); e < row; e += get_global_size(0)) {
    const long oe = td_offset_from(m, 36, e, 1);
    for (long r = 0; r < rows; ++r) str_any(odt, po, r * ostride0 + oe, (real)0);
    for (long i = 0; i < count; ++i) {
      const long r = ldi_any(idt, pi, td_offset(m, 0, i));
      if (r < 0 || r >= rows) continue;
      const long oo = r * ostride0 + oe;
      str_any(odt, po, oo, ldr_any(odt, po, oo) + ldr_any(sdt, ps, td_offset(m, 18, i * row + e)));
    }
  }
}

// out[..., k] = x[..., idx[..., k]] (0 when the index is out of range).
// Meta: x TD, idx TD, out TD, x dt, idx dt, out dt, n.
__kernel void take_along(gptr b_out, cgptr b_x, cgptr b_idx, const meta64 mt) {
  const long* m = mt.v;
  cgptr px = b_x + TD_OFF(m, 0);
  cgptr pi = b_idx + TD_OFF(m, 18);
  gptr po = b_out + TD_OFF(m, 36);
  const int xdt = (int)m[54], idt = (int)m[55], odt = (int)m[56];
  const long n = m[57];
  const int rank = TD_RANK(m, 36), last = rank - 1;
  const long xn = TD_SHAPE(m, 0, last);
  for (long g = get_global_id(0); g < n; g += get_global_size(0)) {
    const long j = ldi_any(idt, pi, td_offset(m, 18, g));
    const long oo = td_offset(m, 36, g);
    if (j < 0 || j >= xn) {
      str_any(odt, po, oo, (real)0);
      continue;
    }
    // x's offset: the output's coordinates with the last one replaced by j.
    long pos = g / TD_SHAPE(m, 36, last), xo = j * TD_STRIDE(m, 0, last);
    for (int d = last - 1; d >= 0; --d) {
      const long s = TD_SHAPE(m, 36, d);
      xo += (pos % s) * TD_STRIDE(m, 0, d);
      pos /= s;
    }
    copy_elem(xdt, px, xo, odt, po, oo);
  }
}

// out = zeros [..., N]; out[..., idx[..., k]] += src[..., k], one work-item per row.
// Meta: idx TD, src TD, out TD, idx dt, src dt, out dt, rows, K, N.
__kernel void scatter_add_along(gptr b_out, cgptr b_idx, cgptr b_src, const meta64 mt) {
  const long* m = mt.v;
  cgptr pi = b_idx + TD_OFF(m, 0);
  cgptr ps = b_src + TD_OFF(m, 18);
  gptr po = b_out + TD_OFF(m, 36);
  const int idt = (int)m[54], sdt = (int)m[55], odt = (int)m[56];
  const long rows = m[57], K = m[58], N = m[59];
  for (long r = get_global_id(0); r < rows; r += get_global_size(0)) {
    for (long j = 0; j < N; ++j) str_any(odt, po, td_offset(m, 36, r * N + j), (real)0);
    for (long k = 0; k < K; ++k) {
      const long j = ldi_any(idt, pi, td_offset(m, 0, r * K + k));
      if (j < 0 || j >= N) continue;
      const long oo = td_offset(m, 36, r * N + j);
      str_any(odt, po, oo, ldr_any(odt, po, oo) + ldr_any(sdt, ps, td_offset(m, 18, r * K + k)));
    }
  }
}

// True if (a, ia) comes before (b, ib) in top-k order: descending, NaN largest, lower index
// first on ties.
inline bool topk_before(real a, long ia, real b, long ib) {
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

// Indices of the k largest elements of each row, in order. One work-group per row, k passes;
// pass j finds the best element after pass j-1's (a total order, so no element repeats).
// Meta: x TD, out TD, x dt, out dt, rows, N, k.
__kernel void top_k(gptr b_out, cgptr b_x, const meta48 mt) {
  const long* m = mt.v;
  cgptr px = b_x + TD_OFF(m, 0);
  gptr po = b_out + TD_OFF(m, 18);
  const int xdt = (int)m[36], odt = (int)m[37];
  const long rows = m[38], N = m[39], K = m[40];
  const int lid = get_local_id(0);
  __local real best_v[KILN_WG];
  __local long best_i[KILN_WG];
  for (long row = get_group_id(0); row < rows; row += get_num_groups(0)) {
    real prev_v = 0;
    long prev_i = -1;  // -1: no previous pick
    for (long j = 0; j < K; ++j) {
      real bv = 0;
      long bi = -1;
      for (long e = lid; e < N; e += KILN_WG) {
        const real v = ldr_any(xdt, px, td_offset(m, 0, row * N + e));
        if (prev_i >= 0 && !topk_before(prev_v, prev_i, v, e)) continue;
        if (bi < 0 || topk_before(v, e, bv, bi)) {
          bv = v;
          bi = e;
        }
      }
      best_v[lid] = bv;
      best_i[lid] = bi;
      barrier(CLK_LOCAL_MEM_FENCE);
      for (int s = KILN_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
          const long oi = best_i[lid + s];
          if (oi >= 0 && (best_i[lid] < 0 || topk_before(best_v[lid + s], oi, best_v[lid],
                                                         best_i[lid]))) {
            best_v[lid] = best_v[lid + s];
            best_i[lid] = oi;
          }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
      }
      prev_v = best_v[0];
      prev_i = best_i[0];
      if (lid == 0) sti_any(odt, po, td_offset(m, 18, row * K + j), prev_i);
      barrier(CLK_LOCAL_MEM_FENCE);
    }
  }
}

// cache[slot / BS, slot % BS, h, e] = x[t, h, e] for slot = slots[t]; bad slots skipped.
// Meta: cache TD, x TD, slots TD, cache dt, x dt, slots dt.
__kernel void kv_write(gptr b_cache, cgptr b_x, cgptr b_slots, const meta64 mt) {
  const long* m = mt.v;
  gptr pc = b_cache + TD_OFF(m, 0);
  cgptr px = b_x + TD_OFF(m, 18);
  cgptr ps = b_slots + TD_OFF(m, 36);
  const int cdt = (int)m[54], xdt = (int)m[55], sdt = (int)m[56];
  const long T = TD_SHAPE(m, 18, 0), H = TD_SHAPE(m, 18, 1), D = TD_SHAPE(m, 18, 2);
  const long NB = TD_SHAPE(m, 0, 0), BS = TD_SHAPE(m, 0, 1);
  const long n = T * H * D;
  for (long g = get_global_id(0); g < n; g += get_global_size(0)) {
    const long e = g % D, h = (g / D) % H, t = g / (D * H);
    const long slot = ldi_any(sdt, ps, t * TD_STRIDE(m, 36, 0));
    if (slot < 0 || slot >= NB * BS) continue;
    const long co = (slot / BS) * TD_STRIDE(m, 0, 0) + (slot % BS) * TD_STRIDE(m, 0, 1) +
                    h * TD_STRIDE(m, 0, 2) + e * TD_STRIDE(m, 0, 3);
    const long xo = t * TD_STRIDE(m, 18, 0) + h * TD_STRIDE(m, 18, 1) + e * TD_STRIDE(m, 18, 2);
    if (cdt == xdt) {
      copy_elem(xdt, px, xo, cdt, pc, co);
    } else {
      str_any(cdt, pc, co, ldr_any(xdt, px, xo));
    }
  }
}

// Rotary embedding over x [lead..., H, D] with positions pos [lead...]. One work-item per
// (row, head, j): j < rd/2 rotates pair j, larger j copy dim rd + (j - rd/2).
// The per-pair frequencies come from the host (HF rope_scaling rules): with fp64, inv_freq as
// doubles and the angle in double; without, inv_freq / (2 pi) as a float pair (hi, lo) and the
// angle reduced to a fraction of a turn in extended precision (positions of many thousands
// would otherwise lose the angle in float).
// Meta: x TD, pos TD, out TD, x dt, pos dt, out dt, H, D, rotary dim, interleaved, sign,
// lead count.
__kernel void rope(gptr b_out, cgptr b_x, cgptr b_pos, cgptr b_freq, const meta64 mt) {
  const long* m = mt.v;
  cgptr px = b_x + TD_OFF(m, 0);
  cgptr pp = b_pos + TD_OFF(m, 18);
  gptr po = b_out + TD_OFF(m, 36);
  const int xdt = (int)m[54], pdt = (int)m[55], odt = (int)m[56];
  const long H = m[57], D = m[58], rd = m[59], npair = rd / 2;
  const int interleaved = (int)m[60];
  const long sign = m[61], lead = m[62];
  const long per_head = npair + (D - rd);
  const long n = lead * H * per_head;
  for (long g = get_global_id(0); g < n; g += get_global_size(0)) {
    const long j = g % per_head, h = (g / per_head) % H, l = g / (per_head * H);
    const long base = (l * H + h) * D;
    if (j >= npair) {
      const long d = rd + (j - npair);
      copy_elem(xdt, px, td_offset(m, 0, base + d), odt, po, td_offset(m, 36, base + d));
      continue;
    }
    const long d0 = interleaved ? 2 * j : j, d1 = interleaved ? 2 * j + 1 : j + npair;
    const long p = ldi_any(pdt, pp, td_offset(m, 18, l));
#ifdef KILN_FP64
    const double angle = (double)sign * (double)p * ((const __global double*)b_freq)[j];
    const double cs = cos(angle), sn = sin(angle);
#else
    // turns = p * (hi + lo): p * hi split exactly (fma), fractional parts kept.
    const float hi = ((const __global float*)b_freq)[2 * j];
    const float lo = ((const __global float*)b_freq)[2 * j + 1];
    const float pf = (float)p;
    const float prod = pf * hi;
    const float err = fma(pf, hi, -prod);
    float turns = (prod - floor(prod)) + (err + pf * lo);
    turns -= floor(turns);
    const float cs = cospi(2.0f * turns), sn = (float)sign * sinpi(2.0f * turns);
#endif
    const real x0 = ldr_any(xdt, px, td_offset(m, 0, base + d0));
    const real x1 = ldr_any(xdt, px, td_offset(m, 0, base + d1));
    str_any(odt, po, td_offset(m, 36, base + d0), x0 * cs - x1 * sn);
    str_any(odt, po, td_offset(m, 36, base + d1), x0 * sn + x1 * cs);
  }
}
