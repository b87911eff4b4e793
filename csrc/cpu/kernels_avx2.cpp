// AVX2 + FMA + F16C path, 8 floats per vector. The whole unit is compiled for that target by the
// pragma below (not by -mavx2 on the command line, which setuptools would apply to every file);
// the dispatcher calls it only after cpuid says the CPU and the OS support AVX.
#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

namespace {

struct V {
  enum { W = 8 };
  typedef __m256 R;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R load_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // Round to nearest even, NaN -> 0x7FC0, as c10::BFloat16 does.
  static void store_bf16(uint16_t* p, R x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // values are < 0x10000, so unsigned saturation packs them exactly
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_fp16(uint16_t* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R sqrt(R a) { return _mm256_sqrt_ps(a); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R fnmadd(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }
  // torch.sign: 1, -1, 0 for +-0, NaN for NaN
  static R sign(R x) {
    const R zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    R r = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), one),
                        _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one));
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  static float hsum(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
KernelTable avx2_kernels() { return {"avx2", adam_range, lamb_moments_range, lamb_apply_range, adagrad_range,
                                        lion_range, sum_squares_range}; }
}  // namespace cpu
}  // namespace lightning_zero

#else  // not x86-64: the dispatcher sees null entries and never selects this path
namespace lightning_zero {
namespace cpu {
KernelTable avx2_kernels() { return {"avx2", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}; }
}  // namespace cpu
}  // namespace lightning_zero
#endif
