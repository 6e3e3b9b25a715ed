// MoH's routing as one CPU kernel each way (moh_vision/attention/fused_routing.py builds and wraps it).
//
// Forward, per token, from the routers' logits z = [z_r (R routed), z_m (2, when h_s > 0), z_s (h_s, when
// h_s > 1)], the official gates (moh_vision/attention/moh.py):
//   p = softmax(z_r); the top-k of p (ties: lower head first); r = k * p / sum(p over the top-k) on the top-k,
//   0 elsewhere; mu = 2 softmax(z_m); s = h_s softmax(z_s) (1 when h_s == 1);
//   gates = [s * mu_0, r * mu_1] (h_s > 0), or r (h_s == 0), or s (topk == 0: every head shared);
// plus, when asked, the load-balance loss R * sum_j mean_t(p_tj) * mean_t(m_tj) (m: the 0/1 selection).
// Backward: the gradient of the logits from the gates' gradient and the loss's, written out (the formulas'
// derivatives; tests/test_fused_routing.py checks them against autograd on the formulas).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGrain = 256;  // tokens per parallel task

struct Layout {
  int64_t routed, shared, topk, width, heads;
  bool mix;  // a two-stage mix (wg_0) exists
  Layout(int64_t routed_, int64_t shared_, int64_t topk_)
      : routed(topk_ > 0 ? routed_ : 0), shared(shared_), topk(topk_), heads(shared_ + routed_) {
    mix = topk > 0 && shared > 0;
    width = routed + (mix ? 2 : 0) + (shared > 1 ? shared : 0);
  }
  int64_t shared_offset() const { return routed + (mix ? 2 : 0); }
};

template <typename acc_t>
void softmax_into(const acc_t* z, int64_t n, acc_t scale, acc_t* out) {
  acc_t top = z[0];
  for (int64_t i = 1; i < n; ++i) top = std::max(top, z[i]);
  acc_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = std::exp(z[i] - top);
    sum += out[i];
  }
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] / sum * scale;
}

void check_inputs(const at::Tensor& logits, const Layout& lay) {
  TORCH_CHECK(logits.device().is_cpu(), "moh_routing: CPU tensors only");
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) == lay.width, "moh_routing: logits' last dim is ",
              logits.size(-1), ", the layout needs ", lay.width);
  TORCH_CHECK(lay.topk >= 0 && lay.topk <= lay.routed && (lay.topk > 0 || lay.shared > 1),
              "moh_routing: bad head counts");
}

std::vector<int64_t> shape_with_last(const at::Tensor& t, int64_t last) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = last;
  return shape;
}

// The forward over tokens: logits of type in_t, gates / probabilities / selection stored as out_t (float32 from
// low-precision logits under autocast, as autocast's softmax gives them to the formulas; else in_t).
template <typename in_t, typename out_t>
void route_tokens(const at::Tensor& logits, at::Tensor& gates, at::Tensor& probs, at::Tensor& mask,
                  at::Tensor& index, at::Tensor& loss, const Layout& lay, bool with_loss) {
  using acc_t = at::opmath_type<out_t>;
  const int64_t T = logits.numel() / lay.width, R = lay.routed, k = lay.topk, hs = lay.shared;
  const acc_t eps = static_cast<acc_t>(std::numeric_limits<out_t>::epsilon());
  const in_t* Z = logits.data_ptr<in_t>();
  out_t* G = gates.data_ptr<out_t>();
  out_t* P = probs.data_ptr<out_t>();
  out_t* M = mask.data_ptr<out_t>();
  int64_t* I = index.data_ptr<int64_t>();
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> z(lay.width), p(R), s(hs > 1 ? hs : 0);
    std::vector<char> chosen(R);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < lay.width; ++i) z[i] = static_cast<acc_t>(Z[t * lay.width + i]);
      out_t* g = G + t * lay.heads;
      acc_t mu0 = 1, mu1 = 1;
      if (lay.mix) {
        acc_t mu[2];
        softmax_into(z.data() + R, 2, acc_t(2), mu);
        mu0 = mu[0];
        mu1 = mu[1];
      }
      if (hs > 1) {
        softmax_into(z.data() + lay.shared_offset(), hs, static_cast<acc_t>(hs), s.data());
        for (int64_t i = 0; i < hs; ++i) g[i] = static_cast<out_t>(s[i] * mu0);
      } else if (hs == 1) {
        g[0] = static_cast<out_t>(mu0);
      }
      if (k == 0) continue;
      softmax_into(z.data(), R, acc_t(1), p.data());
      for (int64_t j = 0; j < R; ++j) {  // the stored (rounded) probabilities are what top-k compares
        P[t * R + j] = static_cast<out_t>(p[j]);
        p[j] = static_cast<acc_t>(P[t * R + j]);
        chosen[j] = 0;
      }
      acc_t kept = 0;
      for (int64_t slot = 0; slot < k; ++slot) {  // k passes of an argmax: R is a handful of heads
        int64_t best = -1;
        for (int64_t j = 0; j < R; ++j)
          if (!chosen[j] && (best < 0 || p[j] > p[best])) best = j;
        chosen[best] = 1;
        I[t * k + slot] = best;
        kept += p[best];
      }
      const acc_t scale = static_cast<acc_t>(k) / std::max(kept, eps) * mu1;
      for (int64_t j = 0; j < R; ++j) {
        M[t * R + j] = static_cast<out_t>(chosen[j] ? 1 : 0);
        g[hs + j] = static_cast<out_t>(chosen[j] ? p[j] * scale : acc_t(0));
      }
    }
  });
  if (with_loss && k > 0) {  // R * sum_j mean_t(p_tj) * mean_t(m_tj), accumulated in double
    std::vector<double> me(R, 0.0), ce(R, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < R; ++j) {
        me[j] += static_cast<double>(P[t * R + j]);
        ce[j] += static_cast<double>(M[t * R + j]);
      }
    double total = 0;
    for (int64_t j = 0; j < R; ++j) total += (me[j] / T) * (ce[j] / T);
    *loss.data_ptr<float>() = static_cast<float>(R * total);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route(
    const at::Tensor& logits_in, int64_t routed, int64_t shared, int64_t topk, bool with_loss, bool float_out) {
  const Layout lay(routed, shared, topk);
  check_inputs(logits_in, lay);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t R = lay.routed, k = lay.topk;
  const auto out = float_out ? logits.options().dtype(at::kFloat) : logits.options();
  at::Tensor gates = at::empty(shape_with_last(logits, lay.heads), out);
  at::Tensor probs = at::empty(shape_with_last(logits, R), out);
  at::Tensor mask = at::empty(shape_with_last(logits, R), out);
  at::Tensor index = at::empty(shape_with_last(logits, k), logits.options().dtype(at::kLong));
  at::Tensor loss = with_loss && k > 0 ? at::empty({}, logits.options().dtype(at::kFloat)) : at::empty({0}, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moh_routing_forward", [&] {
    if (out.dtype() == logits.dtype())
      route_tokens<scalar_t, scalar_t>(logits, gates, probs, mask, index, loss, lay, with_loss);
    else
      route_tokens<scalar_t, float>(logits, gates, probs, mask, index, loss, lay, with_loss);
  });
  return {gates, probs, mask, index, loss};
}

// The backward over tokens: logits and their gradient of type in_t, the gates' gradient, probabilities and
// selection of type out_t (as the forward stored them).
template <typename in_t, typename out_t>
void route_backward_tokens(const at::Tensor& grad_gates, double loss_grad, bool aux, const at::Tensor& logits,
                           const at::Tensor& probs, const at::Tensor& mask, at::Tensor& grad, const Layout& lay) {
  using acc_t = at::opmath_type<out_t>;
  const int64_t T = logits.numel() / lay.width, R = lay.routed, k = lay.topk, hs = lay.shared;
  const acc_t eps = static_cast<acc_t>(std::numeric_limits<out_t>::epsilon());
  const in_t* Z = logits.data_ptr<in_t>();
  const out_t* GG = grad_gates.data_ptr<out_t>();
  const out_t* P = k > 0 ? probs.data_ptr<out_t>() : nullptr;
  const out_t* M = k > 0 ? mask.data_ptr<out_t>() : nullptr;
  in_t* D = grad.data_ptr<in_t>();
  std::vector<acc_t> per_head(R, acc_t(0));  // the loss's gradient w.r.t. p_tj: R * mean_t(m_tj) / T * dL
  if (aux) {
    std::vector<double> ce(R, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < R; ++j) ce[j] += static_cast<double>(M[t * R + j]);
    for (int64_t j = 0; j < R; ++j) per_head[j] = static_cast<acc_t>(R * (ce[j] / T) / T * loss_grad);
  }
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> z(lay.width), s(hs > 1 ? hs : 0), gr(R);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < lay.width; ++i) z[i] = static_cast<acc_t>(Z[t * lay.width + i]);
      const out_t* gg = GG + t * lay.heads;
      in_t* d = D + t * lay.width;
      acc_t mu[2] = {1, 1};
      if (lay.mix) softmax_into(z.data() + R, 2, acc_t(2), mu);
      acc_t g_mu0 = 0, g_mu1 = 0;  // the gradient of the two mix weights
      if (hs > 1) {
        softmax_into(z.data() + lay.shared_offset(), hs, static_cast<acc_t>(hs), s.data());
        acc_t dot = 0;  // sum_i (s_i / h_s) * dL/ds_i
        for (int64_t i = 0; i < hs; ++i) {
          const acc_t g = static_cast<acc_t>(gg[i]);
          g_mu0 += s[i] * g;
          dot += s[i] / hs * mu[0] * g;
        }
        for (int64_t i = 0; i < hs; ++i)
          d[lay.shared_offset() + i] = static_cast<in_t>(s[i] * (mu[0] * static_cast<acc_t>(gg[i]) - dot));
      } else if (hs == 1) {
        g_mu0 = static_cast<acc_t>(gg[0]);
      }
      if (k > 0) {
        const out_t* p = P + t * R;
        const out_t* m = M + t * R;
        acc_t kept = 0;
        for (int64_t j = 0; j < R; ++j) kept += static_cast<acc_t>(m[j]) * static_cast<acc_t>(p[j]);
        kept = std::max(kept, eps);
        acc_t weighted = 0;  // sum over the top-k of q_j * dL/dr_j, q = p / kept
        for (int64_t j = 0; j < R; ++j) {
          gr[j] = static_cast<acc_t>(gg[hs + j]) * mu[1];
          if (m[j] != out_t(0)) {
            weighted += static_cast<acc_t>(p[j]) / kept * gr[j];
            g_mu1 += static_cast<acc_t>(p[j]) / kept * k * static_cast<acc_t>(gg[hs + j]);
          }
        }
        acc_t aux_dot = 0;  // sum_j p_j * dL/dp_j (the loss's part)
        if (aux)
          for (int64_t j = 0; j < R; ++j) aux_dot += static_cast<acc_t>(p[j]) * per_head[j];
        for (int64_t j = 0; j < R; ++j) {
          const acc_t pj = static_cast<acc_t>(p[j]);
          acc_t dz = m[j] != out_t(0) ? pj / kept * k * (gr[j] - weighted) : acc_t(0);
          if (aux) dz += pj * (per_head[j] - aux_dot);
          d[j] = static_cast<in_t>(dz);
        }
        if (lay.mix) {  // mu = 2 softmax(z_m): dL/dz_m = mu * (dL/dmu - sum_c (mu_c / 2) dL/dmu_c)
          const acc_t centre = mu[0] / 2 * g_mu0 + mu[1] / 2 * g_mu1;
          d[R] = static_cast<in_t>(mu[0] * (g_mu0 - centre));
          d[R + 1] = static_cast<in_t>(mu[1] * (g_mu1 - centre));
        }
      }
    }
  });
}

at::Tensor route_backward(const at::Tensor& grad_gates_in, const std::optional<at::Tensor>& grad_loss,
                          const at::Tensor& logits_in, const at::Tensor& probs_in, const at::Tensor& mask_in,
                          int64_t routed, int64_t shared, int64_t topk) {
  const Layout lay(routed, shared, topk);
  check_inputs(logits_in, lay);
  const at::Tensor logits = logits_in.contiguous(), grad_gates = grad_gates_in.contiguous();
  const at::Tensor probs = probs_in.contiguous(), mask = mask_in.contiguous();
  const int64_t T = logits.numel() / lay.width, k = lay.topk;
  TORCH_CHECK(grad_gates.numel() == T * lay.heads, "moh_routing: the gates' gradient has the wrong size");
  at::Tensor grad = at::empty_like(logits);
  const bool aux = grad_loss.has_value() && grad_loss->defined() && k > 0;
  TORCH_CHECK(!aux || (grad_loss->scalar_type() == at::kFloat && grad_loss->numel() == 1),
              "moh_routing: the loss's gradient is one float32 number");
  const double loss_grad = aux ? static_cast<double>(*grad_loss->contiguous().data_ptr<float>()) : 0.0;

  TORCH_CHECK(grad_gates.scalar_type() == probs.scalar_type(), "moh_routing: the gates' gradient and the "
              "probabilities differ in dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moh_routing_backward", [&] {
    if (probs.dtype() == logits.dtype())
      route_backward_tokens<scalar_t, scalar_t>(grad_gates, loss_grad, aux, logits, probs, mask, grad, lay);
    else
      route_backward_tokens<scalar_t, float>(grad_gates, loss_grad, aux, logits, probs, mask, grad, lay);
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY(moh_routing, m) {
  m.def("route(Tensor logits, int routed, int shared, int topk, bool with_loss, bool float_out=False) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("route_backward(Tensor grad_gates, Tensor? grad_loss, Tensor logits, Tensor probs, Tensor mask, int routed, "
        "int shared, int topk) -> Tensor");
}

TORCH_LIBRARY_IMPL(moh_routing, CPU, m) {
  m.impl("route", &route);
  m.impl("route_backward", &route_backward);
}
