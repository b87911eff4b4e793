// Sum of squares of one range (the gradient norm's host part, lightning_zero/zero/swap_grads.py),
// over the same vector type `V` as kernels_impl.h (included first: R, load_grad). fp32 or bf16
// input (bf16 widened in registers, exact), one read of the range: the bf16 gradient slices of the
// disk tier need no fp32 copy, and a slice gives the same sum as its fp32 cast, bit for bit.
// Order (fixed, so the result depends on the ISA only, never on threads): blocks of NORM_BLOCK
// elements, each into four vector accumulators of fp32 (a 4W-element stride, then single vectors,
// then a zero-padded tail), lanes added in order (V::hsum); the block sums add up in double.

namespace {

enum : int64_t { NORM_BLOCK = 4096 };

template <typename G>
inline float sum_squares_block(const G* x, int64_t begin, int64_t end) {
  R a0 = V::set1(0.0f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = begin;
  for (; i + 4 * V::W <= end; i += 4 * V::W) {
    const R x0 = load_grad(x + i), x1 = load_grad(x + i + V::W);
    const R x2 = load_grad(x + i + 2 * V::W), x3 = load_grad(x + i + 3 * V::W);
    a0 = V::fmadd(x0, x0, a0);
    a1 = V::fmadd(x1, x1, a1);
    a2 = V::fmadd(x2, x2, a2);
    a3 = V::fmadd(x3, x3, a3);
  }
  for (; i + V::W <= end; i += V::W) {
    const R x0 = load_grad(x + i);
    a0 = V::fmadd(x0, x0, a0);
  }
  if (i < end) {
    G tail[V::W];
    for (int j = 0; j < V::W; ++j) tail[j] = i + j < end ? x[i + j] : G(0);  // bf16 bits 0: +0.0
    const R x0 = load_grad(tail);
    a0 = V::fmadd(x0, x0, a0);
  }
  return V::hsum(V::add(V::add(a0, a1), V::add(a2, a3)));
}

template <typename G>
inline double sum_squares_t(const G* x, int64_t begin, int64_t end) {
  double total = 0.0;
  for (int64_t b = begin; b < end; b += NORM_BLOCK)
    total += sum_squares_block(x, b, b + NORM_BLOCK < end ? b + NORM_BLOCK : end);
  return total;
}

double sum_squares_range(const void* x, bool bf16, int64_t begin, int64_t end) {
  if (bf16) return sum_squares_t(static_cast<const uint16_t*>(x), begin, end);
  return sum_squares_t(static_cast<const float*>(x), begin, end);
}

}  // namespace
