// The portable vector layer of the CPU kernels: 8-float arrays in plain C++ (the compiler
// vectorizes them with the baseline SSE2). Included only by kernels_scalar.cc, inside
// namespace kiln::cpu::scalar; it is the fallback that runs on every CPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backends/cpu/kernels/kernels.h"
#include "engine/dtype.h"

namespace kiln::cpu::scalar {

inline constexpr int kLanes = 8;
inline constexpr int kGemmMR = 4;

struct F {
  float v[8];
};
inline F Zero() { return F{}; }
inline F Set1(float x) {
  F r;
  for (float& e : r.v) e = x;
  return r;
}
inline F Load(const float* p) {
  F r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void Store(float* p, F a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline F Add(F a, F b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline F Mul(F a, F b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F Div(F a, F b) {
  for (int i = 0; i < 8; ++i) a.v[i] /= b.v[i];
  return a;
}
inline F Fma(F a, F b, F c) {
  for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline F Max(F a, F b) {
  for (int i = 0; i < 8; ++i) {
    a.v[i] = (std::isnan(a.v[i]) || std::isnan(b.v[i])) ? NAN : (a.v[i] > b.v[i] ? a.v[i] : b.v[i]);
  }
  return a;
}
inline float HSum(F a) {
  return ((a.v[0] + a.v[4]) + (a.v[1] + a.v[5])) + ((a.v[2] + a.v[6]) + (a.v[3] + a.v[7]));
}
inline void HSum8(const F* a, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = HSum(a[i]);
}
inline F Exp(F a) {
  for (float& e : a.v) e = std::exp(e);
  return a;
}
// e^x of x clamped to [-80, 40] (NaN stays NaN).
inline F ExpClamped(F a) {
  for (float& e : a.v) e = std::exp(e > 40.0f ? 40.0f : (e < -80.0f ? -80.0f : e));
  return a;
}
inline F LoadF16(const uint16_t* p) {
  F r;
  for (int i = 0; i < 8; ++i) r.v[i] = F16ToFloat(p[i]);
  return r;
}
inline F LoadBF16(const uint16_t* p) {
  F r;
  for (int i = 0; i < 8; ++i) r.v[i] = BF16ToFloat(p[i]);
  return r;
}
inline uint16_t U16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
inline void PackTranspose(const float* src, int64_t lds, int nr, int64_t kc, float* dst) {
  for (int64_t k = 0; k < kc; ++k) {
    for (int r = 0; r < nr; ++r) dst[k * nr + r] = src[r * lds + k];
  }
}

// ---- Weight decoders (see simd_avx2.h for the contract): a block decodes into 32 floats ----
struct Block32 {
  float v[32];
};
inline F ChunkOf(const Block32& b, int c) { return Load(b.v + 8 * c); }

struct DecF32 {
  static constexpr int64_t kBlockBytes = 128;
  using State = const float*;
  static State Load(const uint8_t* b) { return reinterpret_cast<const float*>(b); }
  static F Chunk(State s, int c) { return scalar::Load(s + 8 * c); }
  static float Elem(const uint8_t* row, int64_t k) {
    float v;
    std::memcpy(&v, row + 4 * k, 4);
    return v;
  }
};
struct DecF16 {
  static constexpr int64_t kBlockBytes = 64;
  using State = const uint8_t*;
  static State Load(const uint8_t* b) { return b; }
  static F Chunk(State s, int c) {
    F r;
    for (int i = 0; i < 8; ++i) r.v[i] = F16ToFloat(U16(s + 2 * (8 * c + i)));
    return r;
  }
  static float Elem(const uint8_t* row, int64_t k) { return F16ToFloat(U16(row + 2 * k)); }
};
struct DecBF16 {
  static constexpr int64_t kBlockBytes = 64;
  using State = const uint8_t*;
  static State Load(const uint8_t* b) { return b; }
  static F Chunk(State s, int c) {
    F r;
    for (int i = 0; i < 8; ++i) r.v[i] = BF16ToFloat(U16(s + 2 * (8 * c + i)));
    return r;
  }
  static float Elem(const uint8_t* row, int64_t k) { return BF16ToFloat(U16(row + 2 * k)); }
};
struct DecQ4_0 {
  static constexpr int64_t kBlockBytes = 18;
  using State = Block32;
  static State Load(const uint8_t* b) {
    State s;
    const float d = F16ToFloat(U16(b)), off = -8.0f * d;
    for (int j = 0; j < 16; ++j) {
      s.v[j] = std::fma(static_cast<float>(b[2 + j] & 15), d, off);
      s.v[j + 16] = std::fma(static_cast<float>(b[2 + j] >> 4), d, off);
    }
    return s;
  }
  static F Chunk(const State& s, int c) { return ChunkOf(s, c); }
};
struct DecQ4_1 {
  static constexpr int64_t kBlockBytes = 20;
  using State = Block32;
  static State Load(const uint8_t* b) {
    State s;
    const float d = F16ToFloat(U16(b)), m = F16ToFloat(U16(b + 2));
    for (int j = 0; j < 16; ++j) {
      s.v[j] = std::fma(static_cast<float>(b[4 + j] & 15), d, m);
      s.v[j + 16] = std::fma(static_cast<float>(b[4 + j] >> 4), d, m);
    }
    return s;
  }
  static F Chunk(const State& s, int c) { return ChunkOf(s, c); }
};
struct DecQ8_0 {
  static constexpr int64_t kBlockBytes = 34;
  using State = Block32;
  static State Load(const uint8_t* b) {
    State s;
    const float d = F16ToFloat(U16(b));
    for (int j = 0; j < 32; ++j) s.v[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
    return s;
  }
  static F Chunk(const State& s, int c) { return ChunkOf(s, c); }
};
struct DecMXFP4 {
  static constexpr int64_t kBlockBytes = 17;
  using State = Block32;
  static State Load(const uint8_t* b) {
    static constexpr int8_t kTable[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    State s;
    const float d = b[0] == 0xff ? NAN : std::ldexp(1.0f, static_cast<int>(b[0]) - 128);
    for (int j = 0; j < 16; ++j) {
      s.v[j] = static_cast<float>(kTable[b[1 + j] & 15]) * d;
      s.v[j + 16] = static_cast<float>(kTable[b[1 + j] >> 4]) * d;
    }
    return s;
  }
  static F Chunk(const State& s, int c) { return ChunkOf(s, c); }
};

// ---- q8 activations (see simd_avx2.h) ----
#define KILN_ISA_HAS_Q8 1
#define KILN_Q8_VNNI 0
inline constexpr int kQ8MR = 2;  // q8 tile rows (q8_impl.h)

inline void QuantizeQ8(const float* x, int64_t K, Q8Block* out) {
  for (int64_t b = 0; b < K / 32; ++b, x += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, id = amax != 0 ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(x[j] * id));
      out[b].qs[j] = static_cast<int8_t>(std::clamp(q, -128, 127));
      sum += out[b].qs[j];
    }
    out[b].d = RoundToF16(d);
    out[b].s = out[b].d * static_cast<float>(sum);
  }
}

struct Q8W {
  int16_t q[32];
  float d, off;
};
struct Q8DecQ4_0 {
  static constexpr int64_t kBlockBytes = 18;
  static Q8W Load(const uint8_t* b) {
    Q8W w;
    w.d = F16ToFloat(U16(b));
    w.off = -8.0f * w.d;
    for (int j = 0; j < 16; ++j) {
      w.q[j] = b[2 + j] & 15;
      w.q[j + 16] = b[2 + j] >> 4;
    }
    return w;
  }
};
struct Q8DecQ4_1 {
  static constexpr int64_t kBlockBytes = 20;
  static Q8W Load(const uint8_t* b) {
    Q8W w;
    w.d = F16ToFloat(U16(b));
    w.off = F16ToFloat(U16(b + 2));
    for (int j = 0; j < 16; ++j) {
      w.q[j] = b[4 + j] & 15;
      w.q[j + 16] = b[4 + j] >> 4;
    }
    return w;
  }
};
struct Q8DecQ8_0 {
  static constexpr int64_t kBlockBytes = 34;
  static Q8W Load(const uint8_t* b) {
    Q8W w;
    w.d = F16ToFloat(U16(b));
    w.off = 0;
    for (int j = 0; j < 32; ++j) w.q[j] = static_cast<int8_t>(b[2 + j]);
    return w;
  }
};
struct Q8DecMXFP4 {
  static constexpr int64_t kBlockBytes = 17;
  static Q8W Load(const uint8_t* b) {
    static constexpr int8_t kTable[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    Q8W w;
    w.d = b[0] == 0xff ? NAN : std::ldexp(1.0f, static_cast<int>(b[0]) - 128);
    w.off = 0;
    for (int j = 0; j < 16; ++j) {
      w.q[j] = kTable[b[1 + j] & 15];
      w.q[j + 16] = kTable[b[1 + j] >> 4];
    }
    return w;
  }
};
template <class W>
inline void Q8Accumulate(const Q8W& w, const Q8Block& x, F& acc, float& off) {
  int32_t dot = 0;
  for (int j = 0; j < 32; ++j) dot += w.q[j] * x.qs[j];
  acc.v[0] += w.d * x.d * static_cast<float>(dot);
  off += w.off * x.s;
}

}  // namespace kiln::cpu::scalar
