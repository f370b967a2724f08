// Training kernels (templates, instantiated per node by the host, backends/common/device_kernels.cc, "Training"),
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
// OPTIMIZER: torch.optim's single-tensor step of one of ADAMW, ADAM, SGD, ADAGRAD (the
// reference kernel, backends/ref/ref_kernels.cc OptimizerElements, quotes torch's equations),
// one element per work-item; param and the states (f32) are read and written in place (a
// missing state is bound to param's buffer and never touched). The host defines
//   ACC                       float, or double where the device has fp64
//   GLD(p, i)                 load a gradient element as ACC
//   HLD(p, i), SLD(p, i)      load a hyper ({step, lr, grad_scale}) / grad_scale element as
//                             ACC; without the optional grad_scale input SLD is 1 (its
//                             buffer is hyper's)
//   F0 .. F3                  the node's float attributes (literals of type ACC)
//   NESTEROV, MOMENTUM_STATE  sgd: 0/1
// Meta: param TD (0), state0 TD (18), state1 TD (36), grad TD (54), hyper byte offset (72),
// hyper element stride (73), grad_scale byte offset (74).
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

#ifdef OPTIMIZER
__kernel void KNAME(gptr b_p, gptr b_s0, gptr b_s1, cgptr b_g, cgptr b_h, cgptr b_gs,
                    const meta96 mt) {
  const long* m = mt.v;
  gptr pp = b_p + TD_OFF(m, 0);
  gptr ps0 = b_s0 + TD_OFF(m, 18);
  gptr ps1 = b_s1 + TD_OFF(m, 36);
  cgptr pg = b_g + TD_OFF(m, 54);
  cgptr ph = b_h + m[72];
  const ACC step = HLD(ph, 0), lr = HLD(ph, m[73]);
  const ACC scale = HLD(ph, 2 * m[73]) * SLD(b_gs + m[74], 0);
  const bool first = step <= (ACC)1;  // states start as torch creates them
#if defined(ADAMW) || defined(ADAM)
  const ACC step_size = lr / ((ACC)1 - pow(F0, step));
  const ACC bias_correction2_sqrt = sqrt((ACC)1 - pow(F1, step));
#elif defined(ADAGRAD)
  const ACC clr = lr / ((ACC)1 + (step - (ACC)1) * F0);
#endif
  const long n = td_numel(m, 0);
  for (long e = get_global_id(0); e < n; e += get_global_size(0)) {
    const long po = td_offset(m, 0, e), o0 = td_offset(m, 18, e), o1 = td_offset(m, 36, e);
    ACC g = GLD(pg, td_offset(m, 54, e)) * scale;
    ACC p = (ACC)ldf_f32(pp, po);
#if defined(ADAMW) || defined(ADAM)
#ifdef ADAMW
    p *= (ACC)1 - lr * F3;
#else
    g += F3 * p;
#endif
    const ACC mv = F0 * (first ? (ACC)0 : (ACC)ldf_f32(ps0, o0)) + ((ACC)1 - F0) * g;
    const ACC vv = F1 * (first ? (ACC)0 : (ACC)ldf_f32(ps1, o1)) + ((ACC)1 - F1) * g * g;
    stf_f32(ps0, o0, (float)mv);
    stf_f32(ps1, o1, (float)vv);
    p -= step_size * mv / (sqrt(vv) / bias_correction2_sqrt + F2);
#elif defined(SGD)
    g += F2 * p;
#if MOMENTUM_STATE
    const ACC buf = first ? g : F0 * (ACC)ldf_f32(ps0, o0) + ((ACC)1 - F1) * g;
    stf_f32(ps0, o0, (float)buf);
    g = NESTEROV ? g + F0 * buf : buf;
#endif
    p -= lr * g;
#else  // ADAGRAD
    g += F1 * p;
    const ACC sum = (first ? F2 : (ACC)ldf_f32(ps0, o0)) + g * g;
    stf_f32(ps0, o0, (float)sum);
    p -= clr * g / (sqrt(sum) + F3);
#endif
    stf_f32(pp, po, (float)p);
  }
}
#endif
