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
static_assert(sizeof(ExecCtx) == 16, "ExecCtx layout changed: update the C++ preamble");

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

constexpr const char* kOpenClHeader = R"(// Kiln generated kernels (OpenCL C).
#ifdef cl_khr_fp64
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
#define GLOBAL_ID ((ki64)get_global_id(0))
#define GLOBAL_SIZE ((ki64)get_global_size(0))
#define LOCAL_ID ((int)get_local_id(0))
#define GROUP_ID ((ki64)get_group_id(0))
#define NUM_GROUPS ((ki64)get_num_groups(0))
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
)";

constexpr const char* kCudaHeader = R"(// Kiln generated kernels (CUDA C).
typedef long long ki64;
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

constexpr const char* kHipHeader = R"(// Kiln generated kernels (HIP C).
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
typedef long long ki64;
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
// Float -> integer: truncate toward zero, saturate at [mn, mx], NaN -> 0.
KFN ki64 ksat(double v, double lo, double hip1, ki64 mn, ki64 mx) {
  if (v != v) return 0;
  const double t = KTRUNC(v);
  return t >= hip1 ? mx : (t <= lo ? mn : (ki64)t);
}
KFN double kmini_max(int eb, int mb, int bias, int special) {
  const int exp_all = (1 << eb) - 1;
  const double man_max = (double)((1 << mb) - 1), one = (double)(1 << mb);
  if (special == 0) return KLDEXP(1.0 + man_max / one, exp_all - 1 - bias);
  if (special == 1) return KLDEXP(1.0 + (man_max - 1.0) / one, exp_all - bias);
  return KLDEXP(1.0 + man_max / one, exp_all - bias);
}
// Any narrow float format from a double, round to nearest even (engine/dtype.cc EncodeMini):
// special 0 = IEEE (inf, NaN), 1 = finite with NaN (fp8 e4m3fn), 2 = finite only.
KFN ku32 kd2mini(double x, int eb, int mb, int bias, int special) {
  const ku32 sign = KD2L(x) < 0 ? (1u << (eb + mb)) : 0u;
  const ku32 exp_all = (1u << eb) - 1u, all_ones = (1u << (eb + mb)) - 1u;
  if (x != x) {
    if (special == 0) return sign | exp_all << mb | 1u << (mb - 1);
    return special == 1 ? (sign | all_ones) : 0u;
  }
  const ku32 ovf = special == 0 ? (sign | exp_all << mb) : (sign | all_ones);
  const double a = KFABS(x);
  if (a == KINF) return ovf;
  if (a == 0.0) return sign;
  int e = 0;
  KFREXP(a, &e);
  const int emin = 1 - bias;
  const int q = (e - 1 > emin ? e - 1 : emin) - mb;
  const double rounded = KLDEXP(KRINT(KLDEXP(a, -q)), q);
  if (rounded > kmini_max(eb, mb, bias, special)) return ovf;
  if (rounded == 0.0) return sign;
  KFREXP(rounded, &e);
  const int e2 = e - 1;
  if (e2 < emin) return sign | (ku32)KLDEXP(rounded, mb - emin);
  const ku32 man = (ku32)KLDEXP(rounded, mb - e2) - (1u << mb);
  return sign | (ku32)(e2 + bias) << mb | man;
}
#endif
)";

std::string BuildPreamble(Dialect d) {
  switch (d) {
    case Dialect::kCpp:
      return StrCat(kCppHeader, kCommon);
    case Dialect::kOpenCL:
      return StrCat(kOpenClHeader, kCommon);
    case Dialect::kCuda:
      return StrCat(kCudaHeader, kCudaMath, kCommon);
    case Dialect::kHip:
      return StrCat(kHipHeader, kCudaMath, kCommon);
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

// Stores value `v` (of expression type `vt`) into an element of dtype `t`: the text of the
// element value (StoreElement / StoreInt semantics).
std::string StoreConv(DType vt, DType t, const std::string& v) {
  const bool fl = IsF(vt);
  const std::string as_double =
      vt == DType::kF64
          ? v
          : (vt == DType::kBool ? StrCat("(", v, " ? 1.0 : 0.0)") : StrCat("(double)", v));
  const std::string as_float =
      vt == DType::kF32 ? v
      : vt == DType::kBool
          ? StrCat("(", v, " ? 1.0f : 0.0f)")
          : (vt == DType::kI64 ? StrCat("(float)(double)", v) : StrCat("(float)", v));
  switch (t) {
    case DType::kF32:
      return as_float;
    case DType::kF64:
      return as_double;
    case DType::kF16:
      return vt == DType::kF32 || vt == DType::kBool
                 ? StrCat("kf2h(", as_float, ")")
                 : StrCat("(ku16)kd2mini(", as_double, ", 5, 10, 15, 0)");
    case DType::kBF16:
      return vt == DType::kF32 || vt == DType::kBool
                 ? StrCat("kf2bf(", as_float, ")")
                 : StrCat("(ku16)kd2mini(", as_double, ", 8, 7, 127, 0)");
    case DType::kF8E4M3:
      return StrCat("(ku8)kd2mini(", as_double, ", 4, 3, 7, 1)");
    case DType::kF8E5M2:
      return StrCat("(ku8)kd2mini(", as_double, ", 5, 2, 15, 0)");
    case DType::kBool:
      return StrCat("(ku8)(", v, " != 0)");
    default:
      break;
  }
  // Integers: floats truncate and saturate; integers and bools wrap.
  if (fl) {
    const IntRange r = RangeOf(t);
    return StrCat("(", ElemType(t), ")ksat(", as_double, ", ", r.lo, ", ", r.hip1, ", ", r.mn, ", ",
                  r.mx, ")");
  }
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
        if (from == DType::kBool) return StrCat(v, " ? 1.0f : 0.0f");
        return from == DType::kI64 ? StrCat("(float)(double)", v) : StrCat("(float)", v);
      case DType::kF64:
        if (from == DType::kBool) return StrCat(v, " ? 1.0 : 0.0");
        return StrCat("(double)", v);
      case DType::kI64:
        if (from == DType::kBool) return StrCat("(ki64)", v);
        return StrCat("ksat((double)", v,
                      ", -9223372036854775808.0, 9223372036854775808.0, "
                      "(-9223372036854775807L - 1), 9223372036854775807L)");
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
// loop over the reduced elements, then the output.
std::string CppReduce(const KernelSpec& s, const std::string& name) {
  const int R = s.rank;
  std::vector<bool> reduced(R, false);
  for (int ax : s.reduce_axes) reduced[ax] = true;
  std::vector<int> kept, red;
  for (int d = 0; d < R; ++d) (reduced[d] ? red : kept).push_back(d);
  // Output axis of each kept axis (non-elementwise outputs).
  auto out_axis = [&](int ax) {
    if (s.elementwise || s.keepdim) return ax;
    int n = 0;
    for (int d : kept) {
      if (d == ax) return n;
      ++n;
    }
    return -1;
  };
  std::vector<int> full, outs;
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) full.push_back(static_cast<int>(i));
    if (s.args[i].role == ArgRole::kOut) outs.push_back(static_cast<int>(i));
  }
  Out k;
  k.Line(StrCat("// ", s.name, " (reduce over [", absl::StrJoin(s.reduce_axes, ","), "])"));
  k.Open(StrCat("KERNEL void ", name, "(const KLaunchArgs& a, const KExecCtx& c) {"));
  CppPointers(s, k);
  k.Line(StrCat("const ki64* const sh = ",
                s.shape_arg >= 0 ? StrCat("a.inputs[", s.shape_arg, "].shape") : "a.output.shape",
                ";"));
  std::string rows = "1", cnt = "1";
  for (int d : kept) absl::StrAppend(&rows, " * sh[", d, "]");
  for (int d : red) absl::StrAppend(&cnt, " * sh[", d, "]");
  k.Line(StrCat("const ki64 rows = ", rows, ";"));
  k.Line(StrCat("const ki64 cnt = ", cnt, ";"));
  k.Line("ki64 b, e;");
  k.Line(StrCat("kshare(rows, cnt > 0 && cnt < ", kReduceGrain, " ? ", kReduceGrain,
                " / cnt : 1, 1, c, &b, &e);"));
  k.Line("if (b >= e) return;");
  const bool single = red.size() == 1;
  if (single) {
    const int r0 = red[0];
    if (s.elementwise) k.Line(StrCat("const ki64 ro = a.output.strides[", r0, "];"));
    for (int i : full) k.Line(StrCat("const ki64 r", i, " = a.inputs[", i, "].strides[", r0, "];"));
  }
  std::string unit = s.elementwise ? "ro == 1" : "true";
  for (int i : full) absl::StrAppend(&unit, " && r", i, " == 1");
  k.Open("for (ki64 r = b; r < e; ++r) {");
  // Kept indices, last kept axis fastest.
  if (!kept.empty()) k.Line("ki64 t = r;");
  for (int q = static_cast<int>(kept.size()) - 1; q >= 0; --q) {
    const int d = kept[q];
    k.Line(StrCat("const ki64 k", d, " = t % sh[", d, "];"));
    if (q > 0) k.Line(StrCat("t /= sh[", d, "];"));
  }
  // Base offsets of the row.
  auto base = [&](const std::string& var, const std::string& strides, bool out_space) {
    std::string v = StrCat("const ki64 ", var, " = 0");
    for (int d : kept) {
      const int ax = out_space ? out_axis(d) : d;
      absl::StrAppend(&v, " + k", d, " * ", strides, "[", ax, "]");
    }
    k.Line(v + ";");
  };
  base("ob", "a.output.strides", !s.elementwise);
  for (int i : full) base(StrCat("b", i), StrCat("a.inputs[", i, "].strides"), false);
  for (int i : outs) base(StrCat("b", i), StrCat("a.inputs[", i, "].strides"), true);
  // Leaves. `mode` selects the element addressing of the current loop.
  enum class Mode { kUnit, kStrided, kGeneral } mode = Mode::kUnit;
  bool in_output = false;
  auto leaf = [&](const ExprNode& n) -> Leaf {
    switch (n.op) {
      case ExprOp::kInput: {
        const KernelArg& arg = s.args[n.index];
        if (arg.role == ArgRole::kOut) {
          return {LoadConv(arg.dtype, StrCat("p", n.index, "[b", n.index, "]")), kRowLevel};
        }
        std::string off;
        switch (mode) {
          case Mode::kUnit:
            off = StrCat("b", n.index, " + j");
            break;
          case Mode::kStrided:
            off = StrCat("b", n.index, " + j * r", n.index);
            break;
          case Mode::kGeneral:
            off = StrCat("f", n.index);
            break;
        }
        return {LoadConv(arg.dtype, StrCat("p", n.index, "[", off, "]")), kElemLevel};
      }
      case ExprOp::kIndex: {
        if (n.index == kPosAxis) return {single ? "j" : "p", kElemLevel};
        if (in_output && !s.elementwise) {
          // Output space.
          if (s.keepdim) {
            return reduced[n.index] ? Leaf{"((ki64)0)", kConstLevel}
                                    : Leaf{StrCat("k", n.index), kRowLevel};
          }
          return {StrCat("k", kept[n.index]), kRowLevel};
        }
        if (!reduced[n.index]) return {StrCat("k", n.index), kRowLevel};
        if (single) return {"j", kElemLevel};
        int q = 0;
        while (red[q] != n.index) ++q;
        return {StrCat("ridx[", q, "]"), kElemLevel};
      }
      case ExprOp::kAcc:
        return {StrCat("acc", n.index), kRowLevel};
      case ExprOp::kCount:
        return {"cnt", kRowLevel};
      default:
        return {"0", kRowLevel};
    }
  };
  ExprPrinter pr("t", leaf, CppAux(s));
  Out row(k.indent);
  pr.SetRowBlock(&row);
  // Emits a loop over the reduced elements computing `per_element(body)` lines.
  auto element_loop = [&](Out& dst, const std::function<void(Out&)>& per_element,
                          const std::string& pragma) {
    if (single) {
      Out b1(dst.indent + "    ");
      mode = Mode::kUnit;
      pr.SetElemBlock(&b1);
      per_element(b1);
      Out b2(dst.indent + "    ");
      mode = Mode::kStrided;
      pr.SetElemBlock(&b2);
      per_element(b2);
      dst.Open(StrCat("if (", unit, ") {"));
      if (!pragma.empty()) dst.Line(pragma);
      dst.Open("for (ki64 j = 0; j < cnt; ++j) {");
      dst.Append(b1);
      dst.Close();
      dst.Close("} else {");
      dst.indent += "  ";
      dst.Open("for (ki64 j = 0; j < cnt; ++j) {");
      dst.Append(b2);
      dst.Close();
      dst.Close();
      return;
    }
    // Several reduced axes: an odometer over them.
    Out b(dst.indent + "  ");
    mode = Mode::kGeneral;
    pr.SetElemBlock(&b);
    for (int i : full) {
      std::string f = StrCat("const ki64 f", i, " = b", i);
      for (size_t q = 0; q < red.size(); ++q) {
        absl::StrAppend(&f, " + ridx[", q, "] * a.inputs[", i, "].strides[", red[q], "]");
      }
      b.Line(f + ";");
    }
    if (s.elementwise) {
      std::string f = "const ki64 fo = ob";
      for (size_t q = 0; q < red.size(); ++q) {
        absl::StrAppend(&f, " + ridx[", q, "] * a.output.strides[", red[q], "]");
      }
      b.Line(f + ";");
    }
    // Offsets must precede the loads the printer emits: print into a second block.
    Out body(b.indent);
    pr.SetElemBlock(&body);
    per_element(body);
    b.Append(body);
    std::string axes;
    for (size_t q = 0; q < red.size(); ++q) absl::StrAppend(&axes, q ? ", " : "", red[q]);
    dst.Line(StrCat("ki64 ridx[", red.size(), "] = {0};"));
    dst.Line(StrCat("const int kra[", red.size(), "] = {", axes, "};"));
    dst.Open("for (ki64 p = 0; p < cnt; ++p) {");
    dst.Append(b);
    dst.Line(StrCat("for (int q = ", red.size() - 1,
                    "; q >= 0; --q) { if (++ridx[q] < sh[kra[q]]) break; ridx[q] = 0; }"));
    dst.Close();
  };
  for (size_t st = 0; st < s.stages.size(); ++st) {
    const ReduceStage& stage = s.stages[st];
    const std::string acc = StrCat("a", st);
    Out loop(row.indent);
    element_loop(
        loop,
        [&](Out& body) {
          const std::string v = pr.Print(stage.value);
          body.Line(CombineLine(stage, acc, v, single ? "j" : "p"));
        },
        SimdPragma(stage, acc));
    DeclareAcc(row, stage, acc);
    row.Append(loop);
    FinishAcc(row, stage, acc, static_cast<int>(st));
  }
  in_output = true;
  if (s.elementwise) {
    Out loop(row.indent);
    element_loop(
        loop,
        [&](Out& body) {
          const std::string v = pr.Print(s.output);
          std::string off;
          switch (mode) {
            case Mode::kUnit:
              off = "ob + j";
              break;
            case Mode::kStrided:
              off = "ob + j * ro";
              break;
            case Mode::kGeneral:
              off = "fo";
              break;
          }
          body.Line(StrCat("po[", off, "] = ", StoreConv(s.output.type(), s.out_dtype, v), ";"));
        },
        "#pragma omp simd");
    row.Append(loop);
  } else {
    pr.ResetLevels();
    pr.SetRowBlock(&row);
    pr.SetElemBlock(&row);
    const std::string v = pr.Print(s.output);
    row.Line(StrCat("po[ob] = ", StoreConv(s.output.type(), s.out_dtype, v), ";"));
  }
  k.Append(row);
  k.Close();
  k.Close();
  return k.text;
}

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

// Positions of the meta values: shape at 0; then output offset/strides; then per arg.
struct MetaLayout {
  int shape = 0;
  int out = 0;           // offset at out, strides at out + 1
  std::vector<int> arg;  // per arg: offset at arg[i], then strides (or len, stride)
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
  return [&s, &m](int k, const std::string& i) {
    const int arg = s.AuxArg(k);
    const int at = m.arg[arg];
    return ExprPrinter::AuxRef{StrCat("x", arg, "[m.v[", at, "] + ", i, " * m.v[", at + 2, "]]"),
                               StrCat("m.v[", at + 1, "]"), s.args[arg].dtype};
  };
}

std::string DevicePointwise(const KernelSpec& s, const std::string& name) {
  const MetaLayout m = LayoutOf(s);
  const int R = s.rank;
  Out k;
  k.Line(StrCat("// ", s.name, ": ", s.value.ToString().substr(0, 200)));
  k.Open(DeviceSignature(s, name, m));
  std::string n = "const ki64 n = 1";
  for (int d = 0; d < R; ++d) absl::StrAppend(&n, " * m.v[", d, "]");
  k.Line(n + ";");
  k.Open("for (ki64 i = GLOBAL_ID; i < n; i += GLOBAL_SIZE) {");
  if (R > 0) k.Line("ki64 t = i;");
  for (int d = R - 1; d >= 0; --d) {
    k.Line(StrCat("const ki64 i", d, " = ", d > 0 ? StrCat("t % m.v[", d, "]") : "t", ";"));
    if (d > 0) k.Line(StrCat("t /= m.v[", d, "];"));
  }
  auto offset = [&](const std::string& var, int at, int rank) {
    std::string v = StrCat("const ki64 ", var, " = m.v[", at, "]");
    for (int d = 0; d < rank; ++d) absl::StrAppend(&v, " + i", d, " * m.v[", at + 1 + d, "]");
    k.Line(v + ";");
  };
  offset("oo", m.out, R);
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) offset(StrCat("o", i), m.arg[i], R);
  }
  auto leaf = [&](const ExprNode& nd) -> Leaf {
    if (nd.op == ExprOp::kInput) {
      return {LoadConv(s.args[nd.index].dtype, StrCat("p", nd.index, "[o", nd.index, "]")),
              kElemLevel};
    }
    if (nd.op == ExprOp::kIndex) return {StrCat("i", nd.index), kElemLevel};
    return {"0", kElemLevel};
  };
  ExprPrinter pr("t", leaf, DeviceAux(s, m));
  Out body(k.indent);
  pr.SetRowBlock(nullptr);
  pr.SetElemBlock(&body);
  const std::string v = pr.Print(s.value);
  k.Append(body);
  k.Line(StrCat("po[oo] = ", StoreConv(s.value.type(), s.out_dtype, v), ";"));
  k.Close();
  k.Close();
  return k.text;
}

std::string DeviceReduce(const KernelSpec& s, const std::string& name, int wg) {
  const MetaLayout m = LayoutOf(s);
  const int R = s.rank;
  std::vector<bool> reduced(R, false);
  for (int ax : s.reduce_axes) reduced[ax] = true;
  std::vector<int> kept, red;
  for (int d = 0; d < R; ++d) (reduced[d] ? red : kept).push_back(d);
  auto out_axis = [&](int ax) {
    if (s.elementwise || s.keepdim) return ax;
    int n = 0;
    for (int d : kept) {
      if (d == ax) return n;
      ++n;
    }
    return -1;
  };
  Out k;
  k.Line(StrCat("// ", s.name, " (reduce over [", absl::StrJoin(s.reduce_axes, ","), "])"));
  k.Open(DeviceSignature(s, name, m));
  // Shared scratch for the work-group tree reductions, per accumulator type.
  bool need_f = false, need_d = false, need_i = false, need_p = false;
  for (const ReduceStage& st : s.stages) {
    const DType t = st.value.type();
    need_f |= t == DType::kF32;
    need_d |= t == DType::kF64;
    need_i |= t == DType::kI64;
    need_p |= st.kind == ReduceKind::kArgMax;
  }
  if (need_f) k.Line(StrCat("LOCAL float kredf[", wg, "];"));
  if (need_d) k.Line(StrCat("LOCAL double kredd[", wg, "];"));
  if (need_i) k.Line(StrCat("LOCAL ki64 kredi[", wg, "];"));
  if (need_p) k.Line(StrCat("LOCAL ki64 kredp[", wg, "];"));
  k.Line("const int lid = LOCAL_ID;");
  std::string rows = "1", cnt = "1";
  for (int d : kept) absl::StrAppend(&rows, " * m.v[", d, "]");
  for (int d : red) absl::StrAppend(&cnt, " * m.v[", d, "]");
  k.Line(StrCat("const ki64 rows = ", rows, ";"));
  k.Line(StrCat("const ki64 cnt = ", cnt, ";"));
  k.Open("for (ki64 r = GROUP_ID; r < rows; r += NUM_GROUPS) {");
  if (!kept.empty()) k.Line("ki64 t = r;");
  for (int q = static_cast<int>(kept.size()) - 1; q >= 0; --q) {
    const int d = kept[q];
    k.Line(StrCat("const ki64 k", d, " = t % m.v[", d, "];"));
    if (q > 0) k.Line(StrCat("t /= m.v[", d, "];"));
  }
  auto base = [&](const std::string& var, int at, bool out_space) {
    std::string v = StrCat("const ki64 ", var, " = m.v[", at, "]");
    for (int d : kept) {
      absl::StrAppend(&v, " + k", d, " * m.v[", at + 1 + (out_space ? out_axis(d) : d), "]");
    }
    k.Line(v + ";");
  };
  base("ob", m.out, !s.elementwise);
  for (size_t i = 0; i < s.args.size(); ++i) {
    if (s.args[i].role == ArgRole::kFull) base(StrCat("b", i), m.arg[i], false);
    if (s.args[i].role == ArgRole::kOut) base(StrCat("b", i), m.arg[i], true);
  }
  bool in_output = false;
  auto leaf = [&](const ExprNode& n) -> Leaf {
    switch (n.op) {
      case ExprOp::kInput: {
        const KernelArg& arg = s.args[n.index];
        if (arg.role == ArgRole::kOut) {
          return {LoadConv(arg.dtype, StrCat("p", n.index, "[b", n.index, "]")), kRowLevel};
        }
        return {LoadConv(arg.dtype, StrCat("p", n.index, "[f", n.index, "]")), kElemLevel};
      }
      case ExprOp::kIndex: {
        if (n.index == kPosAxis) return {"p", kElemLevel};
        if (in_output && !s.elementwise) {
          if (s.keepdim) {
            return reduced[n.index] ? Leaf{"((ki64)0)", kConstLevel}
                                    : Leaf{StrCat("k", n.index), kRowLevel};
          }
          return {StrCat("k", kept[n.index]), kRowLevel};
        }
        if (!reduced[n.index]) return {StrCat("k", n.index), kRowLevel};
        return {StrCat("j", n.index), kElemLevel};
      }
      case ExprOp::kAcc:
        return {StrCat("acc", n.index), kRowLevel};
      case ExprOp::kCount:
        return {"cnt", kRowLevel};
      default:
        return {"0", kRowLevel};
    }
  };
  ExprPrinter pr("t", leaf, DeviceAux(s, m));
  Out row(k.indent);
  pr.SetRowBlock(&row);
  // A loop over this work-item's reduced elements p = lid, lid + wg, ...
  auto element_loop = [&](Out& dst, const std::function<void(Out&)>& per_element) {
    Out b(dst.indent + "  ");
    b.Line("ki64 u = p;");
    for (int q = static_cast<int>(red.size()) - 1; q >= 0; --q) {
      const int d = red[q];
      b.Line(StrCat("const ki64 j", d, " = ", q > 0 ? StrCat("u % m.v[", d, "]") : "u", ";"));
      if (q > 0) b.Line(StrCat("u /= m.v[", d, "];"));
    }
    for (size_t i = 0; i < s.args.size(); ++i) {
      if (s.args[i].role != ArgRole::kFull) continue;
      std::string f = StrCat("const ki64 f", i, " = b", i);
      for (int d : red) absl::StrAppend(&f, " + j", d, " * m.v[", m.arg[i] + 1 + d, "]");
      b.Line(f + ";");
    }
    if (s.elementwise) {
      std::string f = "const ki64 fo = ob";
      for (int d : red) absl::StrAppend(&f, " + j", d, " * m.v[", m.out + 1 + d, "]");
      b.Line(f + ";");
    }
    Out body(b.indent);
    pr.SetElemBlock(&body);
    per_element(body);
    b.Append(body);
    dst.Open(StrCat("for (ki64 p = lid; p < cnt; p += ", wg, ") {"));
    dst.Append(b);
    dst.Close();
  };
  for (size_t st = 0; st < s.stages.size(); ++st) {
    const ReduceStage& stage = s.stages[st];
    const DType t = stage.value.type();
    const std::string acc = StrCat("a", st);
    Out loop(row.indent);
    element_loop(loop, [&](Out& body) {
      const std::string v = pr.Print(stage.value);
      body.Line(CombineLine(stage, acc, v, "p"));
    });
    DeclareAcc(row, stage, acc);
    row.Append(loop);
    // Per-thread partials -> one value, by a tree in shared memory.
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
    row.Open(StrCat("for (int w = ", wg / 2, "; w > 0; w >>= 1) {"));
    std::string comb;
    const char* sfx = t == DType::kF32 ? "f" : "d";
    switch (stage.kind) {
      case ReduceKind::kSum:
        comb = fl ? StrCat(buf, "[lid] += ", buf, "[lid + w];")
                  : StrCat(buf, "[lid] = kiadd(", buf, "[lid], ", buf, "[lid + w]);");
        break;
      case ReduceKind::kMax:
        comb = StrCat(buf, "[lid] = ", fl ? StrCat("kmax", sfx) : "kimax", "(", buf, "[lid], ", buf,
                      "[lid + w]);");
        break;
      case ReduceKind::kMin:
        comb = StrCat(buf, "[lid] = ", fl ? StrCat("kmin", sfx) : "kimin", "(", buf, "[lid], ", buf,
                      "[lid + w]);");
        break;
      case ReduceKind::kArgMax:
        comb = StrCat("if (", fl ? StrCat("kbetter", sfx) : "kbetteri", "(", buf,
                      "[lid + w], kredp[lid + w], ", buf, "[lid], kredp[lid])) { ", buf,
                      "[lid] = ", buf, "[lid + w]; kredp[lid] = kredp[lid + w]; }");
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
  in_output = true;
  if (s.elementwise) {
    Out loop(row.indent);
    element_loop(loop, [&](Out& body) {
      const std::string v = pr.Print(s.output);
      body.Line(StrCat("po[fo] = ", StoreConv(s.output.type(), s.out_dtype, v), ";"));
    });
    row.Append(loop);
  } else {
    Out store(row.indent + "  ");
    pr.ResetLevels();
    pr.SetRowBlock(&store);
    pr.SetElemBlock(&store);
    const std::string v = pr.Print(s.output);
    store.Line(StrCat("po[ob] = ", StoreConv(s.output.type(), s.out_dtype, v), ";"));
    row.Open("if (lid == 0) {");
    row.Append(store);
    row.Close();
  }
  k.Append(row);
  k.Close();
  k.Close();
  return k.text;
}

std::string Generate(const KernelSpec& s, Dialect d, const std::string& name, int wg) {
  if (d == Dialect::kCpp) {
    switch (s.kind) {
      case KernelKind::kPointwise:
        return CppPointwise(s, name);
      case KernelKind::kReduce:
        return CppReduce(s, name);
      case KernelKind::kGemmEpilogue:
        return CppEpilogue(s, name);
    }
  }
  return s.kind == KernelKind::kPointwise ? DevicePointwise(s, name) : DeviceReduce(s, name, wg);
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
  if (wg < 32 || wg > 1024 || (wg & (wg - 1)) != 0) {
    return InvalidArgument("work_group_size must be a power of two in [32, 1024]; got ", wg);
  }
  if (dialect != Dialect::kCpp && spec.kind == KernelKind::kGemmEpilogue) {
    return Unimplemented("GEMM epilogues have no ", DialectName(dialect), " form");
  }
  static constexpr const char* kPlaceholder = "kiln_KERNEL_NAME";
  const std::string text = Generate(spec, dialect, kPlaceholder, wg);
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
  g.code = absl::StrReplaceAll(text, {{kPlaceholder, g.entry}});
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

std::vector<int64_t> PackDeviceMeta(const KernelSpec& spec, const LaunchArgs& args,
                                    std::span<const int64_t> offsets) {
  const MetaLayout m = LayoutOf(spec);
  std::vector<int64_t> v(m.size, 0);
  const TensorArg* shape_src = spec.kind == KernelKind::kReduce && spec.shape_arg >= 0
                                   ? &args.inputs[spec.shape_arg]
                                   : &args.output;
  for (int d = 0; d < spec.rank; ++d) v[d] = shape_src->shape[d];
  auto off = [&](size_t i) { return i < offsets.size() ? offsets[i] : 0; };
  v[m.out] = off(0);
  for (int d = 0; d < spec.out_rank; ++d) v[m.out + 1 + d] = args.output.strides[d];
  for (size_t i = 0; i < spec.args.size(); ++i) {
    const TensorArg& t = args.inputs[i];
    v[m.arg[i]] = off(i + 1);
    if (spec.args[i].role == ArgRole::kAux) {
      v[m.arg[i] + 1] = t.shape[0];
      v[m.arg[i] + 2] = t.strides[0];
    } else {
      for (int d = 0; d < spec.args[i].rank; ++d) v[m.arg[i] + 1 + d] = t.strides[d];
    }
  }
  return v;
}

DeviceGeometry DeviceLaunchGeometry(const KernelSpec& spec, const LaunchArgs& args,
                                    const CodegenOptions& options) {
  const int64_t wg = options.work_group_size;
  DeviceGeometry g;
  g.local_size = wg;
  if (spec.kind == KernelKind::kReduce) {
    const TensorArg* src = spec.shape_arg >= 0 ? &args.inputs[spec.shape_arg] : &args.output;
    std::vector<bool> reduced(spec.rank, false);
    for (int ax : spec.reduce_axes) reduced[ax] = true;
    int64_t rows = 1;
    for (int d = 0; d < spec.rank; ++d) {
      if (!reduced[d]) rows *= src->shape[d];
    }
    g.global_size = std::clamp<int64_t>(rows, 1, 65536) * wg;
    return g;
  }
  const int64_t n = args.output.numel();
  const int64_t groups = std::clamp<int64_t>((n + wg - 1) / wg, 1, 65536);
  g.global_size = groups * wg;
  return g;
}

}  // namespace kiln::compiler
