// TransNeXt's continuous position bias MLP on the CPU, forward and backward, without its hidden layer in memory
// (moh_vision/models/position_mlp.py builds this file and registers it as the CPU kernel of
// torch.ops.moh_vision.position_mlp and its backward).
//
// Per table row u (two log-spaced offsets t0, t1), hidden width K, heads H (tensors contiguous, float32 or float64):
//   a_k = relu(w1[k, 0] t0 + w1[k, 1] t1 + b1[k]),  out[u, h] = b2[h] + sum_k w2[h, k] a_k
// Backward, from g = d out[u, :], recomputing a:
//   ga_k = [a_k > 0] sum_h g_h w2[h, k];  dw2[h, k] += g_h a_k;  db2[h] += g_h;
//   dw1[k, 0] += ga_k t0;  dw1[k, 1] += ga_k t1;  db1[k] += ga_k
// The table has up to ~10^4 rows at TransNeXt's first stage, so the [rows, 512] hidden layer that the plain
// operators write, read back and differentiate (tens of MiB, forward, recomputation and backward) is what their
// time is spent on; here each row's hidden vector lives in a buffer of K numbers. Rows are split among threads;
// the backward's sums over rows go into per-task buffers, added up at the end in double.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGrain = 64;  // rows per task

template <typename T>
inline T dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight chains: the compiler may not reorder one float sum
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int64_t j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// a = relu(w1 t + b1) for one row t = (t0, t1); w1 as its two columns c0, c1
template <typename T>
inline void hidden(T t0, T t1, const T* __restrict__ c0, const T* __restrict__ c1, const T* __restrict__ b1,
                   T* __restrict__ a, int64_t K) {
  for (int64_t k = 0; k < K; ++k) a[k] = std::max(c0[k] * t0 + c1[k] * t1 + b1[k], T(0));
}

struct Sizes {
  int64_t rows, width, heads;
};

Sizes check(const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2) {
  TORCH_CHECK(table.device().is_cpu(), "moh_position: CPU tensors only");
  TORCH_CHECK(table.dim() == 2 && table.size(1) == 2, "moh_position: the table must be [U, 2]");
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == 2 && b1.numel() == w1.size(0), "moh_position: w1 [K, 2], b1 [K]");
  TORCH_CHECK(w2.dim() == 2 && w2.size(1) == w1.size(0), "moh_position: w2 must be [H, K]");
  for (const auto* t : {&w1, &b1, &w2})
    TORCH_CHECK(t->scalar_type() == table.scalar_type(), "moh_position: one dtype for every tensor");
  return {table.size(0), w1.size(0), w2.size(0)};
}

// w1 [K, 2] as its two columns, contiguous
template <typename T>
std::vector<T> columns(const at::Tensor& w1, int64_t K) {
  std::vector<T> c(2 * K);
  const T* w = w1.data_ptr<T>();
  for (int64_t k = 0; k < K; ++k) {
    c[k] = w[2 * k];
    c[K + k] = w[2 * k + 1];
  }
  return c;
}

at::Tensor forward(const at::Tensor& table_in, const at::Tensor& w1_in, const at::Tensor& b1_in,
                   const at::Tensor& w2_in, const at::Tensor& b2_in) {
  const Sizes s = check(table_in, w1_in, b1_in, w2_in);
  const at::Tensor table = table_in.contiguous(), w1 = w1_in.contiguous(), b1 = b1_in.contiguous();
  const at::Tensor w2 = w2_in.contiguous(), b2 = b2_in.contiguous();
  at::Tensor out = at::empty({s.rows, s.heads}, table.options());
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "moh_position_forward", [&] {
    using T = scalar_t;
    const std::vector<T> c = columns<T>(w1, s.width);
    const T *t = table.data_ptr<T>(), *bias1 = b1.data_ptr<T>(), *w = w2.data_ptr<T>(), *bias2 = b2.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, s.rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<T> a(s.width);
      for (int64_t u = begin; u < end; ++u) {
        hidden(t[2 * u], t[2 * u + 1], c.data(), c.data() + s.width, bias1, a.data(), s.width);
        for (int64_t h = 0; h < s.heads; ++h) o[u * s.heads + h] = bias2[h] + dot(w + h * s.width, a.data(), s.width);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_in, const at::Tensor& table_in,
                                                                    const at::Tensor& w1_in, const at::Tensor& b1_in,
                                                                    const at::Tensor& w2_in) {
  const Sizes s = check(table_in, w1_in, b1_in, w2_in);
  const at::Tensor grad = grad_in.contiguous(), table = table_in.contiguous(), w1 = w1_in.contiguous();
  const at::Tensor b1 = b1_in.contiguous(), w2 = w2_in.contiguous();
  TORCH_CHECK(grad.numel() == s.rows * s.heads && grad.scalar_type() == table.scalar_type(),
              "moh_position: the gradient must be [U, H] of the table's dtype");
  const int64_t K = s.width, H = s.heads;
  at::Tensor dw1 = at::empty({K, 2}, table.options()), db1 = at::empty({K}, table.options());
  at::Tensor dw2 = at::empty({H, K}, table.options()), db2 = at::empty({H}, table.options());
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "moh_position_backward", [&] {
    using T = scalar_t;
    const std::vector<T> c = columns<T>(w1, K);
    const T *t = table.data_ptr<T>(), *bias1 = b1.data_ptr<T>(), *w = w2.data_ptr<T>(), *g = grad.data_ptr<T>();
    const int64_t tasks = (s.rows + kGrain - 1) / kGrain;
    // per task: dw2 [H, K], dw1's columns [2, K], db1 [K], db2 [H]
    const int64_t per_task = H * K + 3 * K + H;
    std::vector<T> partial(tasks * per_task, T(0));
    at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
      std::vector<T> a(K), ga(K);
      for (int64_t task = first; task < last; ++task) {
        T* acc = partial.data() + task * per_task;
        T *acc_w2 = acc, *acc_c0 = acc + H * K, *acc_c1 = acc_c0 + K, *acc_b1 = acc_c1 + K, *acc_b2 = acc_b1 + K;
        for (int64_t u = task * kGrain; u < std::min(s.rows, (task + 1) * kGrain); ++u) {
          const T t0 = t[2 * u], t1 = t[2 * u + 1];
          hidden(t0, t1, c.data(), c.data() + K, bias1, a.data(), K);
          std::fill(ga.begin(), ga.end(), T(0));
          for (int64_t h = 0; h < H; ++h) {
            const T gh = g[u * H + h];
            const T* wh = w + h * K;
            T* dwh = acc_w2 + h * K;
            for (int64_t k = 0; k < K; ++k) {
              ga[k] += gh * wh[k];
              dwh[k] += gh * a[k];
            }
            acc_b2[h] += gh;
          }
          for (int64_t k = 0; k < K; ++k) {
            const T gk = a[k] > T(0) ? ga[k] : T(0);
            acc_c0[k] += gk * t0;
            acc_c1[k] += gk * t1;
            acc_b1[k] += gk;
          }
        }
      }
    });
    // the tasks' sums added up in task order (the same result whatever the thread count), in double: each task
    // sums kGrain rows in T, so the rounding stays that of kGrain terms however long the table
    std::vector<double> total(per_task, 0.0);
    for (int64_t task = 0; task < tasks; ++task) {
      const T* acc = partial.data() + task * per_task;
      for (int64_t i = 0; i < per_task; ++i) total[i] += static_cast<double>(acc[i]);
    }
    T *o_w2 = dw2.data_ptr<T>(), *o_w1 = dw1.data_ptr<T>(), *o_b1 = db1.data_ptr<T>(), *o_b2 = db2.data_ptr<T>();
    for (int64_t i = 0; i < H * K; ++i) o_w2[i] = static_cast<T>(total[i]);
    for (int64_t k = 0; k < K; ++k) {
      o_w1[2 * k] = static_cast<T>(total[H * K + k]);
      o_w1[2 * k + 1] = static_cast<T>(total[H * K + K + k]);
      o_b1[k] = static_cast<T>(total[H * K + 2 * K + k]);
    }
    for (int64_t h = 0; h < H; ++h) o_b2[h] = static_cast<T>(total[H * K + 3 * K + h]);
  });
  return {dw1, db1, dw2, db2};
}

}  // namespace

TORCH_LIBRARY(moh_position, m) {
  m.def("forward(Tensor table, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> Tensor");
  m.def("backward(Tensor grad, Tensor table, Tensor w1, Tensor b1, Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moh_position, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
