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
// The pooled keys' products are batched GEMMs (s_p, g_p before the loop over queries; out, dq, dk_pool, dv_pool
// after it), the window's are per query in the loop; one task per (image, head), so the scatters into dk / dv
// stay inside it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

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

// The pooled logits of every query, [B, h, N, P] (a batched GEMM: BLAS does the P x d products). The operators'
// GEMMs run in the inputs' dtype, also where autocast is on (it would give them in bf16).
at::Tensor pooled_logits(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& pool_bias) {
  return at::matmul(q, k_pool.transpose(-2, -1)).add_(pool_bias.view({1, pool_bias.size(0), pool_bias.size(1),
                                                                      pool_bias.size(2)}));
}

// The window logits of query n into s[0..L) (slots outside the map: -inf) and their token indices into nb
// (-1 outside); returns the largest of them and of the query's pooled logits ``pooled``.
template <typename T>
T local_logits(const Geometry& g, int64_t n, const T* q, const T* k, const T* local_bias, const T* pooled, T* s,
               int64_t* nb) {
  const int64_t y = n / g.width, x = n % g.width, r = g.window / 2;
  T top = -std::numeric_limits<T>::infinity();
  for (int64_t l = 0; l < g.slots; ++l) {
    const int64_t yy = y + l / g.window - r, xx = x + l % g.window - r;
    if (yy < 0 || yy >= g.height || xx < 0 || xx >= g.width) {
      nb[l] = -1;
      s[l] = -std::numeric_limits<T>::infinity();
      continue;
    }
    nb[l] = yy * g.width + xx;
    s[l] = dot(q, k + nb[l] * g.dim, g.dim) + local_bias[l];
    top = std::max(top, s[l]);
  }
  for (int64_t p = 0; p < g.pool; ++p) top = std::max(top, pooled[p]);
  return top;
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& k_pool, const at::Tensor& v_pool,
                                           const at::Tensor& pool_bias, const at::Tensor& local_bias,
                                           const at::Tensor& local_weight, int64_t height, int64_t width,
                                           int64_t window) {
  const Geometry g = check(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::Tensor attn_pool = pooled_logits(q, k_pool, pool_bias);  // becomes the pooled attention, in place
  at::Tensor out = at::zeros(q.sizes(), q.options());
  at::Tensor lse = at::empty({g.batch, g.heads, g.tokens}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "moh_aggregated_forward", [&] {
    using T = scalar_t;
    at::parallel_for(0, g.batch * g.heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> s(g.slots);
      std::vector<int64_t> nb(g.slots);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t h = bh % g.heads, rows = bh * g.tokens * g.dim;
        const T *qb = q.const_data_ptr<T>() + rows, *kb = k.const_data_ptr<T>() + rows;
        const T *vb = v.const_data_ptr<T>() + rows, *lb = local_bias.const_data_ptr<T>() + h * g.slots;
        const T *lw = local_weight.const_data_ptr<T>() + bh * g.tokens * g.slots;
        T *ap = attn_pool.data_ptr<T>() + bh * g.tokens * g.pool;
        T *ob = out.data_ptr<T>() + rows, *lse_b = lse.data_ptr<T>() + bh * g.tokens;
        for (int64_t n = 0; n < g.tokens; ++n) {
          T* pooled = ap + n * g.pool;
          const T top = local_logits(g, n, qb + n * g.dim, kb, lb, pooled, s.data(), nb.data());
          T total = 0;
          for (T& e : s) total += (e = std::exp(e - top));
          for (int64_t p = 0; p < g.pool; ++p) total += (pooled[p] = std::exp(pooled[p] - top));
          const T inv = T(1) / total;
          for (int64_t p = 0; p < g.pool; ++p) pooled[p] *= inv;
          T* on = ob + n * g.dim;
          for (int64_t l = 0; l < g.slots; ++l) {
            if (nb[l] >= 0) axpy(s[l] * inv + lw[n * g.slots + l], vb + nb[l] * g.dim, on, g.dim);
          }
          lse_b[n] = top + std::log(total);
        }
      }
    });
  });
  out.add_(at::matmul(attn_pool, v_pool));
  return {out, lse};
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
  at::Tensor attn_pool = pooled_logits(q, k_pool, pool_bias);       // becomes the pooled attention a_p
  at::Tensor ds_pool = at::matmul(grad, v_pool.transpose(-2, -1));  // g_p = grad . v_pool[p], becomes ds_p
  const auto opts = q.options();
  at::Tensor dq = at::zeros(q.sizes(), opts), dk = at::zeros(q.sizes(), opts), dv = at::zeros(q.sizes(), opts);
  at::Tensor d_local_bias = at::zeros({g.batch, g.heads, g.slots}, opts);  // per image, summed below
  at::Tensor d_local_weight = at::empty({g.batch, g.heads, g.tokens, g.slots}, opts);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "moh_aggregated_backward", [&] {
    using T = scalar_t;
    at::parallel_for(0, g.batch * g.heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> s(g.slots), gs(g.slots);
      std::vector<int64_t> nb(g.slots);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t h = bh % g.heads, rows = bh * g.tokens * g.dim;
        const T *qb = q.const_data_ptr<T>() + rows, *kb = k.const_data_ptr<T>() + rows;
        const T *vb = v.const_data_ptr<T>() + rows, *gb = grad.const_data_ptr<T>() + rows;
        const T *lb = local_bias.const_data_ptr<T>() + h * g.slots;
        const T *lw = local_weight.const_data_ptr<T>() + bh * g.tokens * g.slots;
        const T *lse_b = lse.const_data_ptr<T>() + bh * g.tokens;
        T *ap = attn_pool.data_ptr<T>() + bh * g.tokens * g.pool, *dsp = ds_pool.data_ptr<T>() + bh * g.tokens * g.pool;
        T *dqb = dq.data_ptr<T>() + rows, *dkb = dk.data_ptr<T>() + rows, *dvb = dv.data_ptr<T>() + rows;
        T *dlb = d_local_bias.data_ptr<T>() + bh * g.slots, *dlw = d_local_weight.data_ptr<T>() + bh * g.tokens * g.slots;
        for (int64_t n = 0; n < g.tokens; ++n) {
          const T *qn = qb + n * g.dim, *gn = gb + n * g.dim;
          T *a_pool = ap + n * g.pool, *g_pool = dsp + n * g.pool;
          local_logits(g, n, qn, kb, lb, a_pool, s.data(), nb.data());
          T delta = 0;
          for (int64_t l = 0; l < g.slots; ++l) {
            s[l] = std::exp(s[l] - lse_b[n]);  // 0 outside the map
            gs[l] = nb[l] < 0 ? T(0) : dot(gn, vb + nb[l] * g.dim, g.dim);
            delta += s[l] * gs[l];
          }
          for (int64_t p = 0; p < g.pool; ++p) {
            a_pool[p] = std::exp(a_pool[p] - lse_b[n]);
            delta += a_pool[p] * g_pool[p];
          }
          for (int64_t p = 0; p < g.pool; ++p) g_pool[p] = a_pool[p] * (g_pool[p] - delta);
          T* dqn = dqb + n * g.dim;
          for (int64_t l = 0; l < g.slots; ++l) {
            dlw[n * g.slots + l] = gs[l];
            if (nb[l] < 0) continue;
            const T ds = s[l] * (gs[l] - delta);
            axpy(ds, kb + nb[l] * g.dim, dqn, g.dim);
            axpy(ds, qn, dkb + nb[l] * g.dim, g.dim);
            axpy(s[l] + lw[n * g.slots + l], gn, dvb + nb[l] * g.dim, g.dim);
            dlb[l] += ds;
          }
        }
      }
    });
  });
  dq.add_(at::matmul(ds_pool, k_pool));
  return {dq, dk, dv, at::matmul(ds_pool.transpose(-2, -1), q), at::matmul(attn_pool.transpose(-2, -1), grad),
          ds_pool.sum(0), d_local_bias.sum(0), d_local_weight};
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
