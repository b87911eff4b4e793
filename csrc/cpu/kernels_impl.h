// The Adam/LAMB element loops, written once over a vector type `V` that each ISA unit defines
// before including this file (in an anonymous namespace, see kernels.h for why):
//   V::W lanes; V::R register; load/store (fp32), load_bf16/store_bf16, store_fp16;
//   set1, add, sub, mul, div, sqrt, fmadd(a, b, c) = a * b + c, fnmadd(a, b, c) = c - a * b;
//   hsum (horizontal sum to float).
// The arithmetic follows torch.optim.AdamW's order of operations (lerp for exp_avg, mul then
// addcmul for exp_avg_sq, sqrt(v) / sqrt(bc2) + eps) so that results agree to a few ulp.
// Tails shorter than one vector go through zero-padded stack buffers, so there is one code path.

namespace {

using lightning_zero::cpu::Buffers;
using lightning_zero::cpu::CopyDtype;
using lightning_zero::cpu::Hyper;
using lightning_zero::cpu::StateDtype;
typedef V::R R;

inline R load_state(const float* p) { return V::load(p); }
inline R load_state(const uint16_t* p) { return V::load_bf16(p); }
inline void store_state(float* p, R x) { V::store(p, x); }
inline void store_state(uint16_t* p, R x) { V::store_bf16(p, x); }
// Gradients: fp32, or bf16 (Adam on a bf16 gradient slice: widening is exact, so the step is the
// one it takes on that slice cast to fp32 first, without the fp32 copy)
inline R load_grad(const float* p) { return V::load(p); }
inline R load_grad(const uint16_t* p) { return V::load_bf16(p); }
template <typename G>
inline const G* grad_of(const Buffers& b);
template <>
inline const float* grad_of<float>(const Buffers& b) { return b.grad; }
template <>
inline const uint16_t* grad_of<uint16_t>(const Buffers& b) { return b.grad_bf16; }

template <CopyDtype C>
inline void store_copy(uint16_t* p, R x) {
  if (C == CopyDtype::kBFloat16) V::store_bf16(p, x);
  if (C == CopyDtype::kFloat16) V::store_fp16(p, x);
}

// The copy pointer is null when no copy is asked for; offsetting null would be undefined behaviour.
template <CopyDtype C>
inline uint16_t* copy_at(const Buffers& b, int64_t i) {
  return C == CopyDtype::kNone ? nullptr : b.param_copy + i;
}

// Broadcast constants, built once per range rather than once per vector.
struct Consts {
  R beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, grad_scale, update_scale,
      inv_bc2_sqrt, decay;
  int adamw;
  explicit Consts(const Hyper& h)
      : beta2(V::set1(h.beta2)), one_minus_beta1(V::set1(h.one_minus_beta1)),
        one_minus_beta2(V::set1(h.one_minus_beta2)), eps(V::set1(h.eps)),
        weight_decay(V::set1(h.weight_decay)), grad_scale(V::set1(h.grad_scale)),
        update_scale(V::set1(h.update_scale)), inv_bc2_sqrt(V::set1(h.inv_bc2_sqrt)),
        decay(V::set1(h.decay)), adamw(h.adamw_mode) {}
};

// exp_avg and exp_avg_sq after one step; the fp32 values (not their bf16 rounding) feed the update.
template <typename S>
inline void update_moments(R grad, S* m, S* v, const Consts& k, R& mm, R& vv) {
  mm = load_state(m);
  vv = load_state(v);
  mm = V::fmadd(k.one_minus_beta1, V::sub(grad, mm), mm);  // torch: exp_avg.lerp_(grad, 1 - beta1)
  vv = V::fmadd(k.one_minus_beta2, V::mul(grad, grad), V::mul(vv, k.beta2));
  store_state(m, mm);
  store_state(v, vv);
}

inline R denom_of(R vv, const Consts& k) { return V::fmadd(V::sqrt(vv), k.inv_bc2_sqrt, k.eps); }

template <typename S, CopyDtype C, typename G>
inline void adam_vec(float* p, const G* g, S* m, S* v, uint16_t* out, const Consts& k) {
  R param = V::load(p);
  R grad = V::mul(load_grad(g), k.grad_scale);
  if (!k.adamw) grad = V::fmadd(param, k.weight_decay, grad);  // Adam: L2 term joins the gradient
  R mm, vv;
  update_moments(grad, m, v, k, mm, vv);
  if (k.adamw) param = V::mul(param, k.decay);  // AdamW decays before the update, as torch does
  param = V::fnmadd(k.update_scale, V::div(mm, denom_of(vv, k)), param);
  V::store(p, param);
  store_copy<C>(out, param);
}

// LAMB update direction: m_hat / (sqrt(v_hat) + eps) + weight_decay * param.
inline R lamb_update(R param, R mm, R vv, const Consts& k) {
  return V::fmadd(param, k.weight_decay, V::mul(V::div(mm, denom_of(vv, k)), k.update_scale));
}

template <typename S>
inline void lamb_moments_vec(const float* p, const float* g, S* m, S* v, const Consts& k,
                             R& param, R& upd) {
  param = V::load(p);
  R grad = V::mul(V::load(g), k.grad_scale);
  R mm, vv;
  update_moments(grad, m, v, k, mm, vv);
  upd = lamb_update(param, mm, vv, k);
}

template <typename S, CopyDtype C>
inline void lamb_apply_vec(float* p, const S* m, const S* v, uint16_t* out, const Consts& k,
                           R lr_trust) {
  R param = V::load(p);
  param = V::fnmadd(lr_trust, lamb_update(param, load_state(m), load_state(v), k), param);
  V::store(p, param);
  store_copy<C>(out, param);
}

// Zero-padded copies of a tail shorter than one vector; written back after the vector step.
// G: the gradient's element type (float, or uint16_t for bf16 bits: 0 is +0.0 in both).
template <typename S, typename G = float>
struct Tail {
  float p[V::W];
  G g[V::W];
  S m[V::W], v[V::W];
  uint16_t out[V::W];
  int64_t n;
  Tail(const Buffers& b, int64_t i, int64_t n_) : n(n_) {
    const G* grad = grad_of<G>(b);
    for (int j = 0; j < V::W; ++j) {
      bool in = j < n;
      p[j] = in ? b.param[i + j] : 0.0f;
      g[j] = (in && grad) ? grad[i + j] : G(0);
      m[j] = in ? static_cast<S*>(b.exp_avg)[i + j] : S(0);
      v[j] = in ? static_cast<S*>(b.exp_avg_sq)[i + j] : S(0);
      out[j] = 0;
    }
  }
  void write_back(const Buffers& b, int64_t i) const {
    for (int64_t j = 0; j < n; ++j) {
      b.param[i + j] = p[j];
      static_cast<S*>(b.exp_avg)[i + j] = m[j];
      static_cast<S*>(b.exp_avg_sq)[i + j] = v[j];
      if (b.param_copy) b.param_copy[i + j] = out[j];
    }
  }
};

template <typename S, CopyDtype C, typename G>
void adam_range_t(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  const Consts k(h);
  S* m = static_cast<S*>(b.exp_avg);
  S* v = static_cast<S*>(b.exp_avg_sq);
  const G* g = grad_of<G>(b);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W)
    adam_vec<S, C, G>(b.param + i, g + i, m + i, v + i, copy_at<C>(b, i), k);
  if (i < end) {
    Tail<S, G> t(b, i, end - i);
    adam_vec<S, C, G>(t.p, t.g, t.m, t.v, t.out, k);
    t.write_back(b, i);
  }
}

template <typename S>
void lamb_moments_range_t(const Buffers& b, int64_t begin, int64_t end, const Hyper& h,
                          double* sums) {
  const Consts k(h);
  S* m = static_cast<S*>(b.exp_avg);
  S* v = static_cast<S*>(b.exp_avg_sq);
  R acc_p = V::set1(0.0f), acc_u = V::set1(0.0f), param, upd;
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) {
    lamb_moments_vec(b.param + i, b.grad + i, m + i, v + i, k, param, upd);
    acc_p = V::fmadd(param, param, acc_p);
    acc_u = V::fmadd(upd, upd, acc_u);
  }
  double sp = V::hsum(acc_p), su = V::hsum(acc_u);
  if (i < end) {
    // padded lanes are summed out by hand: with eps == 0 their update would be 0 / 0
    Tail<S> t(b, i, end - i);
    lamb_moments_vec(t.p, t.g, t.m, t.v, k, param, upd);
    float pl[V::W], ul[V::W];
    V::store(pl, param);
    V::store(ul, upd);
    for (int64_t j = 0; j < t.n; ++j) {
      sp += double(pl[j]) * pl[j];
      su += double(ul[j]) * ul[j];
    }
    t.write_back(b, i);
  }
  sums[0] += sp;
  sums[1] += su;
}

template <typename S, CopyDtype C>
void lamb_apply_range_t(const Buffers& b, int64_t begin, int64_t end, const Hyper& h,
                        float lr_trust) {
  const Consts k(h);
  const R lt = V::set1(lr_trust);
  const S* m = static_cast<const S*>(b.exp_avg);
  const S* v = static_cast<const S*>(b.exp_avg_sq);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W)
    lamb_apply_vec<S, C>(b.param + i, m + i, v + i, copy_at<C>(b, i), k, lt);
  if (i < end) {
    Tail<S> t(b, i, end - i);
    lamb_apply_vec<S, C>(t.p, t.m, t.v, t.out, k, lt);
    t.write_back(b, i);
  }
}

// Runtime dtype switches -> compile-time template arguments, once per range.
template <typename S, typename G>
void adam_by_copy(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  switch (b.copy_dtype) {
    case CopyDtype::kNone: return adam_range_t<S, CopyDtype::kNone, G>(b, begin, end, h);
    case CopyDtype::kBFloat16: return adam_range_t<S, CopyDtype::kBFloat16, G>(b, begin, end, h);
    case CopyDtype::kFloat16: return adam_range_t<S, CopyDtype::kFloat16, G>(b, begin, end, h);
  }
}

template <typename G>
void adam_by_state(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  if (b.state_dtype == StateDtype::kBFloat16) return adam_by_copy<uint16_t, G>(b, begin, end, h);
  adam_by_copy<float, G>(b, begin, end, h);
}

void adam_range(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  if (b.grad_bf16) return adam_by_state<uint16_t>(b, begin, end, h);
  adam_by_state<float>(b, begin, end, h);
}

void lamb_moments_range(const Buffers& b, int64_t begin, int64_t end, const Hyper& h,
                        double* sums) {
  if (b.state_dtype == StateDtype::kBFloat16)
    return lamb_moments_range_t<uint16_t>(b, begin, end, h, sums);
  lamb_moments_range_t<float>(b, begin, end, h, sums);
}

template <typename S>
void lamb_apply_by_copy(const Buffers& b, int64_t begin, int64_t end, const Hyper& h, float lt) {
  switch (b.copy_dtype) {
    case CopyDtype::kNone: return lamb_apply_range_t<S, CopyDtype::kNone>(b, begin, end, h, lt);
    case CopyDtype::kBFloat16:
      return lamb_apply_range_t<S, CopyDtype::kBFloat16>(b, begin, end, h, lt);
    case CopyDtype::kFloat16:
      return lamb_apply_range_t<S, CopyDtype::kFloat16>(b, begin, end, h, lt);
  }
}

void lamb_apply_range(const Buffers& b, int64_t begin, int64_t end, const Hyper& h, float lt) {
  if (b.state_dtype == StateDtype::kBFloat16) return lamb_apply_by_copy<uint16_t>(b, begin, end, h, lt);
  lamb_apply_by_copy<float>(b, begin, end, h, lt);
}

}  // namespace
