// The printer core: one expression printer (SSA temporaries, shared subtrees printed once,
// loop-invariant values hoisted to the row level) and kernel skeletons; the dialects differ
// only in their header (DialectHeader) and in how the skeleton maps work to threads.
#include "engine/compiler/codegen.h"

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "engine/compiler/hash.h"

namespace kiln::compiler {

// The C++ preamble mirrors these layouts; keep them in sync.
static_assert(sizeof(TensorArg) == 144 && offsetof(TensorArg, dtype) == 8 &&
                  offsetof(TensorArg, rank) == 12 && offsetof(TensorArg, shape) == 16 &&
                  offsetof(TensorArg, strides) == 80,
              "TensorArg layout changed: update the C++ preamble in codegen.cc");
// Generated kernels read LaunchArgs up to `params`; the extra outputs of multi-output nodes
// (interface v3) follow it and are not mirrored.
static_assert(sizeof(LaunchArgs) == 216 && offsetof(LaunchArgs, inputs) == 8 &&
                  offsetof(LaunchArgs, num_inputs) == 16 && offsetof(LaunchArgs, output) == 24 &&
                  offsetof(LaunchArgs, params) == 168 && offsetof(LaunchArgs, extra_outputs) == 200,
              "LaunchArgs layout changed: update the C++ preamble in codegen.cc");
// Generated kernels read ExecCtx up to `native_stream` (KExecCtx mirrors that prefix; the
// fields after it, interface v4, are not mirrored).
static_assert(offsetof(ExecCtx, thread_count) == 4 && offsetof(ExecCtx, native_stream) == 8 &&
                  offsetof(ExecCtx, shares_in_sequence) == 16,
              "ExecCtx layout changed: update the C++ preamble");

namespace {

// ---- Preamble ----------------------------------------------------------------------------------

constexpr const char* kCppHeader = R"(// Kiln generated kernels (C++, CPU).
typedef long long ki64;
typedef unsigned long long ku64;
typedef int ki32;
typedef unsigned int ku32;
typedef short ki16;
typedef unsigned short ku16;
typedef signed char ki8;
typedef unsigned char ku8;
#define KHAS_F64 1
#define KFN static inline __attribute__((always_inline, unused))
#define KERNEL extern "C" __attribute__((visibility("default")))
#define GLOBAL
#define KF2U(x) __builtin_bit_cast(ku32, (float)(x))
#define KU2F(x) __builtin_bit_cast(float, (ku32)(x))
#define KD2L(x) __builtin_bit_cast(ki64, (double)(x))
#define KL2D(x) __builtin_bit_cast(double, (ki64)(x))
// glibc's vector math library (libmvec) provides SIMD variants of these; GCC uses them in
// vectorized loops when told they exist (as glibc's own headers do under -ffast-math).
#if defined(__GNUC__) && !defined(__clang__)
#define KVEC __attribute__((simd("notinbranch"), nothrow, const))
#else
#define KVEC __attribute__((nothrow, const))
#endif
extern "C" {
KVEC float expf(float);
KVEC float logf(float);
KVEC float sinf(float);
KVEC float cosf(float);
KVEC float tanhf(float);
KVEC float erff(float);
KVEC float powf(float, float);
KVEC double exp(double);
KVEC double log(double);
KVEC double sin(double);
KVEC double cos(double);
KVEC double tanh(double);
KVEC double erf(double);
KVEC double pow(double, double);
}
#define KEXPF expf
#define KLOGF logf
#define KSQRTF __builtin_sqrtf
#define KTANHF tanhf
#define KERFF erff
#define KSINF sinf
#define KCOSF cosf
#define KFLOORF __builtin_floorf
#define KFABSF __builtin_fabsf
#define KPOWF powf
#define KFMODF __builtin_fmodf
#define KRINTF __builtin_rintf
#define KEXP exp
#define KLOG log
#define KSQRT __builtin_sqrt
#define KTANH tanh
#define KERF erf
#define KSIN sin
#define KCOS cos
#define KFLOOR __builtin_floor
#define KFABS __builtin_fabs
#define KPOW pow
#define KFMOD __builtin_fmod
#define KRINT __builtin_rint
#define KTRUNC __builtin_trunc
#define KFREXP __builtin_frexp
#define KLDEXP __builtin_ldexp
#define KTRUNCF __builtin_truncf
#define KFREXPF __builtin_frexpf
#define KLDEXPF __builtin_ldexpf
// The kernel ABI (engine/backend/kernel_abi.h), mirrored.
struct KTensor {
  void* data;
  ku8 dtype;
  ki32 rank;
  ki64 shape[8];
  ki64 strides[8];
};
struct KLaunchArgs {
  const void* kernel_data;
  const KTensor* inputs;
  ki32 num_inputs;
  KTensor output;
  ki64 params[4];
};
struct KExecCtx {
  ki32 thread_index;
  ki32 thread_count;
  void* native_stream;
};
static_assert(sizeof(KTensor) == 144 && __builtin_offsetof(KTensor, shape) == 16, "kernel ABI");
static_assert(sizeof(KLaunchArgs) == 200 && __builtin_offsetof(KLaunchArgs, output) == 24,
              "kernel ABI");
static_assert(sizeof(KExecCtx) == 16, "kernel ABI");
// This thread's share [*b, *e) of n items: at most thread_count parts of at least `grain`
// items, part boundaries multiples of `align` (elements: whole cache lines).
KFN void kshare(ki64 n, ki64 grain, ki64 align, const KExecCtx& c, ki64* b, ki64* e) {
  ki64 parts = grain > 0 ? n / grain : n;
  if (parts > c.thread_count) parts = c.thread_count;
  if (parts < 1) parts = 1;
  ki64 chunk = (n + parts - 1) / parts;
  chunk = (chunk + align - 1) / align * align;
  const ki64 lo = chunk * c.thread_index;
  *b = lo < n ? lo : n;
  *e = lo + chunk < n ? lo + chunk : n;
}
KFN bool kdense(const KTensor& t, const ki64* shape, int r) {
  ki64 s = 1;
  for (int d = r - 1; d >= 0; --d) {
    if (shape[d] != 1 && t.strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}
KFN void kunravel(ki64 p, const ki64* shape, int r, ki64* idx) {
  for (int d = r - 1; d >= 0; --d) {
    const ki64 s = shape[d] > 0 ? shape[d] : 1;
    idx[d] = p % s;
    p /= s;
  }
}
)";

// KILN_NO_FP64 (defined before the preamble) prints no double arithmetic even where the
// device has cl_khr_fp64 (the xpu backend's devices without f64 tensors).
constexpr const char* kOpenClHeader = R"CL(// Kiln generated kernels (OpenCL C).
#if defined(cl_khr_fp64) && !defined(KILN_NO_FP64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define KHAS_F64 1
#else
#define KHAS_F64 0
#endif
typedef long ki64;
typedef ulong ku64;
typedef int ki32;
typedef uint ku32;
typedef short ki16;
typedef ushort ku16;
typedef char ki8;
typedef uchar ku8;
#define KFN static inline
#define KERNEL __kernel
#define GLOBAL __global
#define LOCAL __local
// Each work-item's loop walks elements a global size (or a group size) apart: vectorizing it
// gives gathers and scatters, and PoCL (which vectorizes across work-items) then spends ~30%
// more time compiling every kernel at its first launch. KNOVEC keeps such loops scalar; the
// grid-stride step is unsigned (size_t) for the same reason.
#define KNOVEC _Pragma("clang loop vectorize(disable)")
#define GLOBAL_ID get_global_id(0)
#define GLOBAL_SIZE get_global_size(0)
#define LOCAL_ID ((int)get_local_id(0))
#define GROUP_ID get_group_id(0)
#define NUM_GROUPS get_num_groups(0)
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#define KF2U(x) as_uint((float)(x))
#define KU2F(x) as_float((ku32)(x))
#define KD2L(x) as_long((double)(x))
#define KL2D(x) as_double((ki64)(x))
#define KEXPF exp
#define KLOGF log
#define KSQRTF sqrt
#define KTANHF tanh
#define KERFF erf
#define KSINF sin
#define KCOSF cos
#define KFLOORF floor
#define KFABSF fabs
#define KPOWF pow
#define KFMODF fmod
#define KRINTF rint
#define KEXP exp
#define KLOG log
#define KSQRT sqrt
#define KTANH tanh
#define KERF erf
#define KSIN sin
#define KCOS cos
#define KFLOOR floor
#define KFABS fabs
#define KPOW pow
#define KFMOD fmod
#define KRINT rint
#define KTRUNC trunc
#define KFREXP frexp
#define KLDEXP ldexp
#define KTRUNCF trunc
#define KFREXPF frexp
#define KLDEXPF ldexp
)CL";

// CUDA and HIP are one dialect: HIP compiles CUDA's names (thread indices, __shared__,
// __syncthreads, the bit-cast intrinsics, the math library) as they are, so the only vendor
// switch is HIP's runtime header (ggml's ggml-cuda/vendors/hip.h maps the host runtime API
// too; generated kernels use none of it).
constexpr const char* kHipVendor = R"(#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
)";
constexpr const char* kGpuHeader = R"(typedef long long ki64;
typedef unsigned long long ku64;
typedef int ki32;
typedef unsigned int ku32;
typedef short ki16;
typedef unsigned short ku16;
typedef signed char ki8;
typedef unsigned char ku8;
#define KHAS_F64 1
#define KFN static __device__ __forceinline__
#define KERNEL extern "C" __global__
#define GLOBAL
#define LOCAL __shared__
#define KNOVEC
#define GLOBAL_ID ((ki64)blockIdx.x * blockDim.x + threadIdx.x)
#define GLOBAL_SIZE ((ki64)gridDim.x * blockDim.x)
#define LOCAL_ID ((int)threadIdx.x)
#define GROUP_ID ((ki64)blockIdx.x)
#define NUM_GROUPS ((ki64)gridDim.x)
#define BARRIER() __syncthreads()
#define KF2U(x) __float_as_uint((float)(x))
#define KU2F(x) __uint_as_float((ku32)(x))
#define KD2L(x) __double_as_longlong((double)(x))
#define KL2D(x) __longlong_as_double((ki64)(x))
)";

// CUDA and HIP share the C math library names.
constexpr const char* kCudaMath = R"(#define KEXPF expf
#define KLOGF logf
#define KSQRTF sqrtf
#define KTANHF tanhf
#define KERFF erff
#define KSINF sinf
#define KCOSF cosf
#define KFLOORF floorf
#define KFABSF fabsf
#define KPOWF powf
#define KFMODF fmodf
#define KRINTF rintf
#define KEXP exp
#define KLOG log
#define KSQRT sqrt
#define KTANH tanh
#define KERF erf
#define KSIN sin
#define KCOS cos
#define KFLOOR floor
#define KFABS fabs
#define KPOW pow
#define KFMOD fmod
#define KRINT rint
#define KTRUNC trunc
#define KFREXP frexp
#define KLDEXP ldexp
#define KTRUNCF truncf
#define KFREXPF frexpf
#define KLDEXPF ldexpf
)";

// Helpers every dialect shares, written in the common subset of C++, OpenCL C and CUDA.
// Conversions are branch-free so the CPU compiler vectorizes loops that use them.
constexpr const char* kCommon = R"(#define KINFF KU2F(0x7f800000u)
#define KNANF KU2F(0x7fc00000u)
// f16 bits -> f32 (exact).
KFN float kh2f(ku32 h) {
  const ku32 s = (h & 0x8000u) << 16;
  const ku32 em = h & 0x7fffu;
  ku32 nb = (em << 13) + 0x38000000u;
  nb = em >= 0x7c00u ? nb + 0x38000000u : nb;
  const float sub = (float)(ki32)em * 5.9604644775390625e-8f;
  const float r = em < 0x400u ? sub : KU2F(nb);
  return KU2F(KF2U(r) | s);
}
// f32 -> f16 bits, round to nearest even; overflow -> inf; NaN -> 0x7e00 (with sign).
KFN ku16 kf2h(float f) {
  const ku32 x = KF2U(f);
  const ku32 s = (x >> 16) & 0x8000u;
  const ku32 a = x & 0x7fffffffu;
  ku32 r = a - 0x38000000u;
  r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  const float t = a < 0x38800000u ? KU2F(a) : 0.0f;
  const ku32 sub = (ku32)(ki32)KRINTF(t * 16777216.0f);
  ku32 v = a < 0x38800000u ? sub : r;
  v = a >= 0x477ff000u ? 0x7c00u : v;
  v = a > 0x7f800000u ? 0x7e00u : v;
  return (ku16)(s | v);
}
KFN float kbf2f(ku32 h) { return KU2F(h << 16); }
// f32 -> bf16 bits, round to nearest even; NaN -> 0x7fc0 (with sign).
KFN ku16 kf2bf(float f) {
  const ku32 x = KF2U(f);
  const ku32 r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (ku16)((x & 0x7fffffffu) > 0x7f800000u ? (((x >> 16) & 0x8000u) | 0x7fc0u) : r);
}
// fp8 e4m3 ("fn": no infinities, 0x7f/0xff are NaN) -> f32.
KFN float ke4m3f(ku32 v) {
  const ku32 s = (v & 0x80u) << 24;
  const ku32 em = v & 0x7fu;
  const float sub = (float)(ki32)em * 0.001953125f;
  float r = em < 8u ? sub : KU2F((em << 20) + 0x3c000000u);
  r = em == 0x7fu ? KNANF : r;
  return KU2F(KF2U(r) | s);
}
KFN ki64 kineg(ki64 a) { return (ki64)((ku64)0 - (ku64)a); }
KFN ki64 kiabs(ki64 a) { return a < 0 ? kineg(a) : a; }
KFN ki64 kiadd(ki64 a, ki64 b) { return (ki64)((ku64)a + (ku64)b); }
KFN ki64 kisub(ki64 a, ki64 b) { return (ki64)((ku64)a - (ku64)b); }
KFN ki64 kimul(ki64 a, ki64 b) { return (ki64)((ku64)a * (ku64)b); }
// Division by 0 gives 0 (never a trap); the one overflowing case wraps.
KFN ki64 kidiv(ki64 a, ki64 b) { return b == 0 ? 0 : (b == -1 ? kineg(a) : a / b); }
// Python's modulo: the result has the divisor's sign.
KFN ki64 kimod(ki64 a, ki64 b) {
  if (b == 0 || b == -1) return 0;
  const ki64 r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
KFN ki64 kimax(ki64 a, ki64 b) { return a < b ? b : a; }
KFN ki64 kimin(ki64 a, ki64 b) { return b < a ? b : a; }
// NaN-propagating max/min (the reference kernels' semantics).
KFN float kmaxf(float a, float b) { return (a != a || b != b) ? KNANF : (a < b ? b : a); }
KFN float kminf(float a, float b) { return (a != a || b != b) ? KNANF : (b < a ? b : a); }
KFN float ksigmoidf(float x) {
  const float e = KEXPF(-KFABSF(x));
  const float r = 1.0f / (1.0f + e);
  return x >= 0.0f ? r : e * r;
}
KFN bool kbetterf(float v, ki64 p, float a, ki64 q) {
  return v != v ? (!(a != a) || p < q) : (!(a != a) && (v > a || (v == a && p < q)));
}
KFN bool kbetteri(ki64 v, ki64 p, ki64 a, ki64 q) { return v > a || (v == a && p < q); }
// Float -> integer from an f32 value: truncate toward zero, saturate at [mn, mx], NaN -> 0.
// The limits are powers of two (exact in float), so this equals the double form below.
KFN ki64 ksatf(float v, float lo, float hip1, ki64 mn, ki64 mx) {
  if (v != v) return 0;
  const float t = KTRUNCF(v);
  return t >= hip1 ? mx : (t <= lo ? mn : (ki64)t);
}
// Any narrow float format from a T, round to nearest even (engine/dtype.cc EncodeMini):
// special 0 = IEEE (inf, NaN), 1 = finite with NaN (fp8 e4m3fn), 2 = finite only. The float
// form is exact for f32 values (every step scales by a power of two or rounds once).
#define KDEFINE_MINI(T, S, NEG, FREXP, LDEXP, RINT, FABS, INF)                               \
  KFN T kmini_max##S(int eb, int mb, int bias, int special) {                               \
    const int exp_all = (1 << eb) - 1;                                                      \
    const T man_max = (T)((1 << mb) - 1), one = (T)(1 << mb);                               \
    if (special == 0) return LDEXP((T)1 + man_max / one, exp_all - 1 - bias);              \
    if (special == 1) return LDEXP((T)1 + (man_max - (T)1) / one, exp_all - bias);          \
    return LDEXP((T)1 + man_max / one, exp_all - bias);                                     \
  }                                                                                         \
  KFN ku32 k##S##2mini(T x, int eb, int mb, int bias, int special) {                        \
    const ku32 sign = NEG(x) ? (1u << (eb + mb)) : 0u;                                      \
    const ku32 exp_all = (1u << eb) - 1u, all_ones = (1u << (eb + mb)) - 1u;                \
    if (x != x) {                                                                           \
      if (special == 0) return sign | exp_all << mb | 1u << (mb - 1);                       \
      return special == 1 ? (sign | all_ones) : 0u;                                         \
    }                                                                                       \
    const ku32 ovf = special == 0 ? (sign | exp_all << mb) : (sign | all_ones);             \
    const T a = FABS(x);                                                                    \
    if (a == INF) return ovf;                                                               \
    if (a == (T)0) return sign;                                                             \
    int e = 0;                                                                              \
    FREXP(a, &e);                                                                           \
    const int emin = 1 - bias;                                                              \
    const int q = (e - 1 > emin ? e - 1 : emin) - mb;                                       \
    const T rounded = LDEXP(RINT(LDEXP(a, -q)), q);                                         \
    if (rounded > kmini_max##S(eb, mb, bias, special)) return ovf;                          \
    if (rounded == (T)0) return sign;                                                       \
    FREXP(rounded, &e);                                                                     \
    const int e2 = e - 1;                                                                   \
    if (e2 < emin) return sign | (ku32)LDEXP(rounded, mb - emin);                           \
    const ku32 man = (ku32)LDEXP(rounded, mb - e2) - (1u << mb);                            \
    return sign | (ku32)(e2 + bias) << mb | man;                                            \
  }
#define KNEGF(x) ((ki32)KF2U(x) < 0)
KDEFINE_MINI(float, f, KNEGF, KFREXPF, KLDEXPF, KRINTF, KFABSF, KINFF)
#if KHAS_F64
#define KINF KL2D(0x7ff0000000000000L)
#define KNAN KL2D(0x7ff8000000000000L)
KFN double kmaxd(double a, double b) { return (a != a || b != b) ? KNAN : (a < b ? b : a); }
KFN double kmind(double a, double b) { return (a != a || b != b) ? KNAN : (b < a ? b : a); }
KFN double ksigmoidd(double x) {
  const double e = KEXP(-KFABS(x));
  const double r = 1.0 / (1.0 + e);
  return x >= 0.0 ? r : e * r;
}
KFN bool kbetterd(double v, ki64 p, double a, ki64 q) {
  return v != v ? (!(a != a) || p < q) : (!(a != a) && (v > a || (v == a && p < q)));
}
KFN ki64 ksat(double v, double lo, double hip1, ki64 mn, ki64 mx) {
  if (v != v) return 0;
  const double t = KTRUNC(v);
  return t >= hip1 ? mx : (t <= lo ? mn : (ki64)t);
}
#define KNEGD(x) (KD2L(x) < 0)
KDEFINE_MINI(double, d, KNEGD, KFREXP, KLDEXP, KRINT, KFABS, KINF)
// i64 -> f32 and narrow floats round once, through double (the interpreter's rule); without
// double, through float (differs only for |v| > 2^24, and only for bf16).
#define KI2F(v) ((float)(double)(v))
#define KI2MINI(v, eb, mb, bias, special) kd2mini((double)(v), eb, mb, bias, special)
#else
#define KI2F(v) ((float)(v))
#define KI2MINI(v, eb, mb, bias, special) kf2mini((float)(v), eb, mb, bias, special)
#endif
)";

std::string BuildPreamble(Dialect d) {
  switch (d) {
    case Dialect::kCpp:
      return StrCat(kCppHeader, kCommon);
    case Dialect::kOpenCL:
      return StrCat(kOpenClHeader, kCommon);
    case Dialect::kCuda:
      return StrCat("// Kiln generated kernels (CUDA C).\n", kGpuHeader, kCudaMath, kCommon);
    case Dialect::kHip:
      return StrCat("// Kiln generated kernels (HIP C).\n", kHipVendor, kGpuHeader, kCudaMath,
                    kCommon);
  }
  return "";
}

// ---- Types and conversions ---------------------------------------------------------------------

bool IsF(DType t) { return t == DType::kF32 || t == DType::kF64; }

// C type of an expression value.
const char* ValueType(DType t) {
  switch (t) {
    case DType::kF32:
      return "float";
    case DType::kF64:
      return "double";
    case DType::kI64:
      return "ki64";
    default:
      return "bool";
  }
}

// C type of a stored element.
const char* ElemType(DType t) {
  switch (t) {
    case DType::kF32:
      return "float";
    case DType::kF64:
      return "double";
    case DType::kF16:
    case DType::kBF16:
      return "ku16";
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kU8:
    case DType::kBool:
      return "ku8";
    case DType::kI8:
      return "ki8";
    case DType::kI16:
      return "ki16";
    case DType::kI32:
      return "ki32";
    case DType::kI64:
      return "ki64";
    default:
      return "void";
  }
}

// The value of stored element `ref` (an lvalue text) of dtype `t`, as ExprTypeOf(t).
std::string LoadConv(DType t, const std::string& ref) {
  switch (t) {
    case DType::kF32:
    case DType::kF64:
      return ref;
    case DType::kF16:
      return StrCat("kh2f(", ref, ")");
    case DType::kBF16:
      return StrCat("kbf2f(", ref, ")");
    case DType::kF8E4M3:
      return StrCat("ke4m3f(", ref, ")");
    case DType::kF8E5M2:
      return StrCat("kh2f((ku32)", ref, " << 8)");
    case DType::kBool:
      return StrCat("(", ref, " != 0)");
    default:
      return StrCat("(ki64)", ref);
  }
}

struct IntRange {
  const char* lo;
  const char* hip1;
  const char* mn;
  const char* mx;
};
IntRange RangeOf(DType t) {
  switch (t) {
    case DType::kI8:
      return {"-128.0", "128.0", "-128", "127"};
    case DType::kU8:
      return {"0.0", "256.0", "0", "255"};
    case DType::kI16:
      return {"-32768.0", "32768.0", "-32768", "32767"};
    case DType::kI32:
      return {"-2147483648.0", "2147483648.0", "(-2147483647 - 1)", "2147483647"};
    default:
      return {"-9223372036854775808.0", "9223372036854775808.0", "(-9223372036854775807L - 1)",
              "9223372036854775807L"};
  }
}

// Conversions of a value `v` of expression type `vt` (the interpreter's kCast semantics).
// Nothing here computes in double unless the value is f64 (or i64 where the dialect has
// double: KI2F/KI2MINI), so kernels without f64 tensors need no double support.
std::string ToF32(DType vt, const std::string& v) {
  switch (vt) {
    case DType::kF32:
      return v;
    case DType::kBool:
      return StrCat("(", v, " ? 1.0f : 0.0f)");
    case DType::kI64:
      return StrCat("KI2F(", v, ")");
    default:
      return StrCat("(float)", v);
  }
}
std::string ToF64(DType vt, const std::string& v) {
  if (vt == DType::kF64) return v;
  return vt == DType::kBool ? StrCat("(", v, " ? 1.0 : 0.0)") : StrCat("(double)", v);
}
// A float value truncated toward zero and saturated at dtype t's range (NaN -> 0), as ki64.
std::string Saturate(DType vt, DType t, const std::string& v) {
  const IntRange r = RangeOf(t);
  if (vt == DType::kF32) {
    return StrCat("ksatf(", v, ", ", r.lo, "f, ", r.hip1, "f, ", r.mn, ", ", r.mx, ")");
  }
  return StrCat("ksat(", ToF64(vt, v), ", ", r.lo, ", ", r.hip1, ", ", r.mn, ", ", r.mx, ")");
}

// Stores value `v` (of expression type `vt`) into an element of dtype `t`: the text of the
// element value (StoreElement / StoreInt semantics).
std::string StoreConv(DType vt, DType t, const std::string& v) {
  // A narrow float format (exponent bits, mantissa bits, bias, special) from any value.
  auto narrow = [&](const char* elem, int eb, int mb, int bias, int special) {
    const std::string fmt = StrCat(", ", eb, ", ", mb, ", ", bias, ", ", special, ")");
    if (vt == DType::kF64) return StrCat("(", elem, ")kd2mini(", v, fmt);
    if (vt == DType::kI64) return StrCat("(", elem, ")KI2MINI(", v, fmt);
    return StrCat("(", elem, ")kf2mini(", ToF32(vt, v), fmt);
  };
  const bool f32ish = vt == DType::kF32 || vt == DType::kBool;
  switch (t) {
    case DType::kF32:
      return ToF32(vt, v);
    case DType::kF64:
      return ToF64(vt, v);
    case DType::kF16:
      return f32ish ? StrCat("kf2h(", ToF32(vt, v), ")") : narrow("ku16", 5, 10, 15, 0);
    case DType::kBF16:
      return f32ish ? StrCat("kf2bf(", ToF32(vt, v), ")") : narrow("ku16", 8, 7, 127, 0);
    case DType::kF8E4M3:
      return narrow("ku8", 4, 3, 7, 1);
    case DType::kF8E5M2:
      return narrow("ku8", 5, 2, 15, 0);
    case DType::kBool:
      return StrCat("(ku8)(", v, " != 0)");
    default:
      break;
  }
  // Integers: floats truncate and saturate; integers and bools wrap.
  if (IsF(vt)) return StrCat("(", ElemType(t), ")", Saturate(vt, t, v));
  return StrCat("(", ElemType(t), ")", v);
}

std::string FloatLiteral(double v, DType t) {
  if (std::isnan(v)) return t == DType::kF32 ? "KNANF" : "KNAN";
  if (std::isinf(v)) return StrCat(v < 0 ? "(-" : "(", t == DType::kF32 ? "KINFF" : "KINF", ")");
  std::string s = t == DType::kF32 ? absl::StrFormat("%.9g", v) : absl::StrFormat("%.17g", v);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  if (t == DType::kF32) s += "f";
  return s[0] == '-' ? StrCat("(", s, ")") : s;
}

std::string IntLiteral(int64_t v) {
  if (v == INT64_MIN) return "(-9223372036854775807L - 1)";
  if (v >= INT32_MIN && v <= INT32_MAX) return StrCat("((ki64)", v, ")");
  return StrCat("((ki64)", v, "L)");
}

// ---- Output with indentation ------------------------------------------------------------------

struct Out {
  std::string text;
  std::string indent;
  explicit Out(std::string ind = "") : indent(std::move(ind)) {}
  void Line(std::string_view s) {
    text += indent;
    text.append(s.data(), s.size());
    text += '\n';
  }
  void Open(std::string_view s) {
    Line(s);
    indent += "  ";
  }
  void Close(std::string_view s = "}") {
    indent.resize(indent.size() - 2);
    Line(s);
  }
  void Append(const Out& o) { text += o.text; }
};

// ---- The expression printer --------------------------------------------------------------------

// Evaluation levels: values computed once per row (or once per kernel) and values computed
// per element. Constants print inline.
constexpr int kConstLevel = 0;
constexpr int kRowLevel = 1;
constexpr int kElemLevel = 2;

struct Leaf {
  std::string text;
  int level = kElemLevel;
};

class ExprPrinter {
 public:
  // `leaf` gives the text and level of Input/Index/Acc/Count leaves; `aux` the text of aux
  // arg k's element `index` (already bounds-checked by the printer) and its length.
  using LeafFn = std::function<Leaf(const ExprNode&)>;
  struct AuxRef {
    std::string element;  // e.g. "x0[xo0 + (I) * xs0]" with I replaced
    std::string length;
    DType dtype;
  };
  using AuxFn = std::function<AuxRef(int k, const std::string& index)>;

  ExprPrinter(std::string prefix, LeafFn leaf, AuxFn aux)
      : prefix_(std::move(prefix)), leaf_(std::move(leaf)), aux_(std::move(aux)) {}

  // Where temporaries of each level go from now on; resets that level's memo.
  void SetRowBlock(Out* out) {
    row_ = out;
    row_memo_.clear();
  }
  void SetElemBlock(Out* out) {
    elem_ = out;
    elem_memo_.clear();
  }

  // The text of `e`'s value (a temporary or a literal), emitting what it needs.
  std::string Print(const Expr& e) {
    const ExprNode& n = e.node();
    if (n.op == ExprOp::kConst) return Literal(n);
    const int level = Level(e);
    auto& memo = level <= kRowLevel && row_ != nullptr ? row_memo_ : elem_memo_;
    Out* out = level <= kRowLevel && row_ != nullptr ? row_ : elem_;
    auto it = memo.find(&n);
    if (it != memo.end()) return it->second;
    std::string rhs = Rhs(e);
    const std::string name = StrCat(prefix_, next_++);
    out->Line(StrCat("const ", ValueType(n.type), " ", name, " = ", rhs, ";"));
    memo.emplace(&n, name);
    return name;
  }

  // Forgets computed levels (when leaf meanings change, e.g. from stages to a reduce's output).
  void ResetLevels() { level_.clear(); }

  int Level(const Expr& e) {
    const ExprNode& n = e.node();
    auto it = level_.find(&n);
    if (it != level_.end()) return it->second;
    int l = kConstLevel;
    switch (n.op) {
      case ExprOp::kConst:
        break;
      case ExprOp::kInput:
      case ExprOp::kIndex:
      case ExprOp::kAcc:
      case ExprOp::kCount:
        l = leaf_(n).level;
        break;
      default:
        for (const Expr& a : n.args) l = std::max(l, Level(a));
        break;
    }
    level_.emplace(&n, l);
    return l;
  }

 private:
  static std::string Literal(const ExprNode& n) {
    if (n.type == DType::kBool) return n.ivalue ? "true" : "false";
    if (n.type == DType::kI64) return IntLiteral(n.ivalue);
    return FloatLiteral(n.fvalue, n.type);
  }

  std::string Rhs(const Expr& e) {
    const ExprNode& n = e.node();
    const DType t = n.type;
    const bool f32 = t == DType::kF32;
    auto arg = [&](int i) { return Print(n.args[i]); };
    auto fn = [&](const char* f32_name, const char* f64_name) {
      return StrCat(f32 ? f32_name : f64_name, "(", arg(0), ")");
    };
    switch (n.op) {
      case ExprOp::kInput:
      case ExprOp::kIndex:
      case ExprOp::kAcc:
      case ExprOp::kCount:
        return leaf_(n).text;
      case ExprOp::kLoad: {
        const std::string i = arg(0);
        const AuxRef r = aux_(n.index, i);
        const std::string zero =
            IsF(t) ? FloatLiteral(0, t) : (t == DType::kBool ? "false" : "((ki64)0)");
        return StrCat("(", i, " >= 0 && ", i, " < ", r.length, ") ? ", LoadConv(r.dtype, r.element),
                      " : ", zero);
      }
      case ExprOp::kNeg:
        return IsF(t) ? StrCat("-", arg(0)) : StrCat("kineg(", arg(0), ")");
      case ExprOp::kAbs:
        return IsF(t) ? fn("KFABSF", "KFABS") : StrCat("kiabs(", arg(0), ")");
      case ExprOp::kExp:
        return fn("KEXPF", "KEXP");
      case ExprOp::kLog:
        return fn("KLOGF", "KLOG");
      case ExprOp::kSqrt:
        return fn("KSQRTF", "KSQRT");
      case ExprOp::kRsqrt:
        return StrCat(f32 ? "1.0f / KSQRTF(" : "1.0 / KSQRT(", arg(0), ")");
      case ExprOp::kTanh:
        return fn("KTANHF", "KTANH");
      case ExprOp::kSigmoid:
        return fn("ksigmoidf", "ksigmoidd");
      case ExprOp::kErf:
        return fn("KERFF", "KERF");
      case ExprOp::kSin:
        return fn("KSINF", "KSIN");
      case ExprOp::kCos:
        return fn("KCOSF", "KCOS");
      case ExprOp::kFloor:
        return fn("KFLOORF", "KFLOOR");
      case ExprOp::kNot:
        return StrCat("!", arg(0));
      case ExprOp::kCast:
        return Cast(n.args[0].type(), t, arg(0));
      case ExprOp::kSelect:
        return StrCat(arg(0), " ? ", arg(1), " : ", arg(2));
      default:
        break;
    }
    const std::string a = arg(0), b = arg(1);
    const DType at = n.args[0].type();
    const bool fl = IsF(at);
    auto call = [&](const std::string& f) { return StrCat(f, "(", a, ", ", b, ")"); };
    switch (n.op) {
      case ExprOp::kAdd:
        return fl ? StrCat(a, " + ", b) : call("kiadd");
      case ExprOp::kSub:
        return fl ? StrCat(a, " - ", b) : call("kisub");
      case ExprOp::kMul:
        return fl ? StrCat(a, " * ", b) : call("kimul");
      case ExprOp::kDiv:
        return fl ? StrCat(a, " / ", b) : call("kidiv");
      case ExprOp::kMod:
        return fl ? call(f32 ? "KFMODF" : "KFMOD") : call("kimod");
      case ExprOp::kPow:
        return call(f32 ? "KPOWF" : "KPOW");
      case ExprOp::kMax:
        return fl ? call(f32 ? "kmaxf" : "kmaxd") : call("kimax");
      case ExprOp::kMin:
        return fl ? call(f32 ? "kminf" : "kmind") : call("kimin");
      case ExprOp::kEq:
        return StrCat(a, " == ", b);
      case ExprOp::kNe:
        return StrCat(a, " != ", b);
      case ExprOp::kLt:
        return StrCat(a, " < ", b);
      case ExprOp::kLe:
        return StrCat(a, " <= ", b);
      case ExprOp::kGt:
        return StrCat(a, " > ", b);
      case ExprOp::kGe:
        return StrCat(a, " >= ", b);
      case ExprOp::kAnd:
        return StrCat(a, " && ", b);
      case ExprOp::kOr:
        return StrCat(a, " || ", b);
      default:
        KILN_CHECK(false, "codegen: unknown expression op");
    }
    return "";
  }

  // Conversions between expression types (the interpreter's kCast semantics).
  static std::string Cast(DType from, DType to, const std::string& v) {
    if (from == to) return v;
    switch (to) {
      case DType::kF32:
        return ToF32(from, v);
      case DType::kF64:
        return ToF64(from, v);
      case DType::kI64:
        return from == DType::kBool ? StrCat("(ki64)", v) : Saturate(from, DType::kI64, v);
      default:  // bool
        return StrCat(v, " != 0");
    }
  }

  std::string prefix_;
  LeafFn leaf_;
  AuxFn aux_;
  Out* row_ = nullptr;
  Out* elem_ = nullptr;
  std::unordered_map<const ExprNode*, std::string> row_memo_, elem_memo_;
  std::unordered_map<const ExprNode*, int> level_;
  int next_ = 0;
};

bool UsesIndex(const Expr& e) { return e && e.Uses(ExprOp::kIndex); }
// Accumulator helpers shared by the skeletons.
struct StageCode {
  std::string type;  // C type of the accumulator
  std::string init;  // initial value
  bool is_float = false;
};
StageCode StageOf(const ReduceStage& st) {
  const DType t = st.value.type();
  StageCode c;
  c.type = ValueType(t);
  c.is_float = IsF(t);
  const bool f32 = t == DType::kF32;
  switch (st.kind) {
    case ReduceKind::kSum:
      c.init = c.is_float ? FloatLiteral(0, t) : "((ki64)0)";
      break;
    case ReduceKind::kMin:
      c.init = c.is_float ? (f32 ? "KINFF" : "KINF") : "9223372036854775807L";
      break;
    case ReduceKind::kMax:
    case ReduceKind::kArgMax:
      c.init = c.is_float ? (f32 ? "(-KINFF)" : "(-KINF)") : "(-9223372036854775807L - 1)";
      break;
  }
  return c;
}

// The C-style combine of value `v` (position `p`) into stage accumulator `acc` (and, for
// argmax, position `accp`; for float max/min, NaN flag `bad`), sequential form.
std::string CombineLine(const ReduceStage& st, const std::string& acc, const std::string& v,
                        const std::string& p) {
  const DType t = st.value.type();
  const bool fl = IsF(t);
  const char* better = t == DType::kF32 ? "kbetterf" : (t == DType::kF64 ? "kbetterd" : "kbetteri");
  switch (st.kind) {
    case ReduceKind::kSum:
      return fl ? StrCat(acc, " += ", v, ";") : StrCat(acc, "u += (ku64)", v, ";");
    case ReduceKind::kMax:
      return fl ? StrCat(acc, "bad |= ", v, " != ", v, "; ", acc, " = ", acc, " < ", v, " ? ", v,
                         " : ", acc, ";")
                : StrCat(acc, " = ", acc, " < ", v, " ? ", v, " : ", acc, ";");
    case ReduceKind::kMin:
      return fl ? StrCat(acc, "bad |= ", v, " != ", v, "; ", acc, " = ", v, " < ", acc, " ? ", v,
                         " : ", acc, ";")
                : StrCat(acc, " = ", v, " < ", acc, " ? ", v, " : ", acc, ";");
    case ReduceKind::kArgMax:
      return StrCat("if (", better, "(", v, ", ", p, ", ", acc, ", ", acc, "p)) { ", acc, " = ", v,
                    "; ", acc, "p = ", p, "; }");
  }
  return "";
}

// Declarations of a stage accumulator (before its loop).
void DeclareAcc(Out& o, const ReduceStage& st, const std::string& acc) {
  const StageCode c = StageOf(st);
  const bool fl = c.is_float;
  if (st.kind == ReduceKind::kSum && !fl) {
    o.Line(StrCat("ku64 ", acc, "u = 0;"));
    return;
  }
  o.Line(StrCat(c.type, " ", acc, " = ", c.init, ";"));
  if ((st.kind == ReduceKind::kMax || st.kind == ReduceKind::kMin) && fl) {
    o.Line(StrCat("int ", acc, "bad = 0;"));
  }
  if (st.kind == ReduceKind::kArgMax) o.Line(StrCat("ki64 ", acc, "p = 9223372036854775807L;"));
}

// After the loop: the stage's result as `const T accS = ...;` (argmax: the position).
void FinishAcc(Out& o, const ReduceStage& st, const std::string& acc, int s) {
  const DType t = st.value.type();
  const bool fl = IsF(t);
  switch (st.kind) {
    case ReduceKind::kSum:
      if (fl) {
        o.Line(StrCat("const ", ValueType(t), " acc", s, " = ", acc, ";"));
      } else {
        o.Line(StrCat("const ki64 acc", s, " = (ki64)", acc, "u;"));
      }
      return;
    case ReduceKind::kMax:
    case ReduceKind::kMin:
      if (fl) {
        o.Line(StrCat("const ", ValueType(t), " acc", s, " = ", acc, "bad ? ",
                      t == DType::kF32 ? "KNANF" : "KNAN", " : ", acc, ";"));
      } else {
        o.Line(StrCat("const ki64 acc", s, " = ", acc, ";"));
      }
      return;
    case ReduceKind::kArgMax:
      o.Line(
          StrCat("const ki64 acc", s, " = ", acc, "p == 9223372036854775807L ? 0 : ", acc, "p;"));
      return;
  }
}

// The `omp simd` clause that lets a stage loop vectorize without -ffast-math.
std::string SimdPragma(const ReduceStage& st, const std::string& acc) {
  const bool fl = IsF(st.value.type());
  switch (st.kind) {
    case ReduceKind::kSum:
      return fl ? StrCat("#pragma omp simd reduction(+:", acc, ")")
                : StrCat("#pragma omp simd reduction(+:", acc, "u)");
    case ReduceKind::kMax:
      return fl ? StrCat("#pragma omp simd reduction(max:", acc, ") reduction(|:", acc, "bad)")
                : StrCat("#pragma omp simd reduction(max:", acc, ")");
    case ReduceKind::kMin:
      return fl ? StrCat("#pragma omp simd reduction(min:", acc, ") reduction(|:", acc, "bad)")
                : StrCat("#pragma omp simd reduction(min:", acc, ")");
    case ReduceKind::kArgMax:
      return "";  // first-index semantics: sequential
  }
  return "";
}

std::string ArgPtrDecl(const KernelSpec& s, int i, bool device) {
  const KernelArg& a = s.args[i];
  if (device) return StrCat("GLOBAL const ", ElemType(a.dtype), "* p", i);
  return StrCat("const ", ElemType(a.dtype), "* const p", i, " = (const ", ElemType(a.dtype),
                "*)a.inputs[", i, "].data;");
}

// ---- Reductions: one printer, a skeleton per kind of target ------------------------------------
//
// PrintReduce prints every reduce kernel: the row's kept indices and base offsets, the leaves,
// each stage (accumulator, loop over the reduced elements, combine) and the output (per element
// or once per row). What differs between the C++ and the device forms — how rows map to
// threads, where shapes and strides come from, how the reduced elements are looped over and
// addressed, and how per-thread partials become one value — is the skeleton's.

struct ReduceAxes {
  std::vector<bool> reduced;   // per iteration axis
  std::vector<int> kept, red;  // iteration axes kept / reduced, in order
  explicit ReduceAxes(const KernelSpec& s) : reduced(s.rank, false) {
    for (int ax : s.reduce_axes) reduced[ax] = true;
    for (int d = 0; d < s.rank; ++d) (reduced[d] ? red : kept).push_back(d);
  }
};

class ReduceSkeleton {
 public:
  explicit ReduceSkeleton(const KernelSpec& s) : s_(s), ax_(s) {}
  virtual ~ReduceSkeleton() = default;
  const KernelSpec& spec() const { return s_; }
  const ReduceAxes& axes() const { return ax_; }

  // The kernel's opening: signature, pointers, `rows` and `cnt` (products of Shape()), the
  // split of rows over threads; ends inside the loop over this thread's rows (index `r`).
  virtual void Open(Out& k, const std::string& name, const std::string& rows,
                    const std::string& cnt) = 0;
  // The iteration space's size along axis d; tensor t's (-1: the output) base element offset
  // and its stride along its own axis d.
  virtual std::string Shape(int d) const = 0;
  virtual std::string Base(int t) const = 0;
  virtual std::string Stride(int t, int d) const = 0;
  virtual ExprPrinter::AuxFn Aux() const = 0;
  // Prints a loop over the row's reduced elements into `dst`; `body` prints one element into
  // the block it is given, once per addressing variant of the loop (see ElementOffset).
  virtual void Loop(Out& dst, const std::function<void(Out&)>& body, const std::string& pragma) = 0;
  // In the loop variant being printed: the element offset of full arg t (-1: the output), the
  // index along reduced axis d, and the position within the reduced elements.
  virtual std::string ElementOffset(int t) const = 0;
  virtual std::string ReducedIndex(int d) const = 0;
  virtual std::string Position() const = 0;
  // After stage `st`'s loop over accumulator a<st>: `const T acc<st> = ...;` for the row.
  virtual void Finish(Out& row, const ReduceStage& stage, int st) = 0;
  // The row's one store (outputs with the reduced axes removed); `store` prints it.
  virtual void StoreRow(Out& row, const std::function<void(Out&)>& store) = 0;
  virtual std::string StagePragma(const ReduceStage&, const std::string&) const { return ""; }
  virtual std::string OutputPragma() const { return ""; }
  // The stride of a tensor with the output's shape (-1: the output; or a kOut arg) along kept
  // iteration axis d: outputs without the reduced axes number their axes by the kept ones.
  std::string OutStride(int t, int d) const {
    if (s_.elementwise || s_.keepdim) return Stride(t, d);
    return Stride(
        t, static_cast<int>(std::find(ax_.kept.begin(), ax_.kept.end(), d) - ax_.kept.begin()));
  }

 protected:
  // `const ki64 f<i> = ...` for the full args (and `fo` for an elementwise output) at the
  // reduced element whose indices ReducedIndex() names.
  void ElementOffsets(Out& b) const {
    auto line = [&](const std::string& var, const std::string& base, int t) {
      std::string f = StrCat("const ki64 ", var, " = ", base);
      for (int d : ax_.red) absl::StrAppend(&f, " + ", ReducedIndex(d), " * ", Stride(t, d));
      b.Line(f + ";");
    };
    for (size_t i = 0; i < s_.args.size(); ++i) {
      if (s_.args[i].role == ArgRole::kFull) line(StrCat("f", i), StrCat("b", i), i);
    }
    if (s_.elementwise) line("fo", "ob", -1);
  }

  const KernelSpec& s_;
  const ReduceAxes ax_;
};

std::string PrintReduce(ReduceSkeleton& sk, const std::string& name) {
  const KernelSpec& s = sk.spec();
  const ReduceAxes& ax = sk.axes();
  Out k;
  k.Line(StrCat("// ", s.name, " (reduce over [", absl::StrJoin(s.reduce_axes, ","), "])"));
  std::string rows = "1", cnt = "1";
  for (int d : ax.kept) absl::StrAppend(&rows, " * ", sk.Shape(d));
  for (int d : ax.red) absl::StrAppend(&cnt, " * ", sk.Shape(d));
  sk.Open(k, name, rows, cnt);
  // Kept indices of row r, last kept axis fastest; the row's base offsets.
  if (!ax.kept.empty()) k.Line("ki64 t = r;");
  for (int q = static_cast<int>(ax.kept.size()) - 1; q >= 0; --q) {
    const int d = ax.kept[q];
    k.Line(StrCat("const ki64 k", d, " = t % ", sk.Shape(d), ";"));
    if (q > 0) k.Line(StrCat("t /= ", sk.Shape(d), ";"));
  }
  auto base = [&](const std::string& var, int t, bool out_space) {
    std::string v = StrCat("const ki64 ", var, " = ", sk.Base(t));
    for (int d : ax.kept) {
      absl::StrAppend(&v, " + k", d, " * ", out_space ? sk.OutStride(t, d) : sk.Stride(t, d));
    }
    k.Line(v + ";");
  };
  base("ob", -1, !s.elementwise);
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) base(StrCat("b", i), i, false);
    if (s.args[i].role == ArgRole::kOut) base(StrCat("b", i), i, true);
  }
  bool in_output = false;
  auto leaf = [&](const ExprNode& n) -> Leaf {
    switch (n.op) {
      case ExprOp::kInput: {
        const KernelArg& arg = s.args[n.index];
        if (arg.role == ArgRole::kOut) {
          return {LoadConv(arg.dtype, StrCat("p", n.index, "[b", n.index, "]")), kRowLevel};
        }
        return {LoadConv(arg.dtype, StrCat("p", n.index, "[", sk.ElementOffset(n.index), "]")),
                kElemLevel};
      }
      case ExprOp::kIndex: {
        if (n.index == kPosAxis) return {sk.Position(), kElemLevel};
        if (in_output && !s.elementwise) {  // the output's own axes
          if (s.keepdim) {
            return ax.reduced[n.index] ? Leaf{"((ki64)0)", kConstLevel}
                                       : Leaf{StrCat("k", n.index), kRowLevel};
          }
          return {StrCat("k", ax.kept[n.index]), kRowLevel};
        }
        if (!ax.reduced[n.index]) return {StrCat("k", n.index), kRowLevel};
        return {sk.ReducedIndex(n.index), kElemLevel};
      }
      case ExprOp::kAcc:
        return {StrCat("acc", n.index), kRowLevel};
      case ExprOp::kCount:
        return {"cnt", kRowLevel};
      default:
        return {"0", kRowLevel};
    }
  };
  ExprPrinter pr("t", leaf, sk.Aux());
  Out row(k.indent);
  pr.SetRowBlock(&row);
  for (size_t st = 0; st < s.stages.size(); ++st) {
    const ReduceStage& stage = s.stages[st];
    const std::string acc = StrCat("a", st);
    Out loop(row.indent);
    sk.Loop(
        loop,
        [&](Out& body) {
          pr.SetElemBlock(&body);
          const std::string v = pr.Print(stage.value);
          body.Line(CombineLine(stage, acc, v, sk.Position()));
        },
        sk.StagePragma(stage, acc));
    DeclareAcc(row, stage, acc);
    row.Append(loop);
    sk.Finish(row, stage, static_cast<int>(st));
  }
  in_output = true;
  if (s.elementwise) {
    Out loop(row.indent);
    sk.Loop(
        loop,
        [&](Out& body) {
          pr.SetElemBlock(&body);
          const std::string v = pr.Print(s.output);
          body.Line(StrCat("po[", sk.ElementOffset(-1),
                           "] = ", StoreConv(s.output.type(), s.out_dtype, v), ";"));
        },
        sk.OutputPragma());
    row.Append(loop);
  } else {
    pr.ResetLevels();
    sk.StoreRow(row, [&](Out& store) {
      pr.SetRowBlock(&store);
      pr.SetElemBlock(&store);
      const std::string v = pr.Print(s.output);
      store.Line(StrCat("po[ob] = ", StoreConv(s.output.type(), s.out_dtype, v), ";"));
    });
  }
  k.Append(row);
  k.Close();
  k.Close();
  return k.text;
}

// ---- C++ skeletons ------------------------------------------------------------------------------

constexpr int64_t kPointwiseGrain = 4096;  // elements per thread before splitting
constexpr int64_t kReduceGrain = 4096;     // elements (rows x reduced) per thread

// Common C++ kernel opening: pointers.
void CppPointers(const KernelSpec& s, Out& k) {
  k.Line(
      StrCat(ElemType(s.out_dtype), "* const po = (", ElemType(s.out_dtype), "*)a.output.data;"));
  int aux = 0;
  for (size_t i = 0; i < s.args.size(); ++i) {
    const KernelArg& arg = s.args[i];
    if (arg.role == ArgRole::kGemmOperand) continue;
    if (arg.role == ArgRole::kAux) {
      k.Line(StrCat("const ", ElemType(arg.dtype), "* const x", aux, " = (const ",
                    ElemType(arg.dtype), "*)a.inputs[", i, "].data;"));
      k.Line(StrCat("const ki64 xl", aux, " = a.inputs[", i, "].shape[0], xs", aux, " = a.inputs[",
                    i, "].strides[0];"));
      ++aux;
      continue;
    }
    k.Line(ArgPtrDecl(s, static_cast<int>(i), false));
  }
}

ExprPrinter::AuxFn CppAux(const KernelSpec& s) {
  return [&s](int k, const std::string& i) {
    return ExprPrinter::AuxRef{StrCat("x", k, "[", i, " * xs", k, "]"), StrCat("xl", k),
                               s.args[s.AuxArg(k)].dtype};
  };
}

// Element addressing inside a C++ loop: `o<i>` is arg i's offset at the start of the
// segment; the loop variable is `i` (flat) or `j` (segment).
enum class Addr { kScalar, kFlat, kUnit, kStrided };
std::string Offset(Addr m, const std::string& base, const std::string& stride) {
  switch (m) {
    case Addr::kScalar:
      return base;
    case Addr::kFlat:
      return StrCat(base, " + i");
    case Addr::kUnit:
      return StrCat(base, " + j");
    case Addr::kStrided:
      return StrCat(base, " + j * ", stride);
  }
  return base;
}

std::string CppPointwise(const KernelSpec& s, const std::string& name) {
  const int R = s.rank;
  Out k;
  k.Line(StrCat("// ", s.name, ": ", s.value.ToString().substr(0, 200)));
  k.Open(StrCat("KERNEL void ", name, "(const KLaunchArgs& a, const KExecCtx& c) {"));
  CppPointers(s, k);
  std::vector<int> full;
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) full.push_back(static_cast<int>(i));
  }
  Addr mode = Addr::kScalar;
  auto leaf = [&](const ExprNode& n) -> Leaf {
    if (n.op == ExprOp::kInput) {
      const std::string off = Offset(mode, StrCat("o", n.index), StrCat("s", n.index));
      return {LoadConv(s.args[n.index].dtype, StrCat("p", n.index, "[", off, "]")), kElemLevel};
    }
    if (n.op == ExprOp::kIndex) {
      if (n.index == R - 1) return {"(col + j)", kElemLevel};
      return {StrCat("idx[", n.index, "]"), kRowLevel};
    }
    return {"0", kElemLevel};
  };
  ExprPrinter pr("t", leaf, CppAux(s));
  // One loop: `header` opens it; the body stores at the output offset for `m`.
  auto loop = [&](Out& dst, Addr m, const std::string& header, const char* pragma) {
    Out body(dst.indent + "  ");
    mode = m;
    pr.SetElemBlock(&body);
    const std::string v = pr.Print(s.value);
    body.Line(StrCat("po[", Offset(m, "oo", "so"),
                     "] = ", StoreConv(s.value.type(), s.out_dtype, v), ";"));
    if (pragma != nullptr) dst.Line(pragma);
    dst.Open(header);
    dst.Append(body);
    dst.Close();
  };
  if (R == 0) {
    k.Line("if (c.thread_index != 0) return;");
    k.Line("const ki64 oo = 0;");
    for (int i : full) k.Line(StrCat("const ki64 o", i, " = 0;"));
    Out body(k.indent);
    mode = Addr::kScalar;
    pr.SetElemBlock(&body);
    const std::string v = pr.Print(s.value);
    k.Append(body);
    k.Line(StrCat("po[oo] = ", StoreConv(s.value.type(), s.out_dtype, v), ";"));
    k.Close();
    return k.text;
  }
  k.Line("ki64 n = 1;");
  k.Line(StrCat("for (int d = 0; d < ", R, "; ++d) n *= a.output.shape[d];"));
  k.Line("ki64 b, e;");
  k.Line(StrCat("kshare(n, ", kPointwiseGrain, ", 16, c, &b, &e);"));
  k.Line("if (b >= e) return;");
  if (!UsesIndex(s.value)) {
    // Every tensor dense with the output's shape: one flat loop.
    std::string cond = StrCat("kdense(a.output, a.output.shape, ", R, ")");
    for (int i : full)
      absl::StrAppend(&cond, " && kdense(a.inputs[", i, "], a.output.shape, ", R, ")");
    k.Open(StrCat("if (", cond, ") {"));
    k.Line("const ki64 oo = 0;");
    for (int i : full) k.Line(StrCat("const ki64 o", i, " = 0;"));
    Out pre(k.indent), lp(k.indent);
    pr.SetRowBlock(&pre);
    loop(lp, Addr::kFlat, "for (ki64 i = b; i < e; ++i) {", "#pragma omp simd");
    k.Append(pre);
    k.Append(lp);
    k.Line("return;");
    k.Close();
  }
  // General: segments of rows along the last axis, unit-stride or strided inner loops.
  k.Line(StrCat("ki64 idx[", R, "];"));
  k.Line(StrCat("kunravel(b, a.output.shape, ", R, ", idx);"));
  k.Line(StrCat("const ki64 inner = a.output.shape[", R - 1, "];"));
  k.Line(StrCat("const ki64 so = a.output.strides[", R - 1, "];"));
  std::string unit = "so == 1";
  for (int i : full) {
    k.Line(StrCat("const ki64 s", i, " = a.inputs[", i, "].strides[", R - 1, "];"));
    absl::StrAppend(&unit, " && s", i, " == 1");
  }
  k.Open("for (ki64 pos = b; pos < e;) {");
  k.Line(StrCat("const ki64 col = idx[", R - 1, "];"));
  k.Line("const ki64 len = inner - col < e - pos ? inner - col : e - pos;");
  std::string offs = "ki64 oo = 0";
  for (int i : full) absl::StrAppend(&offs, ", o", i, " = 0");
  k.Line(offs + ";");
  std::string acc_offs = "oo += idx[d] * a.output.strides[d];";
  for (int i : full)
    absl::StrAppend(&acc_offs, " o", i, " += idx[d] * a.inputs[", i, "].strides[d];");
  k.Line(StrCat("for (int d = 0; d < ", R, "; ++d) { ", acc_offs, " }"));
  Out pre(k.indent), branches(k.indent);
  pr.SetRowBlock(&pre);
  branches.Open(StrCat("if (", unit, ") {"));
  loop(branches, Addr::kUnit, "for (ki64 j = 0; j < len; ++j) {", "#pragma omp simd");
  branches.Close("} else {");
  branches.indent += "  ";
  loop(branches, Addr::kStrided, "for (ki64 j = 0; j < len; ++j) {", "#pragma GCC ivdep");
  branches.Close();
  k.Append(pre);
  k.Append(branches);
  k.Line("pos += len;");
  k.Line(StrCat("idx[", R - 1, "] += len;"));
  k.Line(StrCat("for (int d = ", R - 1,
                "; d > 0 && idx[d] >= a.output.shape[d]; --d) { idx[d] = 0; ++idx[d - 1]; }"));
  k.Close();
  k.Close();
  return k.text;
}

// Reduce kernels (C++): rows of kept indices split over threads; per row, each stage is a
// loop over the reduced elements. One reduced axis: unit-stride and strided loop variants
// (the first vectorizes); several: an odometer over them.
class CppReduceSkeleton final : public ReduceSkeleton {
 public:
  explicit CppReduceSkeleton(const KernelSpec& s)
      : ReduceSkeleton(s), single_(ax_.red.size() == 1) {}

  void Open(Out& k, const std::string& name, const std::string& rows,
            const std::string& cnt) override {
    k.Open(StrCat("KERNEL void ", name, "(const KLaunchArgs& a, const KExecCtx& c) {"));
    CppPointers(s_, k);
    k.Line(StrCat(
        "const ki64* const sh = ",
        s_.shape_arg >= 0 ? StrCat("a.inputs[", s_.shape_arg, "].shape") : "a.output.shape", ";"));
    k.Line(StrCat("const ki64 rows = ", rows, ";"));
    k.Line(StrCat("const ki64 cnt = ", cnt, ";"));
    k.Line("ki64 b, e;");
    k.Line(StrCat("kshare(rows, cnt > 0 && cnt < ", kReduceGrain, " ? ", kReduceGrain,
                  " / cnt : 1, 1, c, &b, &e);"));
    k.Line("if (b >= e) return;");
    unit_ = s_.elementwise ? "ro == 1" : "true";
    if (single_) {
      const int r0 = ax_.red[0];
      if (s_.elementwise) k.Line(StrCat("const ki64 ro = a.output.strides[", r0, "];"));
      for (size_t i = 0; i < s_.args.size(); ++i) {
        if (s_.args[i].role != ArgRole::kFull) continue;
        k.Line(StrCat("const ki64 r", i, " = a.inputs[", i, "].strides[", r0, "];"));
        absl::StrAppend(&unit_, " && r", i, " == 1");
      }
    }
    k.Open("for (ki64 r = b; r < e; ++r) {");
  }
  std::string Shape(int d) const override { return StrCat("sh[", d, "]"); }
  std::string Base(int) const override { return "0"; }
  std::string Stride(int t, int d) const override {
    return t < 0 ? StrCat("a.output.strides[", d, "]")
                 : StrCat("a.inputs[", t, "].strides[", d, "]");
  }
  ExprPrinter::AuxFn Aux() const override { return CppAux(s_); }

  void Loop(Out& dst, const std::function<void(Out&)>& body, const std::string& pragma) override {
    if (single_) {
      Out unit(dst.indent + "    "), strided(dst.indent + "    ");
      mode_ = Mode::kUnit;
      body(unit);
      mode_ = Mode::kStrided;
      body(strided);
      dst.Open(StrCat("if (", unit_, ") {"));
      if (!pragma.empty()) dst.Line(pragma);
      dst.Open("for (ki64 j = 0; j < cnt; ++j) {");
      dst.Append(unit);
      dst.Close();
      dst.Close("} else {");
      dst.indent += "  ";
      dst.Open("for (ki64 j = 0; j < cnt; ++j) {");
      dst.Append(strided);
      dst.Close();
      dst.Close();
      return;
    }
    // Several reduced axes: an odometer over them. Offsets precede the element's lines.
    mode_ = Mode::kGeneral;
    Out b(dst.indent + "  ");
    ElementOffsets(b);
    Out element(b.indent);
    body(element);
    b.Append(element);
    const std::vector<int>& red = ax_.red;
    dst.Line(StrCat("ki64 ridx[", red.size(), "] = {0};"));
    dst.Line(StrCat("const int kra[", red.size(), "] = {", absl::StrJoin(red, ", "), "};"));
    dst.Open("for (ki64 p = 0; p < cnt; ++p) {");
    dst.Append(b);
    dst.Line(StrCat("for (int q = ", red.size() - 1,
                    "; q >= 0; --q) { if (++ridx[q] < sh[kra[q]]) break; ridx[q] = 0; }"));
    dst.Close();
  }
  std::string ElementOffset(int t) const override {
    const std::string b = t < 0 ? "ob" : StrCat("b", t);
    switch (mode_) {
      case Mode::kUnit:
        return StrCat(b, " + j");
      case Mode::kStrided:
        return StrCat(b, " + j * ", t < 0 ? "ro" : StrCat("r", t));
      case Mode::kGeneral:
        break;
    }
    return t < 0 ? "fo" : StrCat("f", t);
  }
  std::string ReducedIndex(int d) const override {
    if (single_) return "j";
    const auto q = std::find(ax_.red.begin(), ax_.red.end(), d) - ax_.red.begin();
    return StrCat("ridx[", q, "]");
  }
  std::string Position() const override { return single_ ? "j" : "p"; }
  void Finish(Out& row, const ReduceStage& stage, int st) override {
    FinishAcc(row, stage, StrCat("a", st), st);
  }
  void StoreRow(Out& row, const std::function<void(Out&)>& store) override { store(row); }
  std::string StagePragma(const ReduceStage& stage, const std::string& acc) const override {
    return SimdPragma(stage, acc);
  }
  std::string OutputPragma() const override { return "#pragma omp simd"; }

 private:
  enum class Mode { kUnit, kStrided, kGeneral };
  const bool single_;
  std::string unit_;  // the unit-stride condition (single reduced axis)
  Mode mode_ = Mode::kUnit;
};

// GEMM epilogues (C++): `<name>_inplace` rewrites output rows [r0, r1) that hold the GEMM's
// result; `<name>_acc` writes rows [r0, r1) x columns [c0, c1) from an accumulator tile.
std::string CppEpilogue(const KernelSpec& s, const std::string& name) {
  const int R = s.rank;
  const DType acc_t = s.out_dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  const int gemm_leaf = static_cast<int>(s.args.size());
  std::vector<int> full;
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) full.push_back(static_cast<int>(i));
  }
  Out k;
  k.Line(StrCat("// ", s.name, " (GEMM epilogue): ", s.value.ToString().substr(0, 200)));
  for (const bool from_acc : {false, true}) {
    std::string sig =
        StrCat("KERNEL void ", name, from_acc ? "_acc" : "_inplace", "(const KLaunchArgs& a, ");
    if (from_acc) absl::StrAppend(&sig, "const void* accp, ki64 ld, ");
    absl::StrAppend(&sig, "ki64 r0, ki64 r1", from_acc ? ", ki64 c0, ki64 c1) {" : ") {");
    k.Open(sig);
    CppPointers(s, k);
    if (from_acc) {
      k.Line(
          StrCat("const ", ValueType(acc_t), "* const acc = (const ", ValueType(acc_t), "*)accp;"));
    } else {
      k.Line(StrCat("const ki64 c0 = 0, c1 = a.output.shape[", R - 1, "];"));
    }
    Addr mode = Addr::kUnit;
    auto leaf = [&](const ExprNode& n) -> Leaf {
      if (n.op == ExprOp::kInput) {
        if (n.index == gemm_leaf) {
          if (from_acc) return {"acc[(r - r0) * ld + (j - c0)]", kElemLevel};
          return {LoadConv(s.out_dtype, StrCat("po[", Offset(mode, "oo", "so"), "]")), kElemLevel};
        }
        const std::string off = Offset(mode, StrCat("o", n.index), StrCat("s", n.index));
        return {LoadConv(s.args[n.index].dtype, StrCat("p", n.index, "[", off, "]")), kElemLevel};
      }
      if (n.op == ExprOp::kIndex) {
        if (n.index == R - 1) return {"j", kElemLevel};
        return {StrCat("idx[", n.index, "]"), kRowLevel};
      }
      return {"0", kElemLevel};
    };
    ExprPrinter pr("t", leaf, CppAux(s));
    k.Line(StrCat("const ki64 so = a.output.strides[", R - 1, "];"));
    std::string unit = "so == 1";
    for (int i : full) {
      k.Line(StrCat("const ki64 s", i, " = a.inputs[", i, "].strides[", R - 1, "];"));
      absl::StrAppend(&unit, " && s", i, " == 1");
    }
    k.Open("for (ki64 r = r0; r < r1; ++r) {");
    k.Line(StrCat("ki64 idx[", R, "] = {0};"));
    if (R > 1) k.Line(StrCat("kunravel(r, a.output.shape, ", R - 1, ", idx);"));
    std::string offs = "ki64 oo = 0";
    for (int i : full) absl::StrAppend(&offs, ", o", i, " = 0");
    k.Line(offs + ";");
    std::string acc_offs = "oo += idx[d] * a.output.strides[d];";
    for (int i : full) {
      absl::StrAppend(&acc_offs, " o", i, " += idx[d] * a.inputs[", i, "].strides[d];");
    }
    k.Line(StrCat("for (int d = 0; d < ", R - 1, "; ++d) { ", acc_offs, " }"));
    Out pre(k.indent), branches(k.indent);
    pr.SetRowBlock(&pre);
    for (const Addr m : {Addr::kUnit, Addr::kStrided}) {
      mode = m;
      Out body(branches.indent + "    ");
      pr.SetElemBlock(&body);
      const std::string v = pr.Print(s.value);
      body.Line(StrCat("po[", Offset(m, "oo", "so"),
                       "] = ", StoreConv(s.value.type(), s.out_dtype, v), ";"));
      if (m == Addr::kUnit) {
        branches.Open(StrCat("if (", unit, ") {"));
        branches.Line("#pragma omp simd");
      } else {
        branches.Close("} else {");
        branches.indent += "  ";
        branches.Line("#pragma GCC ivdep");
      }
      branches.Open("for (ki64 j = c0; j < c1; ++j) {");
      branches.Append(body);
      branches.Close();
    }
    branches.Close();
    k.Append(pre);
    k.Append(branches);
    k.Close();
    k.Close();
  }
  return k.text;
}

// ---- Device skeletons (OpenCL C, CUDA, HIP) ---------------------------------------------------

// Positions of the meta values: shape at 0; then output offset/strides; then per arg; then,
// for pointwise kernels, the `dense` flag.
struct MetaLayout {
  int out = 0;           // offset at out, strides at out + 1
  std::vector<int> arg;  // per arg: offset at arg[i], then strides (or len, stride)
  int dense = -1;        // pointwise: 1 if every tensor is row-major with the output's shape
  int size = 0;
};
MetaLayout LayoutOf(const KernelSpec& s) {
  MetaLayout m;
  int p = s.rank;
  m.out = p;
  p += 1 + s.out_rank;
  for (const KernelArg& a : s.args) {
    m.arg.push_back(p);
    p += 1 + (a.role == ArgRole::kAux ? 2 : a.rank);
  }
  if (s.kind == KernelKind::kPointwise) m.dense = p++;
  m.size = std::max(p, 1);
  return m;
}

std::string DeviceSignature(const KernelSpec& s, const std::string& name, const MetaLayout& m) {
  std::string sig = StrCat("typedef struct { ki64 v[", m.size, "]; } KMeta_", name, ";\n");
  absl::StrAppend(&sig, "KERNEL void ", name, "(GLOBAL ", ElemType(s.out_dtype), "* po");
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kAux) {
      absl::StrAppend(&sig, ", GLOBAL const ", ElemType(s.args[i].dtype), "* x", i);
    } else {
      absl::StrAppend(&sig, ", ", ArgPtrDecl(s, static_cast<int>(i), true));
    }
  }
  absl::StrAppend(&sig, ", const KMeta_", name, " m) {");
  return sig;
}

ExprPrinter::AuxFn DeviceAux(const KernelSpec& s, const MetaLayout& m) {
  return [&s, m](int k, const std::string& i) {
    const int arg = s.AuxArg(k);
    const int at = m.arg[arg];
    return ExprPrinter::AuxRef{StrCat("x", arg, "[m.v[", at, "] + ", i, " * m.v[", at + 2, "]]"),
                               StrCat("m.v[", at + 1, "]"), s.args[arg].dtype};
  };
}

// Pointwise kernels: a grid-stride loop over the output elements. When every tensor is
// row-major with the output's shape (the `dense` flag, set by the launcher), offsets are the
// flat index; otherwise each element's index is unravelled.
std::string DevicePointwise(const KernelSpec& s, const std::string& name) {
  const MetaLayout m = LayoutOf(s);
  const int R = s.rank;
  Out k;
  k.Line(StrCat("// ", s.name, ": ", s.value.ToString().substr(0, 200)));
  k.Open(DeviceSignature(s, name, m));
  std::string n = "const ki64 n = 1";
  for (int d = 0; d < R; ++d) absl::StrAppend(&n, " * m.v[", d, "]");
  k.Line(n + ";");
  auto leaf = [&](const ExprNode& nd) -> Leaf {
    if (nd.op == ExprOp::kInput) {
      return {LoadConv(s.args[nd.index].dtype, StrCat("p", nd.index, "[o", nd.index, "]")),
              kElemLevel};
    }
    if (nd.op == ExprOp::kIndex) return {StrCat("i", nd.index), kElemLevel};
    return {"0", kElemLevel};
  };
  ExprPrinter pr("t", leaf, DeviceAux(s, m));
  pr.SetRowBlock(nullptr);
  // Offsets of the output and the full args: with the flat index when `dense`, else from the
  // element's index (one loop and one body either way: PoCL compiles each kernel at its first
  // launch, and code size is compile time).
  std::vector<std::pair<std::string, int>> tensors = {{"oo", m.out}};
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) tensors.emplace_back(StrCat("o", i), m.arg[i]);
  }
  auto unravel = [&] {
    k.Line("ki64 t = i;");
    for (int d = R - 1; d >= 0; --d) {
      k.Line(StrCat("const ki64 i", d, " = ", d > 0 ? StrCat("t % m.v[", d, "]") : "t", ";"));
      if (d > 0) k.Line(StrCat("t /= m.v[", d, "];"));
    }
  };
  if (R > 0) k.Line(StrCat("const int dense = (int)m.v[", m.dense, "];"));
  k.Open("KNOVEC for (ki64 i = GLOBAL_ID; i < n; i += GLOBAL_SIZE) {");
  if (R == 0) {
    for (const auto& [var, at] : tensors) k.Line(StrCat("const ki64 ", var, " = m.v[", at, "];"));
  } else {
    const bool index = UsesIndex(s.value);
    if (index) unravel();
    std::vector<std::string> vars;
    for (const auto& [var, at] : tensors) vars.push_back(var);
    k.Line(StrCat("ki64 ", absl::StrJoin(vars, ", "), ";"));
    k.Open("if (dense) {");
    for (const auto& [var, at] : tensors) k.Line(StrCat(var, " = m.v[", at, "] + i;"));
    k.Close("} else {");
    k.indent += "  ";
    if (!index) unravel();
    for (const auto& [var, at] : tensors) {
      std::string v = StrCat(var, " = m.v[", at, "]");
      for (int d = 0; d < R; ++d) absl::StrAppend(&v, " + i", d, " * m.v[", at + 1 + d, "]");
      k.Line(v + ";");
    }
    k.Close();
  }
  Out body(k.indent);
  pr.SetElemBlock(&body);
  const std::string v = pr.Print(s.value);
  k.Append(body);
  k.Line(StrCat("po[oo] = ", StoreConv(s.value.type(), s.out_dtype, v), ";"));
  k.Close();
  k.Close();
  return k.text;
}

// Reduce kernels (devices): one work-group of `wg` work-items per output row (looping over
// rows by group id); work-item `lid` takes the reduced elements lid, lid + wg, ...; partials
// combine by a tree in local (shared) memory.
class DeviceReduceSkeleton final : public ReduceSkeleton {
 public:
  DeviceReduceSkeleton(const KernelSpec& s, int wg) : ReduceSkeleton(s), m_(LayoutOf(s)), wg_(wg) {}

  void Open(Out& k, const std::string& name, const std::string& rows,
            const std::string& cnt) override {
    k.Open(DeviceSignature(s_, name, m_));
    // Shared scratch for the tree reductions, per accumulator type.
    bool need_f = false, need_d = false, need_i = false, need_p = false;
    for (const ReduceStage& st : s_.stages) {
      const DType t = st.value.type();
      need_f |= t == DType::kF32;
      need_d |= t == DType::kF64;
      need_i |= t == DType::kI64;
      need_p |= st.kind == ReduceKind::kArgMax;
    }
    if (need_f) k.Line(StrCat("LOCAL float kredf[", wg_, "];"));
    if (need_d) k.Line(StrCat("LOCAL double kredd[", wg_, "];"));
    if (need_i) k.Line(StrCat("LOCAL ki64 kredi[", wg_, "];"));
    if (need_p) k.Line(StrCat("LOCAL ki64 kredp[", wg_, "];"));
    k.Line("const int lid = LOCAL_ID;");
    k.Line(StrCat("const ki64 rows = ", rows, ";"));
    k.Line(StrCat("const ki64 cnt = ", cnt, ";"));
    k.Open("for (ki64 r = GROUP_ID; r < rows; r += NUM_GROUPS) {");
  }
  std::string Shape(int d) const override { return StrCat("m.v[", d, "]"); }
  std::string Base(int t) const override { return StrCat("m.v[", At(t), "]"); }
  std::string Stride(int t, int d) const override { return StrCat("m.v[", At(t) + 1 + d, "]"); }
  ExprPrinter::AuxFn Aux() const override { return DeviceAux(s_, m_); }

  void Loop(Out& dst, const std::function<void(Out&)>& body, const std::string&) override {
    Out b(dst.indent + "  ");
    b.Line("ki64 u = p;");
    const std::vector<int>& red = ax_.red;
    for (int q = static_cast<int>(red.size()) - 1; q >= 0; --q) {
      const int d = red[q];
      b.Line(StrCat("const ki64 j", d, " = ", q > 0 ? StrCat("u % ", Shape(d)) : "u", ";"));
      if (q > 0) b.Line(StrCat("u /= ", Shape(d), ";"));
    }
    ElementOffsets(b);
    Out element(b.indent);
    body(element);
    b.Append(element);
    dst.Open(StrCat("KNOVEC for (ki64 p = lid; p < cnt; p += ", wg_, ") {"));
    dst.Append(b);
    dst.Close();
  }
  std::string ElementOffset(int t) const override { return t < 0 ? "fo" : StrCat("f", t); }
  std::string ReducedIndex(int d) const override { return StrCat("j", d); }
  std::string Position() const override { return "p"; }

  // Per-work-item partials -> one value, by a tree in shared memory.
  void Finish(Out& row, const ReduceStage& stage, int st) override {
    const DType t = stage.value.type();
    const std::string acc = StrCat("a", st);
    const char* buf = t == DType::kF32 ? "kredf" : (t == DType::kF64 ? "kredd" : "kredi");
    const bool fl = IsF(t);
    switch (stage.kind) {
      case ReduceKind::kSum:
        row.Line(StrCat(buf, "[lid] = ", fl ? acc : StrCat("(ki64)", acc, "u"), ";"));
        break;
      case ReduceKind::kMax:
      case ReduceKind::kMin:
        if (fl) {
          row.Line(StrCat(buf, "[lid] = ", acc, "bad ? ", t == DType::kF32 ? "KNANF" : "KNAN",
                          " : ", acc, ";"));
        } else {
          row.Line(StrCat(buf, "[lid] = ", acc, ";"));
        }
        break;
      case ReduceKind::kArgMax:
        row.Line(StrCat(buf, "[lid] = ", acc, "; kredp[lid] = ", acc, "p;"));
        break;
    }
    row.Line("BARRIER();");
    row.Open(StrCat("for (int w = ", wg_ / 2, "; w > 0; w >>= 1) {"));
    std::string comb;
    const char* sfx = t == DType::kF32 ? "f" : "d";
    const std::string a = StrCat(buf, "[lid]"), b = StrCat(buf, "[lid + w]");
    switch (stage.kind) {
      case ReduceKind::kSum:
        comb = fl ? StrCat(a, " += ", b, ";") : StrCat(a, " = kiadd(", a, ", ", b, ");");
        break;
      case ReduceKind::kMax:
        comb = StrCat(a, " = ", fl ? StrCat("kmax", sfx) : "kimax", "(", a, ", ", b, ");");
        break;
      case ReduceKind::kMin:
        comb = StrCat(a, " = ", fl ? StrCat("kmin", sfx) : "kimin", "(", a, ", ", b, ");");
        break;
      case ReduceKind::kArgMax:
        comb =
            StrCat("if (", fl ? StrCat("kbetter", sfx) : "kbetteri", "(", b, ", kredp[lid + w], ",
                   a, ", kredp[lid])) { ", a, " = ", b, "; kredp[lid] = kredp[lid + w]; }");
        break;
    }
    row.Line(StrCat("if (lid < w) { ", comb, " }"));
    row.Line("BARRIER();");
    row.Close();
    if (stage.kind == ReduceKind::kArgMax) {
      row.Line(StrCat("const ki64 acc", st, " = kredp[0] == 9223372036854775807L ? 0 : kredp[0];"));
    } else {
      row.Line(StrCat("const ", ValueType(t), " acc", st, " = ", buf, "[0];"));
    }
    row.Line("BARRIER();");
  }
  void StoreRow(Out& row, const std::function<void(Out&)>& store) override {
    Out s(row.indent + "  ");
    store(s);
    row.Open("if (lid == 0) {");
    row.Append(s);
    row.Close();
  }

 private:
  int At(int t) const { return t < 0 ? m_.out : m_.arg[t]; }
  const MetaLayout m_;
  const int wg_;
};

// Device reduce kernels iterate in a canonical order — the kept axes, then the reduced ones —
// with outputs that drop the reduced axes: one kernel serves every reduction with as many kept
// and reduced axes (a sum over axis 1 or 2 of a rank-3 tensor, keepdim or not); DeviceLaunch
// permutes shapes and strides to match. `perm[i]` is the spec's axis of canonical axis i.
KernelSpec CanonicalDeviceReduce(const KernelSpec& s, std::vector<int>* perm) {
  const ReduceAxes ax(s);
  std::vector<int> order = ax.kept;
  order.insert(order.end(), ax.red.begin(), ax.red.end());
  std::vector<int> slot(s.rank);
  for (int i = 0; i < s.rank; ++i) slot[order[i]] = i;
  const int nk = static_cast<int>(ax.kept.size());
  auto iteration = [&](const Expr& e) {
    return MapLeaves(e, [&](const Expr& leaf) {
      const ExprNode& n = leaf.node();
      if (n.op != ExprOp::kIndex || n.index == kPosAxis) return leaf;
      return Expr::Index(slot[n.index]);
    });
  };
  KernelSpec c = s;
  c.reduce_axes.clear();
  for (int i = nk; i < s.rank; ++i) c.reduce_axes.push_back(i);
  for (ReduceStage& st : c.stages) st.value = iteration(st.value);
  if (s.elementwise) {
    c.output = iteration(s.output);
  } else {
    c.keepdim = false;
    c.out_rank = nk;
    // Output axes: without keepdim they are the kept axes in order already; with it, kept
    // axis d becomes output axis slot[d] and reduced ones are 0.
    if (s.keepdim) {
      c.output = MapLeaves(s.output, [&](const Expr& leaf) {
        const ExprNode& n = leaf.node();
        if (n.op != ExprOp::kIndex) return leaf;
        return ax.reduced[n.index] ? Expr::Int(0) : Expr::Index(slot[n.index]);
      });
    }
    for (KernelArg& a : c.args) {
      if (a.role == ArgRole::kOut) a.rank = nk;
    }
  }
  if (perm != nullptr) *perm = order;
  return c;
}

std::string Generate(const KernelSpec& s, Dialect d, const std::string& name, int wg) {
  if (d == Dialect::kCpp) {
    switch (s.kind) {
      case KernelKind::kPointwise:
        return CppPointwise(s, name);
      case KernelKind::kReduce: {
        CppReduceSkeleton sk(s);
        return PrintReduce(sk, name);
      }
      case KernelKind::kGemmEpilogue:
        return CppEpilogue(s, name);
    }
  }
  if (s.kind == KernelKind::kPointwise) return DevicePointwise(s, name);
  const KernelSpec c = CanonicalDeviceReduce(s, nullptr);
  DeviceReduceSkeleton sk(c, wg);
  return PrintReduce(sk, name);
}

}  // namespace

const char* DialectName(Dialect d) {
  switch (d) {
    case Dialect::kCpp:
      return "c++";
    case Dialect::kOpenCL:
      return "opencl";
    case Dialect::kCuda:
      return "cuda";
    case Dialect::kHip:
      return "hip";
  }
  return "?";
}

const std::string& Preamble(Dialect dialect) {
  static const std::string* p[4] = {new std::string(BuildPreamble(Dialect::kCpp)),
                                    new std::string(BuildPreamble(Dialect::kOpenCL)),
                                    new std::string(BuildPreamble(Dialect::kCuda)),
                                    new std::string(BuildPreamble(Dialect::kHip))};
  return *p[static_cast<int>(dialect)];
}

StatusOr<GeneratedKernel> GenerateKernel(const KernelSpec& spec, Dialect dialect,
                                         const CodegenOptions& options) {
  KILN_RETURN_IF_ERROR(spec.Validate());
  const int wg = options.work_group_size;
  if (wg < 1 || wg > 1024 || (wg & (wg - 1)) != 0) {
    return InvalidArgument("work_group_size must be a power of two in [1, 1024]; got ", wg);
  }
  if (dialect != Dialect::kCpp && spec.kind == KernelKind::kGemmEpilogue) {
    return Unimplemented("GEMM epilogues have no ", DialectName(dialect), " form");
  }
  return NameKernel(dialect, Generate(spec, dialect, kKernelName, wg));
}

GeneratedKernel NameKernel(Dialect dialect, const std::string& text) {
  static const std::string* preamble_hash[4] = {
      new std::string(Sha256Hex(Preamble(Dialect::kCpp))),
      new std::string(Sha256Hex(Preamble(Dialect::kOpenCL))),
      new std::string(Sha256Hex(Preamble(Dialect::kCuda))),
      new std::string(Sha256Hex(Preamble(Dialect::kHip)))};
  GeneratedKernel g;
  g.dialect = dialect;
  g.key = Hasher()
              .Add(DialectName(dialect))
              .Add(*preamble_hash[static_cast<int>(dialect)])
              .Add(text)
              .Hex();
  g.entry = StrCat("kiln_", g.key.substr(0, 16));
  g.code = absl::StrReplaceAll(text, {{kKernelName, g.entry}});
  return g;
}

std::string ModuleSource(Dialect dialect, std::span<const GeneratedKernel> kernels) {
  std::string s = Preamble(dialect);
  std::vector<std::string_view> seen;
  for (const GeneratedKernel& k : kernels) {
    KILN_CHECK(k.dialect == dialect, "ModuleSource: kernels of another dialect");
    if (std::find(seen.begin(), seen.end(), k.entry) != seen.end()) continue;
    seen.push_back(k.entry);
    s += "\n";
    s += k.code;
  }
  return s;
}

StatusOr<std::string> GenerateExprFunction(const ExprFunction& f, Dialect dialect) {
  if (!f.value) return InvalidArgument("expression function '", f.name, "' has no expression");
  // Leaves must be the function's parameters.
  Status bad = OkStatus();
  std::unordered_map<const ExprNode*, bool> seen;
  std::function<void(const Expr&)> check = [&](const Expr& e) {
    const ExprNode& n = e.node();
    if (!bad.ok() || !seen.emplace(&n, true).second) return;
    switch (n.op) {
      case ExprOp::kInput:
        if (n.index < 0 || n.index >= static_cast<int>(f.inputs.size()) ||
            f.inputs[n.index] != n.type) {
          bad = InvalidArgument("reads Input(", n.index, ") as ", DTypeName(n.type), "; the ",
                                "function has ", f.inputs.size(), " inputs");
        }
        break;
      case ExprOp::kIndex:
        if (n.index < 0 || n.index >= f.num_indices) {
          bad = InvalidArgument("reads Index(", n.index, "); the function has ", f.num_indices);
        }
        break;
      case ExprOp::kLoad:
        if (n.index < 0 || n.index >= static_cast<int>(f.aux.size())) {
          bad = InvalidArgument("loads aux ", n.index, "; the function has ", f.aux.size());
        } else if (IsQuantized(f.aux[n.index]) || f.aux[n.index] == DType::kInvalid) {
          bad = Unimplemented("codegen does not read ", DTypeName(f.aux[n.index]), " tensors");
        }
        break;
      case ExprOp::kAcc:
      case ExprOp::kCount:
        bad = InvalidArgument("reduction leaves outside a reduction");
        break;
      default:
        break;
    }
    for (const Expr& a : n.args) check(a);
  };
  check(f.value);
  if (!bad.ok()) return Annotate(bad, StrCat("expression function '", f.name, "'"));
  (void)dialect;  // the dialects differ only in the preamble's macros
  std::string sig = StrCat("KFN ", ValueType(f.value.type()), " ", f.name, "(");
  std::vector<std::string> params;
  for (size_t i = 0; i < f.inputs.size(); ++i) {
    params.push_back(StrCat(ValueType(f.inputs[i]), " in", i));
  }
  for (int i = 0; i < f.num_indices; ++i) params.push_back(StrCat("ki64 idx", i));
  for (size_t k = 0; k < f.aux.size(); ++k) {
    params.push_back(StrCat("GLOBAL const ku8* x", k, ", ki64 xn", k, ", ki64 xs", k));
  }
  absl::StrAppend(&sig, absl::StrJoin(params, ", "), ") {");
  auto leaf = [](const ExprNode& n) -> Leaf {
    return {StrCat(n.op == ExprOp::kInput ? "in" : "idx", n.index), kElemLevel};
  };
  auto aux = [&f](int k, const std::string& i) {
    return ExprPrinter::AuxRef{
        StrCat("((GLOBAL const ", ElemType(f.aux[k]), "*)x", k, ")[", i, " * xs", k, "]"),
        StrCat("xn", k), f.aux[k]};
  };
  ExprPrinter pr("t", leaf, aux);
  Out out;
  out.Open(sig);
  Out body(out.indent);
  pr.SetRowBlock(nullptr);
  pr.SetElemBlock(&body);
  const std::string v = pr.Print(f.value);
  out.Append(body);
  out.Line(StrCat("return ", v, ";"));
  out.Close();
  return out.text;
}

namespace {
bool DenseWith(const TensorArg& t, const int64_t* shape, int rank) {
  int64_t s = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && t.strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}
}  // namespace

DeviceLaunch::DeviceLaunch(const KernelSpec& spec, const CodegenOptions& options)
    : kind_(spec.kind),
      rank_(spec.rank),
      shape_arg_(spec.kind == KernelKind::kReduce ? spec.shape_arg : -1),
      wg_(options.work_group_size) {
  // The layout is the printed kernel's: reduce kernels run in the canonical axis order.
  KernelSpec printed = spec;
  for (int d = 0; d < spec.rank; ++d) perm_.push_back(d);
  if (spec.kind == KernelKind::kReduce) printed = CanonicalDeviceReduce(spec, &perm_);
  const MetaLayout m = LayoutOf(printed);
  out_at_ = m.out;
  dense_at_ = m.dense;
  meta_size_ = m.size;
  for (int ax : spec.reduce_axes) reduced_ |= 1u << ax;
  // The axis of output-shaped tensors (the output, kOut args) behind each meta stride.
  if (spec.kind == KernelKind::kReduce && !spec.elementwise) {
    for (int d = 0, j = 0; d < spec.rank; ++d) {
      if (reduced_ >> d & 1u) continue;
      out_axes_.push_back(spec.keepdim ? d : j);
      ++j;
    }
  } else {
    out_axes_ = perm_;
  }
  for (size_t i = 0; i < spec.args.size(); ++i) {
    args_.push_back({spec.args[i].role, spec.args[i].rank, m.arg[i]});
  }
}

void DeviceLaunch::PackMeta(const LaunchArgs& args, std::span<const int64_t> offsets,
                            std::span<int64_t> meta) const {
  KILN_CHECK(meta.size() >= static_cast<size_t>(meta_size_), "PackMeta: meta too small");
  std::fill(meta.begin(), meta.begin() + meta_size_, 0);
  const TensorArg& shape = shape_arg_ >= 0 ? args.inputs[shape_arg_] : args.output;
  for (int d = 0; d < rank_; ++d) meta[d] = shape.shape[perm_[d]];
  auto off = [&](size_t i) { return i < offsets.size() ? offsets[i] : 0; };
  meta[out_at_] = off(0);
  auto out_strides = [&](const TensorArg& t, int at) {
    for (size_t j = 0; j < out_axes_.size(); ++j) meta[at + 1 + j] = t.strides[out_axes_[j]];
  };
  out_strides(args.output, out_at_);
  bool dense = dense_at_ >= 0 && DenseWith(args.output, shape.shape, rank_);
  for (size_t i = 0; i < args_.size(); ++i) {
    const TensorArg& t = args.inputs[i];
    const Arg& a = args_[i];
    meta[a.at] = off(i + 1);
    if (a.role == ArgRole::kAux) {
      meta[a.at + 1] = t.shape[0];
      meta[a.at + 2] = t.strides[0];
      continue;
    }
    if (a.role == ArgRole::kOut) {
      out_strides(t, a.at);
      continue;
    }
    for (int d = 0; d < a.rank; ++d) meta[a.at + 1 + d] = t.strides[perm_[d]];
    dense = dense && DenseWith(t, shape.shape, rank_);
  }
  if (dense_at_ >= 0) meta[dense_at_] = dense ? 1 : 0;
}

DeviceGeometry DeviceLaunch::Geometry(const LaunchArgs& args) const {
  DeviceGeometry g;
  g.local_size = wg_;
  int64_t items = 1;  // reduce: rows (one group each); pointwise: elements
  if (kind_ == KernelKind::kReduce) {
    const TensorArg& src = shape_arg_ >= 0 ? args.inputs[shape_arg_] : args.output;
    for (int d = 0; d < rank_; ++d) {
      if (!(reduced_ >> d & 1u)) items *= src.shape[d];
    }
    g.global_size = std::clamp<int64_t>(items, 1, 65536) * wg_;
    return g;
  }
  items = args.output.numel();
  g.global_size = std::clamp<int64_t>((items + wg_ - 1) / wg_, 1, 65536) * wg_;
  return g;
}

}  // namespace kiln::compiler
