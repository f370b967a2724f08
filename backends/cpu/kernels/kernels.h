// The CPU kernels' inner interface: plain-data problem descriptions and one table of entry
// points per instruction-set variant (isa.h). The variants are compiled from one generic
// source (kernels_impl.h) with different target flags; everything above this header —
// threading, kernel choice, autotuning, oneDNN — is ISA-neutral (linear.cc, attention.cc).
//
// Entry points compute a caller-chosen part of a problem on the calling thread; callers
// split problems over the pool's threads. They never allocate on the heap in steady state
// (thread-local scratch grows once) and are safe to call from many threads at once on
// disjoint outputs.
#pragma once

#include <cstdint>

#include "backends/cpu/kernels/isa.h"
#include "engine/dtype.h"

namespace kiln::cpu {

// y[M, N] = x[M, K] · W^T, f32 activations and output.
//
// W is N rows of K elements. For block-quantized and f16/bf16/f32 weights, row n starts at
// `w + n * w_row_bytes` and its elements are contiguous (quantization blocks along K, as in
// GGUF). For f32 weights only, `w_k_stride` != 1 describes a strided view: element (n, k)
// is at `((const float*)w)[n * w_row_bytes / 4 + k * w_k_stride]` (MatMul's [K, N] operand
// seen as W = b^T). x rows are contiguous with `ldx` elements between rows; y likewise.
struct GemmArgs {
  const float* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;
  DType wtype = DType::kF32;
  int64_t w_row_bytes = 0;
  int64_t w_k_stride = 1;
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  // x column-major: element (m, k) at x[k * ldx + m] (autograd's dW = g^T x read in place).
  // Only a OneDnnGemm created for it takes this; every other path requires false.
  bool x_transposed = false;
};

// Weight types with register-level decoders (every variant): f32, f16, bf16, q4_0, q4_1,
// q8_0, mxfp4. Other quantized types (K-quants) run through DequantizeRow (slower).
bool HasFastDecoder(DType wtype);

// Paged attention problem (the engine's PagedAttention op, f32 queries and output; K/V cache
// in f32, f16 or bf16 — both caches the same type). Strides are in elements; the last axis
// of every tensor is contiguous.
enum class MaskKind : uint8_t { kNone, kCausal, kSlidingWindow };
struct AttnArgs {
  const float* q = nullptr;  // [T, Hq, D]
  int64_t q_st = 0, q_sh = 0;
  const void* k = nullptr;  // [NB, BS, Hkv, D]
  const void* v = nullptr;  // [NB, BS, Hkv, Dv]
  DType kv_dtype = DType::kF32;
  int64_t k_sb = 0, k_ss = 0, k_sh = 0;
  int64_t v_sb = 0, v_ss = 0, v_sh = 0;
  int64_t block_size = 0;
  float* out = nullptr;  // [T, Hq, Dv]
  int64_t o_st = 0, o_sh = 0;
  int64_t Hq = 0, Hkv = 0, D = 0, Dv = 0;
  float scale = 1;
  MaskKind mask = MaskKind::kNone;
  int64_t window = 0;  // kSlidingWindow: key j is visible from query position p iff
                       // j <= p && p - j < window
  int64_t chunk = 0;   // > 0 (with a causal or window mask): key j is visible from position p
                       // only if j >= p - p % chunk (attn::ChunkedMask)
  // Non-null: score_mod attn::AlibiScore, s + slopes[query head] * (j - p), on the scaled
  // scores (before any soft-cap).
  const float* alibi_slopes = nullptr;
  float softcap = 0;  // > 0: score_mod attn::SoftCapScore(softcap) on the scaled scores
  // Non-null: compiled modifiers (attention_mods.h; no ALiBi or soft-cap above with them), on
  // the scaled scores s[0..n) of query head h of sequence b at position q against the keys at
  // positions kv[0..n): score_mod, then -inf where mask_mod hides the key.
  void (*mods)(const void* ctx, float* s, int64_t n, int64_t b, int64_t h, int64_t q,
               const int64_t* kv) = nullptr;
  // Non-null (with a compiled mask_mod): whether the mask keeps any key of [kv0, kv0 + n) for
  // a query head of [h0, h0 + nh) of sequence b at a position of [q0, q0 + rows). The kernels
  // skip the key tiles it rules out: never gathered, no score computed (the same result: such
  // a tile adds nothing to a row).
  bool (*mods_any)(const void* ctx, int64_t b, int64_t h0, int64_t nh, int64_t q0, int64_t rows,
                   int64_t kv0, int64_t n) = nullptr;
  const void* mods_ctx = nullptr;
};

// Keys per tile of the attention kernels. A row's output is computed tile by tile over tiles
// aligned to multiples of kAttnKeyTile key positions, in one fixed arithmetic: it is the same,
// bit for bit, whatever other rows share its task (one row, or a block of a prefill, split
// anywhere) and wherever its keys are split between partial tasks at tile boundaries.
inline constexpr int64_t kAttnKeyTile = 64;

// One unit of attention work: query rows [t0, t1) of one sequence (row t0 at key position
// `pos0`, row t0 + i at pos0 + i), the query heads of kv head `g`, keys [j0, j1).
// `blocks[j / block_size]` is the physical block of key j, or -1 (key skipped).
// With `partial` null the rows are finished (softmax-normalized, written to `out`; rows
// with no visible key get zeros). Otherwise each row's unnormalized state per key tile goes
// to `partial`, for attend_combine: per row of the task, per tile of [j0, j1)
// (AttnPartialTiles), per query head of the group, {max, sum, acc[Dv]} (max = -inf where the
// row sees no key of the tile).
// REQUIRES: with `partial`, j0 is a multiple of kAttnKeyTile.
struct AttnTask {
  int64_t seq = 0;  // the sequence (b of the modifiers)
  const int64_t* blocks = nullptr;
  int64_t t0 = 0, t1 = 0, pos0 = 0;
  int64_t g = 0;
  int64_t j0 = 0, j1 = 0;
  float* partial = nullptr;
};
// Floats per partial state of one row and head.
inline int64_t AttnPartialFloats(int64_t dv) { return dv + 2; }
// Key tiles of the keys [j0, j1) of a partial task (j0 a multiple of kAttnKeyTile).
inline int64_t AttnPartialTiles(int64_t j0, int64_t j1) {
  return (j1 + kAttnKeyTile - 1) / kAttnKeyTile - j0 / kAttnKeyTile;
}

// Activations quantized to 8 bits per 32-element block, ggml's Q8_1 numerics: d = max|x|/127,
// q = x * (127 / max|x|) rounded to nearest even; d is rounded to f16 as ggml stores it, so
// that products match llama.cpp's as closely as possible; s = d * sum(q) (exact in f32). Used only
// where the numerics policy allows quantized activations (linear.h): results differ from exact f32
// products by about 1e-5 in normalized MSE. Rounds to the nearest f16 value (kept as a float).
inline float RoundToF16(float x) { return F16ToFloat(FloatToF16(x)); }

// GEMV tiles read weight rows in strips of four consecutive rows, and strips follow each other
// in memory (the row stride is the row size in every layout the loaders produce). The hardware
// prefetcher does not keep up with a tile's interleaved row streams — the q4 GEMVs read 10-12
// GB/s from memory without help and 25-30 GB/s with it (tests/bench/gemm_bench) — so a tile of
// `nr` rows at `w`, at byte `at` of its rows and reading `step` bytes per row per step,
// prefetches the matching bytes kPrefetchStrips strips ahead. Prefetches past the weights do
// not fault.
inline constexpr int kPrefetchStrips = 2;
inline void PrefetchAhead(const uint8_t* w, int64_t ldw, int nr, int64_t at, int64_t step) {
  const uint8_t* p = w + kPrefetchStrips * 4 * ldw + nr * at;
  __builtin_prefetch(p);
  __builtin_prefetch(p + nr * step - 1);
}

struct Q8Block {
  float d, s;
  int8_t qs[32];
};

struct IsaKernels {
  Isa isa;
  // Rows n in [n0, n1) of y, all M rows: each weight byte read and decoded once — in
  // registers for up to four rows of x, else a strip of four weight rows into f32 scratch that
  // every row of x runs against (decode and small M).
  // REQUIRES: w_k_stride == 1.
  void (*gemv)(const GemmArgs& a, int64_t n0, int64_t n1);
  // The tile y[m0:m1, n0:n1]: weight panels decoded to f32 in cache-sized packs, then a
  // register-blocked f32 micro-kernel (prefill: large M).
  void (*gemm)(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  // Decodes weight rows [n0, n1) to f32, dst[(n - n0) * K + k].
  void (*dequant)(const GemmArgs& a, int64_t n0, int64_t n1, float* dst);
  // Runs one attention task.
  void (*attend)(const AttnArgs& a, const AttnTask& task);
  // Finishes one row and head from its per-tile partial states, `n` tiles in key order
  // `stride` floats apart (from tasks covering the row's keys at tile boundaries): `out[dv]`
  // bit for bit what an unsplit task writes (zeros if no key was visible).
  void (*attend_combine)(const float* tiles, int64_t n, int64_t stride, int64_t dv, float* out);
  // Softmax statistics of one row of n floats: its maximum (NaN if any element is NaN) and
  // sum(exp(x - max)), exponentials in f32 (about 2 ulp), summed in f32 over chunks of 1,024
  // elements and the chunks in double.
  void (*softmax_stats)(const float* x, int64_t n, float* max, double* sum);
  // Softmax of one row in place, bit for bit what softmax_stats and then
  // scaled_exp(x, n, max, float(1 / sum), x) give, with one exponential per element; also
  // returns max and sum. A row whose max is -inf (n = 0, or every score masked) becomes
  // zeros, with sum 0.
  void (*softmax)(float* x, int64_t n, float* max, double* sum);
  // y[j] = exp(x[j] - shift) * scale for j in [0, n); y may alias x.
  void (*scaled_exp)(const float* x, int64_t n, float shift, float scale, float* y);
  // Small f32 products for the tiles of training attention: c[m, n] = alpha * A B (or
  // c += alpha * A B with `accumulate`), A(r, k) = a[r * a_rs + k * a_cs] (any strides: A or
  // A^T), B rows k of n contiguous floats `ldb` apart, c rows `ldc` apart. f32 accumulation.
  void (*small_gemm)(const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                     float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, float alpha,
                     bool accumulate);
  // Gemma's soft-capping on scores scaled by `pre`, in place: s = cap * tanh(pre * s / cap).
  void (*soft_cap)(float* s, int64_t n, float pre, float cap);
};

// The kernels on q8 activations (Q8Block), in three sets: "scalar", and two with
// bit-identical results: "avx2" (maddubs + madd integer dots) and "avx512_vnni" (vpdpbusd,
// two weight rows per 512-bit register, six activation rows per tile) — see q8_impl.h. Both
// of these put eight (avx2) or sixteen (VNNI) weight rows in the lanes for prefill.
struct Q8Kernels {
  const char* name;
  int tile_rows;  // rows of x per tile: splits of M in multiples of it fill whole tiles
  // Quantizes K floats (K a multiple of 32) into K / 32 blocks.
  void (*quantize)(const float* x, int64_t K, Q8Block* out);
  // Rows n in [n0, n1) of y from activations already quantized: `xq` holds M rows of
  // K / 32 blocks. REQUIRES: wtype q4_0, q4_1, q8_0 or mxfp4; w_k_stride == 1.
  void (*gemv)(const GemmArgs& a, const Q8Block* xq, int64_t n0, int64_t n1);
};

// True for the weight types Q8Kernels::gemv takes.
bool HasQ8Path(DType wtype);

// The q8 kernels for variant `isa`: the VNNI set where `isa` is avx512 and the CPU has
// AVX-512 VNNI, the AVX2 set for avx2 and avx512 otherwise, the scalar set for scalar; null
// if `isa` cannot run here.
const Q8Kernels* Q8KernelsFor(Isa isa);
// The AVX2 set, and the VNNI set or null where this CPU lacks AVX-512 VNNI (tests, benches).
const Q8Kernels& Avx2Q8Kernels();
const Q8Kernels* VnniQ8Kernels();

// The kernels on bf16 activations for bf16 weights (kernels_bf16.cc), used only where the
// numerics policy allows it (linear.h): x is rounded to bf16 (to nearest even; denormals
// flushed to zero, as the instruction does), each product of two bf16 values is exact in f32,
// and the products are accumulated in f32 with vdpbf16ps along K — ggml's numerics for bf16
// weights on AVX-512 BF16. Every (row of x, weight row) pair is computed in one fixed
// arithmetic whatever M, the tile or the thread split, so a row's result does not depend on
// its batch. Results differ from exact f32 products by x's rounding: a relative error of up
// to 2^-9 per product.
struct Bf16Kernels {
  const char* name;
  // x[0, K) rounded to bf16 into out[0, Bf16RowElems(K)), zero-padded past K.
  void (*round)(const float* x, int64_t K, uint16_t* out);
  // y[m0:m1, n0:n1] from rows [m0, m1) of x already rounded, row m at xb + (m - m0) * ldxb.
  // REQUIRES: wtype bf16, w_k_stride == 1; ldxb >= Bf16RowElems(K).
  void (*gemm)(const GemmArgs& a, const uint16_t* xb, int64_t ldxb, int64_t m0, int64_t m1,
               int64_t n0, int64_t n1);
};
// Elements of a rounded row: K up to whole 32-element chunks.
inline int64_t Bf16RowElems(int64_t K) { return (K + 31) / 32 * 32; }
// The bf16 kernels where `isa` is avx512, the CPU has AVX-512 BF16 and runs vdpbf16ps's
// multiply-adds at least kMinBf16DotSpeedup times as fast as 512-bit FMAs' (Bf16DotSpeedup);
// otherwise null (the exact f32 path runs instead, which is then as fast or faster: a Zen 4
// measured 2.0, a Sapphire Rapids Xeon 0.5).
inline constexpr double kMinBf16DotSpeedup = 1.3;
const Bf16Kernels* Bf16KernelsFor(Isa isa);
// vdpbf16ps's multiply-adds per second over 512-bit FMAs', on the calling thread, measured once
// (~1 ms, the best of three rounds each) at the first call; 0 without AVX-512 BF16.
double Bf16DotSpeedup();
const Bf16Kernels& Avx512Bf16Kernels();  // only where CpuHasAvx512Bf16()

// The table of a variant, or null if it cannot run on this CPU.
const IsaKernels* KernelsFor(Isa isa);

// Per-variant tables (defined in kernels_<isa>.cc).
const IsaKernels& ScalarKernels();
const IsaKernels& Avx2Kernels();
const IsaKernels& Avx512Kernels();
const Q8Kernels& ScalarQ8Kernels();
const Q8Kernels& Avx512VnniQ8Kernels();  // only where CpuHasAvx512Vnni()

}  // namespace kiln::cpu
