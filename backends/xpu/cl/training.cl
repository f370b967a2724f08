// Training kernels (templates, instantiated per node by the host, backends/xpu/xpu_kernels.cc, "Training"),
// with the semantics of the reference kernels (backends/ref/ref_kernels.cc).
//
// FUSED_CROSS_ENTROPY: loss and dlogits of each row in one kernel. One work-group per row:
// the row's maximum and sum of exponentials by work-group reductions, then loss and
// dlogits = (softmax - onehot(target)) * dloss from them, so the softmax is neither stored
// nor computed twice. The host defines
//   ACC, ACC_MAX          float/nmaxf, or double/nmaxd
//   XLD(p, i)             load a logits/dloss element as ACC; XST(p, i, v) store loss/dlogits
//   TLD(p, i)             load a target as long
//   IGNORE_INDEX          the ignore_index attribute (a long literal)
// Meta: logits TD (0), targets TD (18), dloss TD (36), loss TD (54), dlogits TD (72),
// rows (90).
//
// ADAMW: PyTorch's AdamW, one element per work-item; param, m and v (f32) are read and
// written in place, grad is loaded with GLD(p, i), the step (rank 0) with SLD(p, i); LR, BETA1,
// BETA2, EPS and WEIGHT_DECAY are literals of type ACC.
// Meta: param TD (0), m TD (18), v TD (36), grad TD (54), step byte offset (72).

#ifdef FUSED_CROSS_ENTROPY
// Element offset of row `row` (row-major over the first `lead` axes) of a TD. (Helpers are
// named after the kernel: several instantiations share one program.)
inline long KNAME_row_offset(const long* m, int at, long row, int lead) {
  long off = 0;
  for (int d = lead - 1; d >= 0; --d) {
    const long s = TD_SHAPE(m, at, d);
    if (s > 0) {
      off += (row % s) * TD_STRIDE(m, at, d);
      row /= s;
    }
  }
  return off;
}

__kernel void KNAME(gptr b_loss, gptr b_dx, cgptr b_x, cgptr b_t, cgptr b_dl, const meta96 mt) {
  const long* m = mt.v;
  cgptr px = b_x + TD_OFF(m, 0);
  cgptr pt = b_t + TD_OFF(m, 18);
  cgptr pdl = b_dl + TD_OFF(m, 36);
  gptr pl = b_loss + TD_OFF(m, 54);
  gptr pdx = b_dx + TD_OFF(m, 72);
  const int r = TD_RANK(m, 0) - 1;
  const long n = TD_SHAPE(m, 0, r), sx = TD_STRIDE(m, 0, r), sdx = TD_STRIDE(m, 72, r);
  const long rows = m[90];
  const int lid = get_local_id(0);
  __local ACC red[KILN_WG];
  for (long row = get_group_id(0); row < rows; row += get_num_groups(0)) {
    const long xo = KNAME_row_offset(m, 0, row, r), dxo = KNAME_row_offset(m, 72, row, r);
    const long target = TLD(pt, td_offset(m, 18, row));
    // Ignored rows run the same code (uniform barriers) and store zeros.
    const bool ignored = target == IGNORE_INDEX;
    ACC mx = -INFINITY;
    for (long j = lid; j < n; j += KILN_WG) mx = ACC_MAX(mx, XLD(px, xo + j * sx));
    red[lid] = mx;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = KILN_WG / 2; w > 0; w >>= 1) {
      if (lid < w) red[lid] = ACC_MAX(red[lid], red[lid + w]);
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    mx = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC s = 0;
    for (long j = lid; j < n; j += KILN_WG) s += exp(XLD(px, xo + j * sx) - mx);
    red[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = KILN_WG / 2; w > 0; w >>= 1) {
      if (lid < w) red[lid] += red[lid + w];
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    s = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
      const ACC picked = (target >= 0 && target < n) ? XLD(px, xo + target * sx) : (ACC)0;
      XST(pl, td_offset(m, 54, row), ignored ? (ACC)0 : mx + log(s) - picked);
    }
    const ACC g = XLD(pdl, td_offset(m, 36, row));
    for (long j = lid; j < n; j += KILN_WG) {
      const ACC p = exp(XLD(px, xo + j * sx) - mx) / s - (j == target ? (ACC)1 : (ACC)0);
      XST(pdx, dxo + j * sdx, ignored ? (ACC)0 : p * g);
    }
  }
}
#endif

#ifdef ADAMW
__kernel void KNAME(gptr b_p, gptr b_m, gptr b_v, cgptr b_g, cgptr b_step, const meta96 mt) {
  const long* m = mt.v;
  gptr pp = b_p + TD_OFF(m, 0);
  gptr pm = b_m + TD_OFF(m, 18);
  gptr pv = b_v + TD_OFF(m, 36);
  cgptr pg = b_g + TD_OFF(m, 54);
  const ACC step = SLD(b_step + m[72], 0);
  const ACC step_size = LR / ((ACC)1 - pow(BETA1, step));
  const ACC bias_correction2_sqrt = sqrt((ACC)1 - pow(BETA2, step));
  const long n = td_numel(m, 0);
  for (long e = get_global_id(0); e < n; e += get_global_size(0)) {
    const long po = td_offset(m, 0, e), mo = td_offset(m, 18, e), vo = td_offset(m, 36, e);
    const ACC g = GLD(pg, td_offset(m, 54, e));
    const ACC p = (ACC)ldf_f32(pp, po) * ((ACC)1 - LR * WEIGHT_DECAY);
    const ACC mv = BETA1 * (ACC)ldf_f32(pm, mo) + ((ACC)1 - BETA1) * g;
    const ACC vv = BETA2 * (ACC)ldf_f32(pv, vo) + ((ACC)1 - BETA2) * g * g;
    const ACC denom = sqrt(vv) / bias_correction2_sqrt + EPS;
    stf_f32(pm, mo, (float)mv);
    stf_f32(pv, vo, (float)vv);
    stf_f32(pp, po, (float)(p - step_size * mv / denom));
  }
}
#endif
