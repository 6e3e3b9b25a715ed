// TransNeXt's aggregated attention on the CPU, forward and backward, with no window copies
// (moh_vision/models/aggregated_attention.py has the formula, builds this file and registers it as the CPU
// kernel of torch.ops.moh_vision.aggregated_attention and its backward).
//
// Per query n of image b, head h (tensors contiguous, float32 or float64):
//   s_l = q . k[n + o_l] + local_bias[l]  (slots outside the map: -inf),  s_p = q . k_pool[p] + pool_bias[n, p]
//   a = softmax([s_l, s_p]),  lse = log sum exp,  out = sum_l (a_l + local_weight_l) v[n + o_l] + sum_p a_p v_pool[p]
// Backward recomputes a = exp(s - lse). With g_l = grad . v[n + o_l], g_p = grad . v_pool[p] and
// delta = sum a g, ds = a (g - delta):
//   dq = sum_l ds_l k[n + o_l] + sum_p ds_p k_pool[p];  dk[n + o_l] += ds_l q;  dv[n + o_l] += (a_l + w_l) grad
//   dk_pool = ds_p^T q;  dv_pool = a_p^T grad;  d pool_bias[n, p] = sum_b ds_p;  d local_bias[l] = sum_{b,n} ds_l
//   d local_weight[n, l] = g_l
// Loops walk the (query, window slot) pairs for what reads or writes neighbours (the window logits, the local value
// sum, g_l and the scatters into dk / dv), one task per (image, head) so that the scatters stay inside it; the
// pooled keys' products are batched GEMMs and the softmax algebra (exponentials, sums, delta) vectorised ATen
// operators, in the inputs' dtype whatever autocast says.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

template <typename T>
inline T dot(const T* __restrict__ a, const T* __restrict__ b, int64_t d) {
  T acc[4] = {0, 0, 0, 0};  // four chains: the compiler may not reorder one float sum
  int64_t i = 0;
  for (; i + 4 <= d; i += 4) {
    for (int64_t j = 0; j < 4; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (; i < d; ++i) acc[0] += a[i] * b[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T>
inline void axpy(T alpha, const T* __restrict__ x, T* __restrict__ y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += alpha * x[i];
}

struct Geometry {
  int64_t batch, heads, tokens, pool, dim, height, width, window, slots;
};

Geometry check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
               const at::Tensor& v_pool, const at::Tensor& pool_bias, const at::Tensor& local_bias,
               const at::Tensor& local_weight, int64_t height, int64_t width, int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "moh_aggregated: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4, "moh_aggregated: q must be [B, h, N, d], k_pool [B, h, P, d]");
  Geometry g{q.size(0), q.size(1), q.size(2), k_pool.size(2), q.size(3), height, width, window, window * window};
  TORCH_CHECK(window > 0 && window % 2 == 1, "moh_aggregated: the window must be odd");
  TORCH_CHECK(height * width == g.tokens, "moh_aggregated: ", height, " x ", width, " is not ", g.tokens, " tokens");
  for (const at::Tensor* t : {&q, &k, &v, &k_pool, &v_pool, &pool_bias, &local_bias, &local_weight}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type(),
                "moh_aggregated: inputs must be contiguous and of one dtype");
  }
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "moh_aggregated: k, v must be shaped as q");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.size(0) == g.batch && k_pool.size(1) == g.heads &&
                  k_pool.size(3) == g.dim, "moh_aggregated: k_pool, v_pool must be [B, h, P, d]");
  TORCH_CHECK(pool_bias.numel() == g.heads * g.tokens * g.pool, "moh_aggregated: pool_bias must be [h, N, P]");
  TORCH_CHECK(local_bias.numel() == g.heads * g.slots, "moh_aggregated: local_bias must be [h, L]");
  TORCH_CHECK(local_weight.numel() == g.batch * g.heads * g.tokens * g.slots,
              "moh_aggregated: local_weight must be [B, h, N, L]");
  return g;
}

// x [B, h, N, d] times each pooled key's or value's row, [B, h, N, P] (a batched GEMM). The pooled rows are
// transposed into a contiguous [B, h, d, P] first: at::matmul with the transposed view ran 2.3x slower at
// TransNeXt-T's first stage (N = 3136, P = 49). The operators' GEMMs run in the inputs' dtype, also where autocast
// is on (it would give them in bf16).
at::Tensor times_pooled(const at::Tensor& x, const at::Tensor& pooled) {
  return at::matmul(x, pooled.transpose(-2, -1).contiguous());
}

// The pooled logits of every query, [B, h, N, P].
at::Tensor pooled_logits(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& pool_bias) {
  return times_pooled(q, k_pool).add_(pool_bias.view({1, pool_bias.size(0), pool_bias.size(1), pool_bias.size(2)}));
}

// Per (image, head) task bh, per query n and window slot l with an in-map neighbour m: fn(bh, n, l, m), the map
// walked row by row (no divisions per pair).
template <typename Fn>
void for_each_window(const Geometry& g, const Fn& fn) {
  const int64_t r = g.window / 2;
  at::parallel_for(0, g.batch * g.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t y = 0; y < g.height; ++y) {
        const int64_t i_first = std::max<int64_t>(0, r - y), i_last = std::min(g.window, g.height + r - y);
        for (int64_t x = 0; x < g.width; ++x) {
          const int64_t n = y * g.width + x;
          const int64_t j_first = std::max<int64_t>(0, r - x), j_last = std::min(g.window, g.width + r - x);
          for (int64_t i = i_first; i < i_last; ++i) {
            const int64_t row = (y + i - r) * g.width + x - r;
            for (int64_t j = j_first; j < j_last; ++j) fn(bh, n, i * g.window + j, row + j);
          }
        }
      }
    }
  });
}

// The window logits [B, h, N, L] (-inf outside the map): q . k[n + o_l] + local_bias[l].
template <typename T>
at::Tensor window_logits(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& local_bias) {
  at::Tensor s = at::full({g.batch, g.heads, g.tokens, g.slots}, -std::numeric_limits<double>::infinity(),
                          q.options());
  const T *qp = q.const_data_ptr<T>(), *kp = k.const_data_ptr<T>(), *lb = local_bias.const_data_ptr<T>();
  T* sp = s.data_ptr<T>();
  for_each_window(g, [&](int64_t bh, int64_t n, int64_t l, int64_t m) {
    const int64_t rows = bh * g.tokens * g.dim;
    sp[(bh * g.tokens + n) * g.slots + l] =
        dot(qp + rows + n * g.dim, kp + rows + m * g.dim, g.dim) + lb[(bh % g.heads) * g.slots + l];
  });
  return s;
}

// The largest logit of each query, [B, h, N, 1], over its window's and its pooled ones (a loop: ATen's max over
// a last dimension of 9 or 49 took a quarter of the forward).
template <typename T>
at::Tensor largest(const at::Tensor& s_local, const at::Tensor& s_pool) {
  const int64_t rows = s_local.numel() / s_local.size(-1), L = s_local.size(-1), P = s_pool.size(-1);
  std::vector<int64_t> shape(s_local.sizes().begin(), s_local.sizes().end());
  shape.back() = 1;
  at::Tensor top = at::empty(shape, s_local.options());
  const T *a = s_local.const_data_ptr<T>(), *b = s_pool.const_data_ptr<T>();
  T* out = top.data_ptr<T>();
  at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < L; ++j) m = std::max(m, a[r * L + j]);
      for (int64_t j = 0; j < P; ++j) m = std::max(m, b[r * P + j]);
      out[r] = m;
    }
  });
  return top;
}

// The attention from the logits: its local part [B, h, N, L] and pooled part [B, h, N, P] (the exponentials as
// vectorised ATen operators rather than one libm exp a logit in the loops).
std::tuple<at::Tensor, at::Tensor> exponentials(at::Tensor s_local, at::Tensor s_pool, const at::Tensor& shift) {
  return {s_local.sub_(shift).exp_(), s_pool.sub_(shift).exp_()};
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& k_pool, const at::Tensor& v_pool,
                                           const at::Tensor& pool_bias, const at::Tensor& local_bias,
                                           const at::Tensor& local_weight, int64_t height, int64_t width,
                                           int64_t window) {
  const Geometry g = check(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::Tensor s_local, top, s_pool = pooled_logits(q, k_pool, pool_bias);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "moh_aggregated_logits", [&] {
    s_local = window_logits<scalar_t>(g, q, k, local_bias);
    top = largest<scalar_t>(s_local, s_pool);
  });
  auto [e_local, e_pool] = exponentials(s_local, s_pool, top);
  at::Tensor total = e_local.sum(-1, true).add_(e_pool.sum(-1, true));
  at::Tensor weight = e_local.div_(total).add_(local_weight);  // a_l + w_l (outside the map: v reads nothing)
  at::Tensor out = at::matmul(e_pool.div_(total), v_pool);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "moh_aggregated_forward", [&] {
    using T = scalar_t;
    const T *wp = weight.const_data_ptr<T>(), *vp = v.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    for_each_window(g, [&](int64_t bh, int64_t n, int64_t l, int64_t m) {
      const int64_t rows = bh * g.tokens * g.dim;
      axpy(wp[(bh * g.tokens + n) * g.slots + l], vp + rows + m * g.dim, op + rows + n * g.dim, g.dim);
    });
  });
  return {out, top.add_(total.log_()).squeeze(-1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
    const at::Tensor& v_pool, const at::Tensor& pool_bias, const at::Tensor& local_bias,
    const at::Tensor& local_weight, const at::Tensor& lse, int64_t height, int64_t width, int64_t window) {
  const Geometry g = check(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window);
  TORCH_CHECK(grad.sizes() == q.sizes() && grad.is_contiguous() && grad.scalar_type() == q.scalar_type() &&
                  lse.is_contiguous() && lse.scalar_type() == q.scalar_type() &&
                  lse.numel() == g.batch * g.heads * g.tokens,
              "moh_aggregated: grad must be contiguous and shaped as q, lse [B, h, N], both of q's dtype");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::Tensor s_local, g_local = at::zeros({g.batch, g.heads, g.tokens, g.slots}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "moh_aggregated_backward_logits", [&] {
    using T = scalar_t;
    s_local = window_logits<T>(g, q, k, local_bias);
    const T *gp = grad.const_data_ptr<T>(), *vp = v.const_data_ptr<T>();
    T* glp = g_local.data_ptr<T>();
    for_each_window(g, [&](int64_t bh, int64_t n, int64_t l, int64_t m) {  // g_l = grad . v[n + o_l]
      const int64_t rows = bh * g.tokens * g.dim;
      glp[(bh * g.tokens + n) * g.slots + l] = dot(gp + rows + n * g.dim, vp + rows + m * g.dim, g.dim);
    });
  });
  auto [a_local, a_pool] = exponentials(s_local, pooled_logits(q, k_pool, pool_bias), lse.unsqueeze(-1));
  at::Tensor g_pool = times_pooled(grad, v_pool);  // g_p = grad . v_pool[p]
  at::Tensor delta = a_local.mul(g_local).sum(-1, true).add_(a_pool.mul(g_pool).sum(-1, true));
  // ds = a (g - delta), each in one new buffer or in g_pool's (g_local is itself a gradient the op returns)
  at::Tensor ds_local = g_local.sub(delta).mul_(a_local), ds_pool = g_pool.sub_(delta).mul_(a_pool);
  at::Tensor weight = a_local.add_(local_weight);  // a_l + w_l
  at::Tensor dq = at::matmul(ds_pool, k_pool), dk = at::zeros(q.sizes(), q.options()),
             dv = at::zeros(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "moh_aggregated_backward", [&] {
    using T = scalar_t;
    const T *qp = q.const_data_ptr<T>(), *kp = k.const_data_ptr<T>(), *gp = grad.const_data_ptr<T>();
    const T *dsp = ds_local.const_data_ptr<T>(), *wp = weight.const_data_ptr<T>();
    T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
    for_each_window(g, [&](int64_t bh, int64_t n, int64_t l, int64_t m) {  // one task per (image, head): no race
      const int64_t rows = bh * g.tokens * g.dim, slot = (bh * g.tokens + n) * g.slots + l;
      axpy(dsp[slot], kp + rows + m * g.dim, dqp + rows + n * g.dim, g.dim);
      axpy(dsp[slot], qp + rows + n * g.dim, dkp + rows + m * g.dim, g.dim);
      axpy(wp[slot], gp + rows + n * g.dim, dvp + rows + m * g.dim, g.dim);
    });
  });
  return {dq, dk, dv, at::matmul(ds_pool.transpose(-2, -1), q), at::matmul(a_pool.transpose(-2, -1), grad),
          ds_pool.sum(0), ds_local.sum(at::IntArrayRef{0, 2}), g_local};
}

}  // namespace

TORCH_LIBRARY(moh_aggregated, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor pool_bias, Tensor local_bias, "
        "Tensor local_weight, int height, int width, int window) -> (Tensor, Tensor)");
  m.def("backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor pool_bias, "
        "Tensor local_bias, Tensor local_weight, Tensor lse, int height, int width, int window) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moh_aggregated, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
