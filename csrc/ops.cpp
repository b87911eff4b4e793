// Registration of every lightning_zero op: schemas (TORCH_LIBRARY), CPU kernels, and the CPU
// versions of the multi-tensor "fused" ops (a loop over the list calling the CPU kernel), so that
// FusedAdam/FusedLamb also run, and can be tested, on CPU tensors. The CUDA kernels register
// themselves in csrc/cuda/*.cu when the extension is built with CUDA. Fake (meta) kernels are
// registered in Python (lightning_zero/ops/_fake.py).
//
// Alias annotations: (a!) marks tensors the op writes in place; these ops return nothing except
// the LAMB moments op, whose (segments, 2) result is [sum(param^2), sum(update^2)] per segment.
#include <Python.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/cpu_ops.h"

namespace lightning_zero {
namespace cpu {
// csrc/cpu/swap_io.cpp: the disk tier's pread/pwrite engine
int64_t swap_io(const at::Tensor& buffer, const std::string& path, bool write, int64_t block_size,
                int64_t threads, bool direct);
// csrc/cpu/swap_uring.cpp: the disk tier's io_uring engine and its probe
int64_t swap_uring(const at::Tensor& buffer, const std::string& path, bool write, int64_t block_size,
                   int64_t queue_depth, bool direct);
std::string swap_uring_probe(int64_t depth);
// csrc/cpu/host_pool.cpp: the disk tier's aligned, pooled host memory
void host_alloc_aligned(const at::Tensor& tensor);
void host_pool_trim();
std::vector<int64_t> host_pool_stats();
// csrc/cpu/crc32.cpp: checkpoint files' CRC-32 (zlib's)
int64_t crc32(const at::Tensor& data, int64_t value);
}  // namespace cpu
}  // namespace lightning_zero

namespace lightning_zero {
namespace {

double read_scale(const c10::optional<at::Tensor>& grad_scale) {
  if (!grad_scale.has_value()) return 1.0;
  TORCH_CHECK_VALUE(grad_scale->numel() == 1, "lightning_zero: grad_scale must hold one element, got ",
                    grad_scale->numel());
  return grad_scale->item<double>();  // a CPU tensor: no device synchronisation involved
}

void check_lists(size_t n, size_t other, const char* name) {
  TORCH_CHECK_VALUE(n == other, "lightning_zero: params has ", n, " tensors but ", name, " has ",
                    other, "; pass one per param");
}

void fused_adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList param_copies,
                         const c10::optional<at::Tensor>& grad_scale, double lr, double beta1,
                         double beta2, double eps, double weight_decay, int64_t step,
                         bool adamw_mode, bool bias_correction) {
  check_lists(params.size(), grads.size(), "grads");
  check_lists(params.size(), exp_avgs.size(), "exp_avgs");
  check_lists(params.size(), exp_avg_sqs.size(), "exp_avg_sqs");
  if (!param_copies.empty()) check_lists(params.size(), param_copies.size(), "param_copies");
  const double scale = read_scale(grad_scale);
  for (size_t i = 0; i < params.size(); ++i) {
    c10::optional<at::Tensor> copy;
    if (!param_copies.empty()) copy = param_copies[i];
    // 16-bit gradients (allowed by the CUDA kernel) are widened here: the CPU kernel reads fp32
    cpu::cpu_adam_step(params[i], grads[i].to(at::kFloat).contiguous(), exp_avgs[i],
                       exp_avg_sqs[i], copy, lr, beta1, beta2, eps, weight_decay, step,
                       adamw_mode, bias_correction, scale, "auto");
  }
}

at::Tensor whole(const at::Tensor& t) { return at::tensor({int64_t(0), t.numel()}, at::kLong); }

at::Tensor fused_lamb_moments_cpu(at::TensorList params, at::TensorList grads,
                                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                  const c10::optional<at::Tensor>& grad_scale, double beta1,
                                  double beta2, double eps, double weight_decay, int64_t step,
                                  bool bias_correction) {
  check_lists(params.size(), grads.size(), "grads");
  check_lists(params.size(), exp_avgs.size(), "exp_avgs");
  check_lists(params.size(), exp_avg_sqs.size(), "exp_avg_sqs");
  const double scale = read_scale(grad_scale);
  at::Tensor out = at::empty({int64_t(params.size()), 2}, at::kFloat);
  for (size_t i = 0; i < params.size(); ++i)
    out[i].copy_(cpu::cpu_lamb_moments(params[i], grads[i].to(at::kFloat).contiguous(),
                                       exp_avgs[i], exp_avg_sqs[i], whole(params[i]), beta1,
                                       beta2, eps, weight_decay, step, bias_correction, scale,
                                       "auto")[0]);
  return out;
}

void fused_lamb_apply_cpu(at::TensorList params, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, const at::Tensor& trust_ratio,
                          at::TensorList param_copies, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step, bool bias_correction) {
  check_lists(params.size(), exp_avgs.size(), "exp_avgs");
  check_lists(params.size(), exp_avg_sqs.size(), "exp_avg_sqs");
  check_lists(params.size(), size_t(trust_ratio.numel()), "trust_ratio");
  if (!param_copies.empty()) check_lists(params.size(), param_copies.size(), "param_copies");
  for (size_t i = 0; i < params.size(); ++i) {
    c10::optional<at::Tensor> copy;
    if (!param_copies.empty()) copy = param_copies[i];
    cpu::cpu_lamb_apply(params[i], exp_avgs[i], exp_avg_sqs[i], whole(params[i]),
                        trust_ratio.narrow(0, int64_t(i), 1).contiguous(), copy, lr, beta1, beta2,
                        eps, weight_decay, step, bias_correction, "auto");
  }
}

}  // namespace
}  // namespace lightning_zero

TORCH_LIBRARY(lightning_zero, m) {
  m.def("cpu_supported_isas() -> str[]", &lightning_zero::cpu::cpu_supported_isas);
  // Reads into `buffer` when write=False (hence (a!)); returns the bytes moved.
  m.def("swap_io(Tensor(a!) buffer, str path, bool write, int block_size, int threads, bool direct) -> int");
  m.def("swap_uring(Tensor(a!) buffer, str path, bool write, int block_size, int queue_depth, bool direct) -> int");
  // "" when io_uring works here, else the reason (a plain function: no tensors, no dispatch key)
  m.def("swap_uring_probe(int queue_depth) -> str", &lightning_zero::cpu::swap_uring_probe);
  // Gives a swapped-out tensor's (empty) storage 4096-aligned memory (O_DIRECT without a bounce copy)
  m.def("host_alloc_aligned(Tensor(a!) tensor) -> ()");
  // The pool behind it: give its free blocks back; [bytes in use, bytes kept free, peak, allocations]
  m.def("host_pool_trim() -> ()", &lightning_zero::cpu::host_pool_trim);
  m.def("host_pool_stats() -> int[]", &lightning_zero::cpu::host_pool_stats);
  m.def("crc32(Tensor data, int value) -> int");
  m.def("cpu_sum_squares(Tensor x, str isa) -> Tensor");
  m.def(
      "cpu_adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_copy, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "int step, bool adamw_mode, bool bias_correction, float grad_scale, str isa) -> ()");
  m.def(
      "cpu_lamb_moments(Tensor param, Tensor grad, Tensor(a!) exp_avg, Tensor(b!) exp_avg_sq, "
      "Tensor segment_offsets, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool bias_correction, float grad_scale, str isa) -> Tensor");
  m.def(
      "cpu_lamb_apply(Tensor(a!) param, Tensor exp_avg, Tensor exp_avg_sq, Tensor segment_offsets, "
      "Tensor trust_ratio, Tensor(b!)? param_copy, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, int step, bool bias_correction, str isa) -> ()");
  m.def(
      "cpu_adagrad_step(Tensor(a!) param, Tensor grad, Tensor(b!) state_sum, Tensor(c!)? param_copy, "
      "float lr, float lr_decay, float eps, float weight_decay, int step, float grad_scale, str isa) -> ()");
  m.def(
      "cpu_lion_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!)? param_copy, "
      "float lr, float beta1, float beta2, float weight_decay, float grad_scale, str isa) -> ()");
  m.def(
      "fused_adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] param_copies, Tensor? grad_scale, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, int step, bool adamw_mode, "
      "bool bias_correction) -> ()");
  m.def(
      "fused_lamb_moments(Tensor[] params, Tensor[] grads, Tensor(a!)[] exp_avgs, "
      "Tensor(b!)[] exp_avg_sqs, Tensor? grad_scale, float beta1, float beta2, float eps, "
      "float weight_decay, int step, bool bias_correction) -> Tensor");
  m.def(
      "fused_lamb_apply(Tensor(a!)[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
      "Tensor trust_ratio, Tensor(b!)[] param_copies, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, int step, bool bias_correction) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_zero, CPU, m) {
  m.impl("swap_io", &lightning_zero::cpu::swap_io);
  m.impl("swap_uring", &lightning_zero::cpu::swap_uring);
  m.impl("host_alloc_aligned", &lightning_zero::cpu::host_alloc_aligned);
  m.impl("crc32", &lightning_zero::cpu::crc32);
  m.impl("cpu_sum_squares", &lightning_zero::cpu::cpu_sum_squares);
  m.impl("cpu_adam_step", &lightning_zero::cpu::cpu_adam_step);
  m.impl("cpu_lamb_moments", &lightning_zero::cpu::cpu_lamb_moments);
  m.impl("cpu_lamb_apply", &lightning_zero::cpu::cpu_lamb_apply);
  m.impl("cpu_adagrad_step", &lightning_zero::cpu::cpu_adagrad_step);
  m.impl("cpu_lion_step", &lightning_zero::cpu::cpu_lion_step);
  m.impl("fused_adam_step", &lightning_zero::fused_adam_step_cpu);
  m.impl("fused_lamb_moments", &lightning_zero::fused_lamb_moments_cpu);
  m.impl("fused_lamb_apply", &lightning_zero::fused_lamb_apply_cpu);
}

// An importable module with no Python functions: importing lightning_zero._C loads this library,
// and loading runs the registrations above (the pattern of pytorch/extension-cpp).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}
