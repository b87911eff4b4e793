// CPU implementations of the lightning_zero optimizer ops: argument checks, per-step scalars,
// ISA selection and threading. The element loops live in the per-ISA units behind kernels.h.
//
// Threads: at::parallel_for, which in the CPU wheels of torch is OpenMP on torch's own libgomp.
// Its body is inline in ATen's headers and is an `omp parallel` region only when this unit is
// compiled with -fopenmp (setup.py does; without it the loop silently runs on the calling thread).
// Nothing links a second OpenMP runtime into this library: that would give two thread pools
// fighting for the same cores, and torch.set_num_threads would not govern ours. The thread count
// per rank is chosen in lightning_zero/threads.py.
// Tiles: the flat range is cut into TILE-element pieces. 16384 fp32 is 64 KiB per stream, so the
// five to seven streams of one tile (~400 KiB) stay in L2 while a thread works on it; tiles are also
// the unit of the LAMB norm reduction, which is summed tile by tile in a fixed order, so the norms
// do not depend on the number of threads.
// Tiles are handed out in short runs from an atomic counter (for_each_tile), not in one static block
// per thread: on a shared host (other ranks, dataloader workers, other jobs) a preempted thread
// would otherwise hold its whole block while the others wait at the end of the region; now they
// take its remaining tiles. Which tile a thread runs does not change any result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "isa.h"

namespace lightning_zero {
namespace cpu {
namespace {

constexpr int64_t TILE = 16384;

// fn(t) for every tile t in [0, tiles), on torch's thread pool, tiles taken dynamically (see the top).
template <typename F>
void for_each_tile(int64_t tiles, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tiles);
  // one index per worker: each runs the take-a-tile loop (serially, one call drains them all)
  // Runs of RUN consecutive tiles: a thread streams 1 MiB per array before it jumps, so the
  // hardware prefetchers stay on (single tiles from interleaved threads measured ~3% slower than
  // one static block per thread at 100M parameters, 2 threads); still 8+ runs per worker to share.
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(16, tiles / (8 * std::max<int64_t>(workers, 1))));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t first = next.fetch_add(run, std::memory_order_relaxed); first < tiles;
         first = next.fetch_add(run, std::memory_order_relaxed))
      for (int64_t t = first; t < std::min(first + run, tiles); ++t) fn(t);
  });
}

KernelTable select_table(const std::string& isa) {
  KernelTable tables[4];
  const int n = supported_tables(tables, 4);
  if (isa == "auto" || isa.empty()) return tables[0];
  std::string have;
  for (int i = 0; i < n; ++i) {
    if (isa == tables[i].name) return tables[i];
    have += (i ? ", " : "") + std::string(tables[i].name);
  }
  TORCH_CHECK_VALUE(false, "lightning_zero: CPU kernel path '", isa,
                    "' is not supported by this CPU or build; supported: ", have,
                    " (or 'auto'). Unset LIGHTNING_ZERO_CPU_ISA or pick one of those.");
}

void check_flat(const at::Tensor& t, const char* name, int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "lightning_zero: ", name, " must be a CPU tensor, got ",
                    t.device(), "; use FusedAdam/FusedLamb for device tensors");
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, "lightning_zero: ", name, " must be ", dtype,
                    ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == numel, "lightning_zero: ", name, " has ", t.numel(),
                    " elements but param has ", numel, "; pass tensors of the same size");
  TORCH_CHECK_VALUE(t.is_contiguous(), "lightning_zero: ", name,
                    " must be contiguous; call .contiguous() on it (and write the result back)");
}

void check_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                 int64_t step) {
  TORCH_CHECK_VALUE(lr >= 0.0, "lightning_zero: lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "lightning_zero: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "lightning_zero: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps >= 0.0, "lightning_zero: eps must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "lightning_zero: weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(step >= 1, "lightning_zero: step counts from 1 (the step being taken), got ", step);
}

// Bias corrections in double, as torch computes them in Python floats, then rounded once.
Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                 int64_t step, bool adamw_mode, bool bias_correction, double grad_scale, bool lamb) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, double(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, double(step)) : 1.0;
  Hyper h;
  h.beta2 = float(beta2);
  h.one_minus_beta1 = float(1.0 - beta1);
  h.one_minus_beta2 = float(1.0 - beta2);
  h.eps = float(eps);
  h.weight_decay = float(weight_decay);
  h.grad_scale = float(grad_scale);
  h.update_scale = float((lamb ? 1.0 : lr) / bc1);
  h.inv_bc2_sqrt = float(1.0 / std::sqrt(bc2));
  h.decay = float(1.0 - lr * weight_decay);
  h.adamw_mode = adamw_mode ? 1 : 0;
  h.beta1 = float(beta1);
  return h;
}

// allow_bf16_grad: the Adam kernel also takes a bf16 gradient (Buffers::grad_bf16)
Buffers make_buffers(const at::Tensor& param, const at::Tensor* grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_copy,
                     bool allow_bf16_grad = false) {
  const int64_t n = param.numel();
  check_flat(param, "param", n, at::kFloat);
  const bool bf16_grad = grad && allow_bf16_grad && grad->scalar_type() == at::kBFloat16;
  if (grad) check_flat(*grad, allow_bf16_grad ? "grad (float32 or bfloat16)" : "grad", n, bf16_grad ? at::kBFloat16 : at::kFloat);
  const at::ScalarType sd = exp_avg.scalar_type();
  TORCH_CHECK_VALUE(sd == at::kFloat || sd == at::kBFloat16,
                    "lightning_zero: exp_avg must be float32 or bfloat16, got ", sd);
  check_flat(exp_avg, "exp_avg", n, sd);
  check_flat(exp_avg_sq, "exp_avg_sq (must match exp_avg's dtype)", n, sd);
  Buffers b;
  b.param = param.data_ptr<float>();
  b.grad = grad && !bf16_grad ? grad->data_ptr<float>() : nullptr;
  b.grad_bf16 = bf16_grad ? static_cast<const uint16_t*>(grad->data_ptr()) : nullptr;
  b.exp_avg = exp_avg.data_ptr();
  b.exp_avg_sq = exp_avg_sq.data_ptr();
  b.state_dtype = sd == at::kBFloat16 ? StateDtype::kBFloat16 : StateDtype::kFloat32;
  b.param_copy = nullptr;
  b.copy_dtype = CopyDtype::kNone;
  if (param_copy.has_value()) {
    const at::ScalarType cd = param_copy->scalar_type();
    TORCH_CHECK_VALUE(cd == at::kBFloat16 || cd == at::kHalf,
                      "lightning_zero: param_copy must be bfloat16 or float16, got ", cd);
    check_flat(*param_copy, "param_copy", n, cd);
    b.param_copy = static_cast<uint16_t*>(param_copy->data_ptr());
    b.copy_dtype = cd == at::kBFloat16 ? CopyDtype::kBFloat16 : CopyDtype::kFloat16;
  }
  return b;
}

// Tiles of [0, n) that never cross a segment boundary, so each tile's norm belongs to one segment.
struct Tile {
  int64_t segment, begin, end;
};

std::vector<Tile> segment_tiles(const at::Tensor& offsets, int64_t n) {
  TORCH_CHECK_VALUE(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong &&
                        offsets.dim() == 1 && offsets.numel() >= 2,
                    "lightning_zero: segment_offsets must be a 1-D int64 CPU tensor [0, ..., n] with "
                    "at least 2 entries, got ", offsets.scalar_type(), " of shape ", offsets.sizes());
  const at::Tensor off = offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t s = off.numel() - 1;
  TORCH_CHECK_VALUE(o[0] == 0 && o[s] == n, "lightning_zero: segment_offsets must start at 0 and end ",
                    "at param.numel()=", n, ", got ", o[0], " and ", o[s]);
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < s; ++i) {
    TORCH_CHECK_VALUE(o[i] <= o[i + 1], "lightning_zero: segment_offsets must be non-decreasing, got ",
                      o[i], " then ", o[i + 1], " at index ", i);
    for (int64_t b = o[i]; b < o[i + 1]; b += TILE) tiles.push_back({i, b, std::min(b + TILE, o[i + 1])});
  }
  return tiles;
}

// One pass of a one-state kernel (Adagrad, Lion) over the tiles of [0, n), on torch's thread pool.
// Elementwise, so the result does not depend on the number of threads.
void run_onestate(OneStateRangeFn fn, const at::Tensor& param, const at::Tensor& grad,
                  const at::Tensor& state, const c10::optional<at::Tensor>& param_copy, const Hyper& h) {
  Buffers b = make_buffers(param, &grad, state, state, param_copy);
  b.exp_avg_sq = nullptr;  // one state only
  const int64_t n = param.numel();
  for_each_tile((n + TILE - 1) / TILE,
                [&](int64_t t) { fn(b, t * TILE, std::min(n, (t + 1) * TILE), h); });
}

}  // namespace

void cpu_adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                      const c10::optional<at::Tensor>& param_copy, double lr, double lr_decay,
                      double eps, double weight_decay, int64_t step, double grad_scale,
                      c10::string_view isa) {
  check_hyper(lr, 0.0, 0.0, eps, weight_decay, step);
  TORCH_CHECK_VALUE(lr_decay >= 0.0, "lightning_zero: lr_decay must be >= 0, got ", lr_decay);
  const KernelTable k = select_table(std::string(isa));
  Hyper h = make_hyper(lr, 0.0, 0.0, eps, weight_decay, step, false, false, grad_scale, false);
  h.update_scale = float(lr / (1.0 + double(step - 1) * lr_decay));  // torch's clr
  run_onestate(k.adagrad, param, grad, state_sum, param_copy, h);
}

void cpu_lion_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const c10::optional<at::Tensor>& param_copy, double lr, double beta1, double beta2,
                   double weight_decay, double grad_scale, c10::string_view isa) {
  check_hyper(lr, beta1, beta2, 0.0, weight_decay, 1);
  const KernelTable k = select_table(std::string(isa));
  const Hyper h = make_hyper(lr, beta1, beta2, 0.0, weight_decay, 1, true, false, grad_scale, false);
  run_onestate(k.lion, param, grad, exp_avg, param_copy, h);
}

// Chunks of the sum of squares handed to threads: whole NORM_BLOCKs (kernels_impl_norm.h), so the
// blocks, and the order their sums are added in (chunk by chunk, in order), are those of one thread.
constexpr int64_t NORM_CHUNK = int64_t(1) << 20;

at::Tensor cpu_sum_squares(const at::Tensor& x, c10::string_view isa) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "lightning_zero: sum_squares takes a CPU tensor, got ", x.device());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16,
                    "lightning_zero: sum_squares takes float32 or bfloat16, got ", dtype,
                    "; use the reference (lightning_zero.ops.reference.cpu_sum_squares) for other dtypes");
  TORCH_CHECK_VALUE(x.is_contiguous(), "lightning_zero: sum_squares needs a contiguous tensor; call .contiguous()");
  const KernelTable k = select_table(std::string(isa));
  const int64_t n = x.numel(), chunks = (n + NORM_CHUNK - 1) / NORM_CHUNK;
  const bool bf16 = dtype == at::kBFloat16;
  const void* data = x.data_ptr();
  std::vector<double> partial(chunks, 0.0);
  for_each_tile(chunks, [&](int64_t c) {
    partial[c] = k.sum_squares(data, bf16, c * NORM_CHUNK, std::min(n, (c + 1) * NORM_CHUNK));
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return at::scalar_tensor(total, x.options().dtype(at::kFloat));
}

std::vector<std::string> cpu_supported_isas() {
  KernelTable tables[4];
  const int n = supported_tables(tables, 4);
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.emplace_back(tables[i].name);
  return names;
}

void cpu_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_copy,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   int64_t step, bool adamw_mode, bool bias_correction, double grad_scale,
                   c10::string_view isa) {
  check_hyper(lr, beta1, beta2, eps, weight_decay, step);
  const KernelTable k = select_table(std::string(isa));
  const Buffers b = make_buffers(param, &grad, exp_avg, exp_avg_sq, param_copy, /*allow_bf16_grad=*/true);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, adamw_mode,
                             bias_correction, grad_scale, false);
  const int64_t n = param.numel();
  for_each_tile((n + TILE - 1) / TILE,
                [&](int64_t t) { k.adam(b, t * TILE, std::min(n, (t + 1) * TILE), h); });
}

at::Tensor cpu_lamb_moments(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const at::Tensor& segment_offsets, double beta1, double beta2,
                            double eps, double weight_decay, int64_t step, bool bias_correction,
                            double grad_scale, c10::string_view isa) {
  check_hyper(0.0, beta1, beta2, eps, weight_decay, step);
  const KernelTable k = select_table(std::string(isa));
  const Buffers b = make_buffers(param, &grad, exp_avg, exp_avg_sq, c10::nullopt);
  const Hyper h = make_hyper(0.0, beta1, beta2, eps, weight_decay, step, true, bias_correction,
                             grad_scale, true);
  const std::vector<Tile> tiles = segment_tiles(segment_offsets, param.numel());
  std::vector<double> partial(2 * tiles.size(), 0.0);
  for_each_tile(int64_t(tiles.size()), [&](int64_t t) {
    k.lamb_moments(b, tiles[t].begin, tiles[t].end, h, &partial[2 * t]);
  });
  std::vector<double> sums(2 * (segment_offsets.numel() - 1), 0.0);
  for (size_t t = 0; t < tiles.size(); ++t) {
    sums[2 * tiles[t].segment] += partial[2 * t];
    sums[2 * tiles[t].segment + 1] += partial[2 * t + 1];
  }
  at::Tensor out = at::empty({segment_offsets.numel() - 1, 2}, param.options());
  float* o = out.data_ptr<float>();
  for (size_t i = 0; i < sums.size(); ++i) o[i] = float(sums[i]);
  return out;
}

void cpu_lamb_apply(const at::Tensor& param, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& segment_offsets,
                    const at::Tensor& trust_ratio, const c10::optional<at::Tensor>& param_copy,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    int64_t step, bool bias_correction, c10::string_view isa) {
  check_hyper(lr, beta1, beta2, eps, weight_decay, step);
  const KernelTable k = select_table(std::string(isa));
  const Buffers b = make_buffers(param, nullptr, exp_avg, exp_avg_sq, param_copy);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, true, bias_correction,
                             1.0, true);
  const std::vector<Tile> tiles = segment_tiles(segment_offsets, param.numel());
  check_flat(trust_ratio, "trust_ratio", segment_offsets.numel() - 1, at::kFloat);
  const float* trust = trust_ratio.data_ptr<float>();
  for_each_tile(int64_t(tiles.size()), [&](int64_t t) {
    k.lamb_apply(b, tiles[t].begin, tiles[t].end, h, float(lr) * trust[tiles[t].segment]);
  });
}

}  // namespace cpu
}  // namespace lightning_zero
