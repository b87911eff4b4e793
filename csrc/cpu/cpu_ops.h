// Torch-facing CPU ops (see cpu_ops.cpp); declared here for the registration unit.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace lightning_zero {
namespace cpu {

std::vector<std::string> cpu_supported_isas();

// Sum of squares of a contiguous fp32 or bf16 tensor, as a 0-dim fp32 tensor (kernels_impl_norm.h).
at::Tensor cpu_sum_squares(const at::Tensor& x, c10::string_view isa);

void cpu_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_copy,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   int64_t step, bool adamw_mode, bool bias_correction, double grad_scale,
                   c10::string_view isa);

at::Tensor cpu_lamb_moments(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const at::Tensor& segment_offsets, double beta1, double beta2,
                            double eps, double weight_decay, int64_t step, bool bias_correction,
                            double grad_scale, c10::string_view isa);

void cpu_lamb_apply(const at::Tensor& param, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& segment_offsets,
                    const at::Tensor& trust_ratio, const c10::optional<at::Tensor>& param_copy,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    int64_t step, bool bias_correction, c10::string_view isa);

void cpu_adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                      const c10::optional<at::Tensor>& param_copy, double lr, double lr_decay,
                      double eps, double weight_decay, int64_t step, double grad_scale,
                      c10::string_view isa);

void cpu_lion_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const c10::optional<at::Tensor>& param_copy, double lr, double beta1, double beta2,
                   double weight_decay, double grad_scale, c10::string_view isa);

}  // namespace cpu
}  // namespace lightning_zero
