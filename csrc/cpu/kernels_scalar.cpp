// Portable path: one float per "vector". Compiled with the baseline flags of the target, so the
// compiler may still auto-vectorize it (SSE2 on x86-64); it is the path for CPUs without AVX2 and
// for non-x86 machines, and the easiest one to read against the reference implementation.
#include <math.h>
#include <string.h>

#include "kernels.h"

namespace {

inline uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

struct V {
  enum { W = 1 };
  typedef float R;
  static R load(const float* p) { return *p; }
  static void store(float* p, R x) { *p = x; }
  static R load_bf16(const uint16_t* p) { return float_of(uint32_t(*p) << 16); }
  // Round to nearest even, NaN -> quiet NaN: the same rule as c10::BFloat16.
  static void store_bf16(uint16_t* p, R x) {
    if (x != x) {
      *p = 0x7FC0;
      return;
    }
    uint32_t u = bits_of(x);
    *p = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  // Round to nearest even without F16C (F. Giesen's float_to_half_fast3_rtne).
  static void store_fp16(uint16_t* p, R x) {
    uint32_t u = bits_of(x);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t o;
    if (u >= (127u + 16u) << 23) {  // |x| >= 65536: inf, or NaN kept quiet
      o = u > (255u << 23) ? 0x7E00u : 0x7C00u;
    } else if (u < (113u << 23)) {  // half subnormal or zero: let an fp32 add do the rounding
      const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
      o = bits_of(float_of(u) + float_of(magic)) - magic;
    } else {
      const uint32_t mant_odd = (u >> 13) & 1u;
      u += (uint32_t(15 - 127) << 23) + 0xFFFu + mant_odd;  // rebias exponent and round
      o = u >> 13;
    }
    *p = uint16_t(o | (sign >> 16));
  }
  static R set1(float x) { return x; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R div(R a, R b) { return a / b; }
  static R sqrt(R a) { return sqrtf(a); }
  // a * b + c, not fmaf: without FMA hardware fmaf is a slow libm routine
  static R fmadd(R a, R b, R c) { return a * b + c; }
  static R fnmadd(R a, R b, R c) { return c - a * b; }
  // torch.sign: 1, -1, 0 for +-0, NaN for NaN
  static R sign(R x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? x : 0.0f)); }
  static float hsum(R a) { return a; }
};

}  // namespace

#include "kernels_impl.h"
#include "kernels_impl_onestate.h"
#include "kernels_impl_norm.h"

namespace lightning_zero {
namespace cpu {
KernelTable scalar_kernels() { return {"scalar", adam_range, lamb_moments_range, lamb_apply_range, adagrad_range,
                                        lion_range, sum_squares_range}; }
}  // namespace cpu
}  // namespace lightning_zero
