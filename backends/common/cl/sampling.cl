// The `sample` op on the xpu backend: engine/sampling.h's algorithm ported line for line, one
// work-item per sequence (row). Needs cl_khr_fp64 (probability mass is summed in double, as
// on the host); without it the device has no sample kernel and the host sampler runs.
//
// Serial per row by design: the draw must walk the candidates in the canonical order with the
// same double sums as the host to pick the same token for the same uniform. Rows run in
// parallel. Scratch (per row: V floats of penalized logits, V ints of candidate ids, V floats
// of weights) is a device buffer the launcher owns.

#ifdef KILN_FP64

// a before b in the canonical order: larger logit first, ties by lower id.
inline bool smp_before(__global const float* l, int a, int b) {
  return l[a] > l[b] || (l[a] == l[b] && a < b);
}

inline void smp_sift_down(__global const float* l, __global int* h, int n, int i) {
  // Min-heap by the canonical order: the root is the candidate that comes last.
  for (;;) {
    int w = i;
    const int a = 2 * i + 1, b = a + 1;
    if (a < n && smp_before(l, h[w], h[a])) w = a;
    if (b < n && smp_before(l, h[w], h[b])) w = b;
    if (w == i) return;
    const int t = h[i];
    h[i] = h[w];
    h[w] = t;
    i = w;
  }
}

// out[0..m) = the m first ids of 0..n-1 in canonical order, sorted (a bounded heap, then heap
// sort: O(n log m)). REQUIRES: 0 < m <= n.
inline void smp_select_top(__global const float* l, int n, int m, __global int* out) {
  for (int i = 0; i < m; ++i) out[i] = i;
  for (int i = m / 2 - 1; i >= 0; --i) smp_sift_down(l, out, m, i);
  for (int t = m; t < n; ++t) {
    if (smp_before(l, t, out[0])) {
      out[0] = t;
      smp_sift_down(l, out, m, 0);
    }
  }
  // Heap sort: repeatedly move the last-in-order root to the end.
  for (int end = m - 1; end > 0; --end) {
    const int t = out[0];
    out[0] = out[end];
    out[end] = t;
    smp_sift_down(l, out, end, 0);
  }
}

// engine/sampling.h's Pick on the row's penalized logits `l` (modified); `w`, `order` and
// `tmp` are V-entry scratch. -1 (kNoToken) if every logit is -inf.
inline int smp_pick(__global float* l, __global float* w, __global int* order, __global int* tmp,
                    long V, float temperature, int top_k, float top_p, float min_p, double u) {
  if (temperature == 0.0f) {
    int token = 0;
    for (int t = 1; t < V; ++t) {
      if (l[t] > l[token]) token = t;
    }
    return l[token] == -INFINITY ? -1 : token;
  }
  const float inv_t = 1.0f / temperature;
  float mx = -INFINITY;
  for (int t = 0; t < V; ++t) {
    l[t] *= inv_t;
    if (t == 0 || l[t] > mx) mx = t == 0 ? l[t] : fmax(mx, l[t]);
  }
  if (mx == -INFINITY) return -1;  // nothing to draw (and exp(l - mx) would be NaN)
  const int limit = top_k > 0 ? min(top_k, (int)V) : (int)V;
  if (limit < V) {
    smp_select_top(l, (int)V, limit, order);
  } else {
    for (int t = 0; t < V; ++t) order[t] = t;
  }
  for (int i = 0; i < limit; ++i) w[order[i]] = exp(l[order[i]] - mx);
  int n = limit;
  if (top_p < 1.0f) {
    double total = 0;
    for (int i = 0; i < limit; ++i) total += (double)w[order[i]];
    const double target = (double)top_p * total;
    int mm = min(limit, 256);
    for (;;) {
      // The mm first candidates in canonical order (order[] itself when top-k sorted it).
      __global const int* pre = order;
      if (limit == V) {
        smp_select_top(l, (int)V, mm, tmp);
        pre = tmp;
      }
      double cum = 0;
      int i = 0;
      while (i < mm && cum < target) cum += (double)w[pre[i++]];
      if (cum >= target || mm == limit) {
        for (int k = 0; k < i; ++k) order[k] = pre[k];
        n = i;
        break;
      }
      mm = min(limit, mm * 4);
    }
  }
  if (min_p > 0) {
    const float threshold = log(min_p);
    int k = 0;
    for (int i = 0; i < n; ++i) {
      if (!(l[order[i]] - mx < threshold)) order[k++] = order[i];
    }
    n = k;
  }
  double mass = 0;
  for (int i = 0; i < n; ++i) mass += (double)w[order[i]];
  double r = u * mass;
  // If rounding leaves r >= 0 after the walk: the last candidate of nonzero weight.
  int last = -1;
  for (int i = 0; i < n; ++i) {
    const double wi = (double)w[order[i]];
    if (wi > 0) last = order[i];
    r -= wi;
    if (r < 0) return order[i];
  }
  return last;
}

// Meta (longs): 0..9 byte offsets of token, logprob, top_ids, top_logprobs, logits, params,
// uniform, penalty_tokens, penalty_counts, banned; 10 S, 11 V, 12 P, 13 E; row strides (in
// elements; rows are contiguous) 14 logits, 15 params, 16 penalty_tokens, 17 banned; 18 the top
// width (kMaxLogprobs); 19, 20 byte offsets of the scratch's float and int regions (2V each
// per row); 21 penalty_counts' row stride; 22 penalty_bias' byte offset (-1: no bias input),
// 23 its row stride; 24 allowed's byte offset (-1: no mask), 25 its row stride (ceil(V / 32)
// words per row, token t is bit t % 32 of word t / 32).
__kernel void KNAME(gptr b_tokens, gptr b_logprob, gptr b_top_ids, gptr b_top_lps,
                     cgptr b_logits, cgptr b_params, cgptr b_u, cgptr b_pen_tok,
                     cgptr b_pen_cnt, cgptr b_banned, gptr b_scratch, cgptr b_pen_bias,
                     cgptr b_allowed, const meta32 mt) {
  const long* m = mt.v;
  const long s = get_global_id(0);
  const long S = m[10], V = m[11], P = m[12], E = m[13];
  if (s >= S) return;
  __global int* tokens = (__global int*)(b_tokens + m[0]);
  __global float* logprob = (__global float*)(b_logprob + m[1]);
  const long W = m[18];
  __global int* top_ids = (__global int*)(b_top_ids + m[2]) + s * W;
  __global float* top_lps = (__global float*)(b_top_lps + m[3]) + s * W;
  __global const float* raw = (__global const float*)(b_logits + m[4]) + s * m[14];
  __global const float* prm = (__global const float*)(b_params + m[5]) + s * m[15];
  const double u = ((__global const double*)(b_u + m[6]))[s];
  __global const int* pen_tok = (__global const int*)(b_pen_tok + m[7]) + s * m[16];
  __global const int* pen_cnt = (__global const int*)(b_pen_cnt + m[8]) + s * m[21];
  __global const int* banned = (__global const int*)(b_banned + m[9]) + s * m[17];
  __global const float* pen_bias =
      m[22] < 0 ? 0 : (__global const float*)(b_pen_bias + m[22]) + s * m[23];
  __global const uint* allowed =
      m[24] < 0 ? 0 : (__global const uint*)(b_allowed + m[24]) + s * m[25];
  __global float* l = (__global float*)(b_scratch + m[19]) + s * V * 2;  // logits, weights
  __global float* w = l + V;
  __global int* order = (__global int*)(b_scratch + m[20]) + s * V * 2;
  __global int* tmp = order + V;

  const float temperature = prm[0], top_p = prm[2], min_p = prm[3], rp = prm[4],
              presence = prm[5], frequency = prm[6];
  const int top_k = (int)prm[1], want_lps = (int)prm[7];

  for (long t = 0; t < V; ++t) l[t] = raw[t];
  const bool additive = presence != 0.0f || frequency != 0.0f;
  for (long j = 0; j < P; ++j) {
    const int t = pen_tok[j];
    if (t < 0 || t >= V) continue;
    float x = l[t];
    if (pen_bias) x += pen_bias[j];
    if (pen_cnt[j] >= 0) {  // -1: listed for its bias only
      if (rp != 1.0f) x = x > 0 ? x / rp : x * rp;
      if (additive && pen_cnt[j] > 0) x -= presence + frequency * (float)pen_cnt[j];
    }
    l[t] = x;
  }
  for (long j = 0; j < E; ++j) {
    const int t = banned[j];
    if (t >= 0 && t < V) l[t] = -INFINITY;
  }
  if (allowed) {
    for (long t = 0; t < V; ++t) {
      if (!((allowed[t >> 5] >> (t & 31)) & 1u)) l[t] = -INFINITY;
    }
  }

  // -1: no token (every logit -inf).
  const int token = smp_pick(l, w, order, tmp, V, temperature, top_k, top_p, min_p, u);
  tokens[s] = token;

  // Logprobs of the raw distribution.
  for (long i = 0; i < W; ++i) {
    top_ids[i] = -1;
    top_lps[i] = 0.0f;
  }
  if (want_lps < 0) {
    logprob[s] = 0.0f;
    return;
  }
  float mx = raw[0];
  for (long t = 1; t < V; ++t) mx = fmax(mx, raw[t]);
  double sum = 0;
  for (long t = 0; t < V; ++t) sum += exp((double)(raw[t] - mx));
  const double log_z = (double)mx + log(sum);
  logprob[s] = token < 0 ? 0.0f : (float)((double)raw[token] - log_z);
  const int k = min(min(want_lps, (int)W), (int)V);
  if (k > 0) {
    smp_select_top(raw, (int)V, k, tmp);  // canonical order over the raw logits
    for (int i = 0; i < k; ++i) {
      top_ids[i] = tmp[i];
      top_lps[i] = (float)((double)raw[tmp[i]] - log_z);
    }
  }
}

#endif  // KILN_FP64
