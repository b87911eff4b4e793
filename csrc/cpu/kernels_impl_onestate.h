// The Adagrad and Lion element loops: optimizers with one state tensor (Buffers::exp_avg), written
// over the same vector type `V` as kernels_impl.h (which is included first and provides R,
// load_state/store_state, store_copy and copy_at). One pass per element: gradient times grad_scale
// (unscale x clip coefficient), state update, parameter update, optional 16-bit copy of the result.
// Arithmetic in the order of the readable references (lightning_zero/ops/reference.py):
//   Adagrad (torch.optim.Adagrad): g += wd * p; s += g * g; p -= clr * g / (sqrt(s) + eps)
//   Lion (Chen et al. 2023, Alg. 2): c = b1 * m + (1 - b1) * g; p = p * (1 - lr * wd) - lr * sign(c);
//                                   m = b2 * m + (1 - b2) * g

namespace {

// Zero-padded copy of a tail shorter than one vector for the one-state kernels (Tail in
// kernels_impl.h writes back exp_avg_sq too, which these kernels do not have).
template <typename S>
struct Tail1 {
  float p[V::W], g[V::W];
  S s[V::W];
  uint16_t out[V::W];
  int64_t n;
  Tail1(const Buffers& b, int64_t i, int64_t n_) : n(n_) {
    for (int j = 0; j < V::W; ++j) {
      bool in = j < n;
      p[j] = in ? b.param[i + j] : 0.0f;
      g[j] = in ? b.grad[i + j] : 0.0f;
      s[j] = in ? static_cast<S*>(b.exp_avg)[i + j] : S(0);
      out[j] = 0;
    }
  }
  void write_back(const Buffers& b, int64_t i) const {
    for (int64_t j = 0; j < n; ++j) {
      b.param[i + j] = p[j];
      static_cast<S*>(b.exp_avg)[i + j] = s[j];
      if (b.param_copy) b.param_copy[i + j] = out[j];
    }
  }
};

template <typename S, CopyDtype C>
inline void adagrad_vec(float* p, const float* g, S* s, uint16_t* out, const Consts& k) {
  R param = V::load(p);
  R grad = V::mul(V::load(g), k.grad_scale);
  grad = V::fmadd(param, k.weight_decay, grad);  // L2 decay joins the gradient (0 when wd == 0)
  R sum = V::fmadd(grad, grad, load_state(s));
  store_state(s, sum);
  param = V::fnmadd(k.update_scale, V::div(grad, V::add(V::sqrt(sum), k.eps)), param);
  V::store(p, param);
  store_copy<C>(out, param);
}

template <typename S, CopyDtype C>
inline void lion_vec(float* p, const float* g, S* m, uint16_t* out, const Consts& k, R beta1) {
  R param = V::load(p);
  R grad = V::mul(V::load(g), k.grad_scale);
  R mm = load_state(m);
  R c = V::fmadd(beta1, mm, V::mul(k.one_minus_beta1, grad));
  param = V::fnmadd(k.update_scale, V::sign(c), V::mul(param, k.decay));
  store_state(m, V::fmadd(k.beta2, mm, V::mul(k.one_minus_beta2, grad)));
  V::store(p, param);
  store_copy<C>(out, param);
}

template <typename S, CopyDtype C, bool LION>
void onestate_range_t(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  const Consts k(h);
  const R beta1 = V::set1(h.beta1);
  S* s = static_cast<S*>(b.exp_avg);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) {
    if (LION) lion_vec<S, C>(b.param + i, b.grad + i, s + i, copy_at<C>(b, i), k, beta1);
    else adagrad_vec<S, C>(b.param + i, b.grad + i, s + i, copy_at<C>(b, i), k);
  }
  if (i < end) {
    Tail1<S> t(b, i, end - i);
    if (LION) lion_vec<S, C>(t.p, t.g, t.s, t.out, k, beta1);
    else adagrad_vec<S, C>(t.p, t.g, t.s, t.out, k);
    t.write_back(b, i);
  }
}

template <typename S, bool LION>
void onestate_by_copy(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  switch (b.copy_dtype) {
    case CopyDtype::kNone: return onestate_range_t<S, CopyDtype::kNone, LION>(b, begin, end, h);
    case CopyDtype::kBFloat16: return onestate_range_t<S, CopyDtype::kBFloat16, LION>(b, begin, end, h);
    case CopyDtype::kFloat16: return onestate_range_t<S, CopyDtype::kFloat16, LION>(b, begin, end, h);
  }
}

void adagrad_range(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  if (b.state_dtype == StateDtype::kBFloat16) return onestate_by_copy<uint16_t, false>(b, begin, end, h);
  onestate_by_copy<float, false>(b, begin, end, h);
}

void lion_range(const Buffers& b, int64_t begin, int64_t end, const Hyper& h) {
  if (b.state_dtype == StateDtype::kBFloat16) return onestate_by_copy<uint16_t, true>(b, begin, end, h);
  onestate_by_copy<float, true>(b, begin, end, h);
}

}  // namespace
