// CUDA multi-tensor Adam/AdamW and two-phase LAMB: the CUDA kernels of the lightning_zero ops whose
// schemas are in csrc/ops.cpp. Same arithmetic as the CPU kernels (csrc/cpu/kernels_impl.h):
// fp32 math on fp32 master params and states; gradients fp32/bf16/fp16; optional 16-bit copy of the
// updated params; the gradient scale is read from device memory so the host never synchronises.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>

#include "multi_tensor_apply.cuh"

namespace lightning_zero {
namespace cuda {
namespace {

struct Hyper {
  float beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, update_scale, inv_bc2_sqrt,
      decay, lr;
  int adamw_mode;
};

Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                 int64_t step, bool adamw_mode, bool bias_correction, bool lamb) {
  TORCH_CHECK_VALUE(step >= 1, "lightning_zero: step counts from 1, got ", step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, double(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, double(step)) : 1.0;
  return {float(beta2), float(1.0 - beta1), float(1.0 - beta2), float(eps), float(weight_decay),
          float((lamb ? 1.0 : lr) / bc1), float(1.0 / std::sqrt(bc2)), float(1.0 - lr * weight_decay),
          float(lr), adamw_mode ? 1 : 0};
}

// Per block: which tensor, which chunk of it, and the element range.
struct Range {
  int slot;
  int64_t begin, end;
};

template <int DEPTH>
__device__ Range block_range(const TensorListMeta<DEPTH>& meta) {
  const int slot = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = int64_t(meta.block_to_chunk[blockIdx.x]) * kChunk;
  return {slot, begin, min(meta.sizes[slot], begin + kChunk)};
}

__device__ __forceinline__ void moments(float g, float& m, float& v, const Hyper& h) {
  m = fmaf(h.one_minus_beta1, g - m, m);  // torch: exp_avg.lerp_(grad, 1 - beta1)
  v = fmaf(h.one_minus_beta2, g * g, v * h.beta2);
}

__device__ __forceinline__ float lamb_update(float p, float m, float v, const Hyper& h) {
  return fmaf(p, h.weight_decay, (m / fmaf(sqrtf(v), h.inv_bc2_sqrt, h.eps)) * h.update_scale);
}

// lists: 0 param (fp32), 1 grad (G), 2 exp_avg, 3 exp_avg_sq (fp32), 4 copy (C) when DEPTH == 5.
template <typename G, typename C, int DEPTH>
__global__ void __launch_bounds__(kThreads) adam_kernel(TensorListMeta<DEPTH> meta, Hyper h,
                                                        const float* grad_scale) {
  const Range r = block_range(meta);
  float* p = static_cast<float*>(meta.addr[0][r.slot]);
  const G* g = static_cast<const G*>(meta.addr[1][r.slot]);
  float* m = static_cast<float*>(meta.addr[2][r.slot]);
  float* v = static_cast<float*>(meta.addr[3][r.slot]);
  const float scale = grad_scale ? *grad_scale : 1.0f;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    float param = p[i], grad = static_cast<float>(g[i]) * scale, mi = m[i], vi = v[i];
    if (!h.adamw_mode) grad = fmaf(param, h.weight_decay, grad);
    moments(grad, mi, vi, h);
    if (h.adamw_mode) param *= h.decay;
    param = fmaf(-h.update_scale, mi / fmaf(sqrtf(vi), h.inv_bc2_sqrt, h.eps), param);
    p[i] = param;
    m[i] = mi;
    v[i] = vi;
    if constexpr (DEPTH == 5) static_cast<C*>(meta.addr[4][r.slot])[i] = static_cast<C>(param);
  }
}

// Block-wide sum of two floats, then one atomicAdd per block into out[index * 2 + {0, 1}].
__device__ void block_sum_to(float a, float b, float* out) {
  __shared__ float sa[kThreads / 32], sb[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, o);
    b += __shfl_down_sync(0xffffffffu, b, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < int(blockDim.x / 32) ? sa[lane] : 0.0f;
    b = lane < int(blockDim.x / 32) ? sb[lane] : 0.0f;
    for (int o = 16; o > 0; o /= 2) {
      a += __shfl_down_sync(0xffffffffu, a, o);
      b += __shfl_down_sync(0xffffffffu, b, o);
    }
    if (lane == 0) {
      atomicAdd(out, a);
      atomicAdd(out + 1, b);
    }
  }
}

template <typename G>
__global__ void __launch_bounds__(kThreads) lamb_moments_kernel(TensorListMeta<4> meta, Hyper h,
                                                                const float* grad_scale,
                                                                float* sq_norms) {
  const Range r = block_range(meta);
  const float* p = static_cast<const float*>(meta.addr[0][r.slot]);
  const G* g = static_cast<const G*>(meta.addr[1][r.slot]);
  float* m = static_cast<float*>(meta.addr[2][r.slot]);
  float* v = static_cast<float*>(meta.addr[3][r.slot]);
  const float scale = grad_scale ? *grad_scale : 1.0f;
  float sp = 0.0f, su = 0.0f;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    float mi = m[i], vi = v[i];
    moments(static_cast<float>(g[i]) * scale, mi, vi, h);
    m[i] = mi;
    v[i] = vi;
    const float u = lamb_update(p[i], mi, vi, h);
    sp = fmaf(p[i], p[i], sp);
    su = fmaf(u, u, su);
  }
  block_sum_to(sp, su, sq_norms + 2 * meta.index[r.slot]);
}

template <typename C, int DEPTH>
__global__ void __launch_bounds__(kThreads) lamb_apply_kernel(TensorListMeta<DEPTH> meta, Hyper h,
                                                              const float* trust) {
  const Range r = block_range(meta);
  float* p = static_cast<float*>(meta.addr[0][r.slot]);
  const float* m = static_cast<const float*>(meta.addr[1][r.slot]);
  const float* v = static_cast<const float*>(meta.addr[2][r.slot]);
  const float lr_trust = h.lr * trust[meta.index[r.slot]];
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float param = fmaf(-lr_trust, lamb_update(p[i], m[i], v[i], h), p[i]);
    p[i] = param;
    if constexpr (DEPTH == 4) static_cast<C*>(meta.addr[3][r.slot])[i] = static_cast<C>(param);
  }
}

void check_list(at::TensorList ts, at::TensorList params, const char* name, bool fp32) {
  TORCH_CHECK_VALUE(ts.size() == params.size(), "lightning_zero: params has ", params.size(),
                    " tensors but ", name, " has ", ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK_VALUE(ts[i].is_cuda() && ts[i].device() == params[0].device() && ts[i].is_contiguous(),
                      "lightning_zero: ", name, "[", i, "] must be a contiguous tensor on ",
                      params[0].device());
    TORCH_CHECK_VALUE(ts[i].numel() == params[i].numel(), "lightning_zero: ", name, "[", i, "] has ",
                      ts[i].numel(), " elements but params[", i, "] has ", params[i].numel());
    TORCH_CHECK_VALUE(!fp32 || ts[i].scalar_type() == at::kFloat, "lightning_zero: ", name, "[", i,
                      "] must be float32, got ", ts[i].scalar_type());
  }
}

const float* scale_ptr(const c10::optional<at::Tensor>& s, const at::Tensor& like) {
  if (!s.has_value()) return nullptr;
  TORCH_CHECK_VALUE(s->numel() == 1 && s->scalar_type() == at::kFloat && s->device() == like.device(),
                    "lightning_zero: grad_scale must be one float32 element on ", like.device());
  return s->data_ptr<float>();
}

std::vector<at::Tensor> vec(at::TensorList ts) { return std::vector<at::Tensor>(ts.begin(), ts.end()); }

// Calls f(C{}) with C = at::BFloat16 or at::Half for the copies' dtype.
template <typename F>
void dispatch_copy(at::TensorList copies, F f) {
  const at::ScalarType t = copies[0].scalar_type();
  TORCH_CHECK_VALUE(t == at::kBFloat16 || t == at::kHalf,
                    "lightning_zero: param_copies must be bfloat16 or float16, got ", t);
  if (t == at::kBFloat16) f(at::BFloat16{}); else f(at::Half{});
}

void fused_adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList param_copies,
                          const c10::optional<at::Tensor>& grad_scale, double lr, double beta1,
                          double beta2, double eps, double weight_decay, int64_t step,
                          bool adamw_mode, bool bias_correction) {
  if (params.empty()) return;
  check_list(params, params, "params", true);
  check_list(grads, params, "grads", false);
  check_list(exp_avgs, params, "exp_avgs", true);
  check_list(exp_avg_sqs, params, "exp_avg_sqs", true);
  if (!param_copies.empty()) check_list(param_copies, params, "param_copies", false);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, adamw_mode, bias_correction, false);
  const float* scale = scale_ptr(grad_scale, params[0]);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "fused_adam", [&] {
    using G = scalar_t;
    if (param_copies.empty()) {
      multi_tensor_apply<4>({vec(params), vec(grads), vec(exp_avgs), vec(exp_avg_sqs)},
                            [&](int blocks, const TensorListMeta<4>& meta) {
                              adam_kernel<G, float, 4><<<blocks, kThreads, 0, stream>>>(meta, h, scale);
                            });
    } else {
      dispatch_copy(param_copies, [&](auto c) {
        using C = decltype(c);
        multi_tensor_apply<5>(
            {vec(params), vec(grads), vec(exp_avgs), vec(exp_avg_sqs), vec(param_copies)},
            [&](int blocks, const TensorListMeta<5>& meta) {
              adam_kernel<G, C, 5><<<blocks, kThreads, 0, stream>>>(meta, h, scale);
            });
      });
    }
  });
}

at::Tensor fused_lamb_moments_cuda(at::TensorList params, at::TensorList grads,
                                   at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                   const c10::optional<at::Tensor>& grad_scale, double beta1,
                                   double beta2, double eps, double weight_decay, int64_t step,
                                   bool bias_correction) {
  TORCH_CHECK_VALUE(!params.empty(), "lightning_zero: fused_lamb_moments needs at least one tensor");
  check_list(params, params, "params", true);
  check_list(grads, params, "grads", false);
  check_list(exp_avgs, params, "exp_avgs", true);
  check_list(exp_avg_sqs, params, "exp_avg_sqs", true);
  const Hyper h = make_hyper(0.0, beta1, beta2, eps, weight_decay, step, true, bias_correction, true);
  const float* scale = scale_ptr(grad_scale, params[0]);
  at::Tensor out = at::zeros({int64_t(params.size()), 2}, params[0].options());
  float* sq = out.data_ptr<float>();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "fused_lamb", [&] {
    multi_tensor_apply<4>({vec(params), vec(grads), vec(exp_avgs), vec(exp_avg_sqs)},
                          [&](int blocks, const TensorListMeta<4>& meta) {
                            lamb_moments_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(meta, h, scale, sq);
                          });
  });
  return out;
}

void fused_lamb_apply_cuda(at::TensorList params, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, const at::Tensor& trust_ratio,
                           at::TensorList param_copies, double lr, double beta1, double beta2,
                           double eps, double weight_decay, int64_t step, bool bias_correction) {
  if (params.empty()) return;
  check_list(params, params, "params", true);
  check_list(exp_avgs, params, "exp_avgs", true);
  check_list(exp_avg_sqs, params, "exp_avg_sqs", true);
  TORCH_CHECK_VALUE(trust_ratio.numel() == int64_t(params.size()) && trust_ratio.is_cuda() &&
                        trust_ratio.scalar_type() == at::kFloat && trust_ratio.is_contiguous(),
                    "lightning_zero: trust_ratio must be a contiguous float32 CUDA tensor of ",
                    params.size(), " elements, got ", trust_ratio.numel());
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, true, bias_correction, true);
  const float* trust = trust_ratio.data_ptr<float>();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (param_copies.empty()) {
    multi_tensor_apply<3>({vec(params), vec(exp_avgs), vec(exp_avg_sqs)},
                          [&](int blocks, const TensorListMeta<3>& meta) {
                            lamb_apply_kernel<float, 3><<<blocks, kThreads, 0, stream>>>(meta, h, trust);
                          });
    return;
  }
  check_list(param_copies, params, "param_copies", false);
  dispatch_copy(param_copies, [&](auto c) {
    using C = decltype(c);
    multi_tensor_apply<4>({vec(params), vec(exp_avgs), vec(exp_avg_sqs), vec(param_copies)},
                          [&](int blocks, const TensorListMeta<4>& meta) {
                            lamb_apply_kernel<C, 4><<<blocks, kThreads, 0, stream>>>(meta, h, trust);
                          });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace lightning_zero

TORCH_LIBRARY_IMPL(lightning_zero, CUDA, m) {
  m.impl("fused_adam_step", &lightning_zero::cuda::fused_adam_step_cuda);
  m.impl("fused_lamb_moments", &lightning_zero::cuda::fused_lamb_moments_cuda);
  m.impl("fused_lamb_apply", &lightning_zero::cuda::fused_lamb_apply_cuda);
}
