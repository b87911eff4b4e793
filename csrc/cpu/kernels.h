// Interface between the torch-facing dispatcher (cpu_ops.cpp) and the per-ISA kernel translation
// units (kernels_scalar.cpp, kernels_avx2.cpp, kernels_avx512.cpp).
//
// Why this header includes no torch and no STL header: the ISA units are compiled with
// `#pragma GCC target("avx512f,...")`. Any inline function they instantiate from a shared header
// (std::min, a c10 helper) would be emitted there with AVX-512 instructions, and the linker may keep
// that copy for the whole library, which then dies with SIGILL on an AVX2-only CPU. So the ISA units
// see only plain C types and keep every helper in an anonymous namespace.
#pragma once
#include <stdint.h>

namespace lightning_zero {
namespace cpu {

enum class StateDtype : int { kFloat32 = 0, kBFloat16 = 1 };
enum class CopyDtype : int { kNone = 0, kBFloat16 = 1, kFloat16 = 2 };

// One contiguous flat range. param/grad are fp32; exp_avg/exp_avg_sq are float* or uint16_t*
// (bf16 bits) per state_dtype; param_copy is uint16_t* (bf16 or fp16 bits) or null. Adam only:
// grad_bf16 (bf16 bits) instead of grad (then null), widened to fp32 in registers.
struct Buffers {
  float* param;
  const float* grad;
  const uint16_t* grad_bf16;
  void* exp_avg;
  void* exp_avg_sq;
  uint16_t* param_copy;
  StateDtype state_dtype;
  CopyDtype copy_dtype;
};

// Per-step scalars, computed once by the dispatcher so the kernels do no pow() per element.
struct Hyper {
  float beta2;
  float one_minus_beta1;  // 1 - beta1 in double, then rounded: torch passes it as a Python float
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float grad_scale;    // gradients are multiplied by this first (unscale x clip coefficient)
  float update_scale;  // Adam: lr / bias_correction1; LAMB: 1 / bias_correction1
  float inv_bc2_sqrt;  // 1 / sqrt(bias_correction2)
  float decay;         // AdamW: 1 - lr * weight_decay (multiplies the param before the update)
  int adamw_mode;      // 1: decoupled decay (AdamW); 0: L2 decay added to the gradient (Adam)
  float beta1;         // Lion only: c = beta1 * m + (1 - beta1) * g
};

// Adam/AdamW on elements [begin, end): updates param, exp_avg, exp_avg_sq, param_copy in place.
typedef void (*AdamRangeFn)(const Buffers&, int64_t begin, int64_t end, const Hyper&);
// LAMB phase 1 on [begin, end): updates exp_avg/exp_avg_sq; sums[0] += sum(param^2),
// sums[1] += sum(update^2) where update = m_hat / (sqrt(v_hat) + eps) + weight_decay * param.
typedef void (*LambMomentsRangeFn)(const Buffers&, int64_t begin, int64_t end, const Hyper&,
                                   double* sums);
// LAMB phase 2 on [begin, end): param -= lr_trust * update (update recomputed from the states).
typedef void (*LambApplyRangeFn)(const Buffers&, int64_t begin, int64_t end, const Hyper&,
                                 float lr_trust);

// One-state optimizers on [begin, end) (kernels_impl_onestate.h); the state is Buffers::exp_avg
// (exp_avg_sq is unused). Adagrad: state = sum of squared gradients, update_scale = clr.
// Lion: state = exp_avg, update_scale = lr, decay = 1 - lr * weight_decay.
typedef void (*OneStateRangeFn)(const Buffers&, int64_t begin, int64_t end, const Hyper&);

// Sum of squares of x[begin, end), fp32 (bf16 = false) or bf16 bits (kernels_impl_norm.h).
typedef double (*SumSquaresRangeFn)(const void* x, bool bf16, int64_t begin, int64_t end);

struct KernelTable {
  const char* name;  // "scalar", "avx2", "avx512"; null entries mean "not compiled for this target"
  AdamRangeFn adam;
  LambMomentsRangeFn lamb_moments;
  LambApplyRangeFn lamb_apply;
  OneStateRangeFn adagrad;
  OneStateRangeFn lion;
  SumSquaresRangeFn sum_squares;
};

KernelTable scalar_kernels();
KernelTable avx2_kernels();
KernelTable avx512_kernels();

}  // namespace cpu
}  // namespace lightning_zero
