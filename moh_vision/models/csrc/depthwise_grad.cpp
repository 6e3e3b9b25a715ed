// The 3x3 depthwise convolution's weight and bias gradients on the CPU (zero padding, stride 1), from tokens laid out
// as an H x W image (moh_vision/models/depthwise_grad.py builds this file and registers it as the CPU kernel of
// torch.ops.moh_vision.depthwise_param_grads).
//
// x, grad [B, N = H * W, C], contiguous, float32 or float64:
//   dw[c, 0, i, j] = sum_{b, y, w} grad[b, y * W + w, c] * x[b, (y + i - 1) * W + w + j - 1, c]   (in-map taps only)
//   db[c] = sum_{b, n} grad[b, n, c]
// One pass over the gradient: each pixel's gradient row times its nine neighbours' input rows, added into nine
// accumulator rows of C numbers (in cache), and itself into a tenth, channels innermost so that the compiler
// vectorises them. Rows of the image are split among threads; their sums go into per-task buffers, added up at the
// end in double.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kTaps = 9;
constexpr int64_t kSums = kTaps + 1;  // the nine taps' sums and the bias's
constexpr int64_t kGrain = 8;  // image rows per task

std::tuple<at::Tensor, at::Tensor> param_grads(const at::Tensor& x_in, const at::Tensor& grad_in, int64_t height,
                                               int64_t width) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 3, "moh_depthwise: x must be [B, N, C] on the CPU");
  TORCH_CHECK(grad_in.sizes() == x_in.sizes() && grad_in.scalar_type() == x_in.scalar_type(),
              "moh_depthwise: grad must be shaped as x, of its dtype");
  TORCH_CHECK(height * width == x_in.size(1), "moh_depthwise: ", height, " x ", width, " is not ", x_in.size(1),
              " tokens");
  const at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  const int64_t B = x.size(0), C = x.size(2), rows = B * height;
  at::Tensor weight = at::empty({C, 1, 3, 3}, x.options()), bias = at::empty({C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "moh_depthwise_param_grads", [&] {
    using T = scalar_t;
    const T *xp = x.const_data_ptr<T>(), *gp = grad.const_data_ptr<T>();
    const int64_t tasks = (rows + kGrain - 1) / kGrain;
    std::vector<T> partial(tasks * kSums * C, T(0));  // per task: [tap or bias, C]
    at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        T* acc = partial.data() + task * kSums * C;
        T* __restrict__ acc_bias = acc + kTaps * C;
        for (int64_t row = task * kGrain; row < std::min(rows, (task + 1) * kGrain); ++row) {
          const int64_t b = row / height, y = row % height;
          for (int64_t w = 0; w < width; ++w) {
            const T* __restrict__ g = gp + ((b * height + y) * width + w) * C;
            for (int64_t c = 0; c < C; ++c) acc_bias[c] += g[c];
            for (int64_t i = 0; i < 3; ++i) {
              const int64_t yy = y + i - 1;
              if (yy < 0 || yy >= height) continue;
              for (int64_t j = 0; j < 3; ++j) {
                const int64_t ww = w + j - 1;
                if (ww < 0 || ww >= width) continue;
                const T* __restrict__ in = xp + ((b * height + yy) * width + ww) * C;
                T* __restrict__ a = acc + (i * 3 + j) * C;
                for (int64_t c = 0; c < C; ++c) a[c] += g[c] * in[c];
              }
            }
          }
        }
      }
    });
    // the tasks' sums added up in task order (the same result whatever the thread count), in double
    std::vector<double> total(kSums * C, 0.0);
    for (int64_t task = 0; task < tasks; ++task) {
      const T* acc = partial.data() + task * kSums * C;
      for (int64_t i = 0; i < kSums * C; ++i) total[i] += static_cast<double>(acc[i]);
    }
    T *ow = weight.data_ptr<T>(), *ob = bias.data_ptr<T>();  // weight [C, 1, 3, 3]: channel-major
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t tap = 0; tap < kTaps; ++tap) ow[c * kTaps + tap] = static_cast<T>(total[tap * C + c]);
      ob[c] = static_cast<T>(total[kTaps * C + c]);
    }
  });
  return {weight, bias};
}

}  // namespace

TORCH_LIBRARY(moh_depthwise, m) {
  m.def("param_grads(Tensor x, Tensor grad, int height, int width) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moh_depthwise, CPU, m) {
  m.impl("param_grads", &param_grads);
}
