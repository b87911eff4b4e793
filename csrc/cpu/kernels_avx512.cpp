// AVX-512 (F + BW + VL + DQ) path, 16 floats per vector. Compiled for that target by the pragma
// below; the dispatcher calls it only after cpuid and XGETBV say the CPU and OS support ZMM state.
#include "kernels.h"

// GCC 12 flags its own _mm512_undefined_* placeholders as "maybe uninitialized" (a known false
// positive in avx512fintrin.h); silence only that, only here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif
#include <immintrin.h>

namespace {

struct V {
  enum { W = 16 };
  typedef __m512 R;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R load_bf16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // Round to nearest even, NaN -> 0x7FC0, as c10::BFloat16 does. Integer arithmetic rather than
  // AVX512_BF16's vcvtneps2bf16, so that Skylake-X/Cascade Lake (no BF16 extension) run it too.
  static void store_bf16(uint16_t* p, R x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_fp16(uint16_t* p, R x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R sqrt(R a) { return _mm512_sqrt_ps(a); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fnmadd(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }
  // torch.sign: 1, -1, 0 for +-0, NaN for NaN
  static R sign(R x) {
    const R zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    R r = _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), one),
                        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
  }
  // through memory: once per range, and GCC 12's _mm512_reduce_add_ps trips -Wuninitialized
  static float hsum(R a) {
    float lanes[W];
    _mm512_storeu_ps(lanes, a);
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += lanes[i];
    return s;
  }
};

}  // namespace

#include "kernels_impl.h"
#include "kernels_impl_onestate.h"
#include "kernels_impl_norm.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace lightning_zero {
namespace cpu {
KernelTable avx512_kernels() { return {"avx512", adam_range, lamb_moments_range, lamb_apply_range, adagrad_range,
                                        lion_range, sum_squares_range}; }
}  // namespace cpu
}  // namespace lightning_zero

#else  // not x86-64: the dispatcher sees null entries and never selects this path
namespace lightning_zero {
namespace cpu {
KernelTable avx512_kernels() { return {"avx512", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}; }
}  // namespace cpu
}  // namespace lightning_zero
#endif
