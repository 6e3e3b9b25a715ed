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
// route_merge does the same and, in the same pass over the tokens, applies the gates where the heads are merged:
// from the head outputs o [B, h, N, d] (any strides; token t = b N + n, the logits' row t) it writes
// merged[t, i d + j] = o[b, i, n, j] * gate_i cast to o's dtype (MoH's masked merge, kernels.py merge_heads);
// its backward gives o's gradient (merged's gradient times the gate) and the gates' (sum over d of merged's
// gradient times o) and from that the logits'.
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
#include <type_traits>
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

// The logits as rows [T, width] with a unit column stride: a view where the layout allows it (e.g. the routers'
// columns of a wider GEMM output, which MoH's fused qkv projection gives), else a contiguous copy.
at::Tensor token_rows(const at::Tensor& logits, int64_t width) {
  at::Tensor rows = logits.reshape({-1, width});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

std::vector<int64_t> shape_with_last(const at::Tensor& t, int64_t last) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = last;
  return shape;
}

// Head outputs o [B, h, N, d] of type o_t (the logits' type), any strides, for route_merge: the forward writes the
// gated merge [T, h d]; the backward reads its gradient and writes o's (in o's strides) and the gates'.
template <typename o_t>
struct Heads {
  const o_t* o;
  int64_t h, N, d, sb, sh, sn, sd;
  o_t* merged = nullptr;      // forward: [T, h d]
  const o_t* grad = nullptr;  // backward: merged's gradient [T, h d]
  o_t* grad_o = nullptr;      // backward: o's gradient, strides gb, gh, gn, gd
  int64_t gb = 0, gh = 0, gn = 0, gd = 0;

  explicit Heads(const at::Tensor& heads)
      : o(heads.data_ptr<o_t>()), h(heads.size(1)), N(heads.size(2)), d(heads.size(3)), sb(heads.stride(0)),
        sh(heads.stride(1)), sn(heads.stride(2)), sd(heads.stride(3)) {}

  // token t's heads times their gates g, each gate cast to o's dtype first (as merge_heads multiplies)
  template <typename out_t>
  void merge(int64_t t, const out_t* g) const {
    const o_t* src = o + (t / N) * sb + (t % N) * sn;
    o_t* dst = merged + t * h * d;
    for (int64_t i = 0; i < h; ++i, src += sh, dst += d) {
      const o_t gate = static_cast<o_t>(g[i]);
      if (sd == 1) {
        for (int64_t j = 0; j < d; ++j) dst[j] = src[j] * gate;
      } else {
        for (int64_t j = 0; j < d; ++j) dst[j] = src[j * sd] * gate;
      }
    }
  }

  // token t's gates' gradient into dg (sum over d of merged's gradient times o) and o's gradient
  template <typename out_t, typename acc_t>
  void merge_backward(int64_t t, const out_t* g, acc_t* dg) const {
    const o_t* src = o + (t / N) * sb + (t % N) * sn;
    o_t* dst = grad_o + (t / N) * gb + (t % N) * gn;
    const o_t* dy = grad + t * h * d;
    for (int64_t i = 0; i < h; ++i, src += sh, dst += gh, dy += d) {
      const o_t gate = static_cast<o_t>(g[i]);
      acc_t dot = 0;
      for (int64_t j = 0; j < d; ++j) {
        dot += static_cast<acc_t>(dy[j]) * static_cast<acc_t>(src[j * sd]);
        dst[j * gd] = dy[j] * gate;
      }
      dg[i] = dot;
    }
  }
};

// The forward over tokens: logits of type in_t, gates / probabilities / selection stored as out_t (float32 from
// low-precision logits under autocast, as autocast's softmax gives them to the formulas; else in_t); with heads,
// the gated merge of each token right after its gates.
template <typename in_t, typename out_t>
void route_tokens(const at::Tensor& logits, at::Tensor& gates, at::Tensor& probs, at::Tensor& mask,
                  at::Tensor& index, at::Tensor& loss, const Layout& lay, bool with_loss,
                  const Heads<in_t>* heads = nullptr) {
  using acc_t = at::opmath_type<out_t>;
  const int64_t T = logits.size(0), Zs = logits.stride(0), R = lay.routed, k = lay.topk, hs = lay.shared;
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
      for (int64_t i = 0; i < lay.width; ++i) z[i] = static_cast<acc_t>(Z[t * Zs + i]);
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
      if (k > 0) {
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
      if (heads != nullptr) heads->merge(t, g);
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

// The routing's outputs for the logits (their rows: `rows`): gates, probabilities, selection, selected heads, loss.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs(
    const at::Tensor& logits, const at::Tensor& rows, const Layout& lay, bool with_loss, bool float_out) {
  const auto out = float_out ? rows.options().dtype(at::kFloat) : rows.options();
  return {at::empty(shape_with_last(logits, lay.heads), out), at::empty(shape_with_last(logits, lay.routed), out),
          at::empty(shape_with_last(logits, lay.routed), out),
          at::empty(shape_with_last(logits, lay.topk), rows.options().dtype(at::kLong)),
          with_loss && lay.topk > 0 ? at::empty({}, rows.options().dtype(at::kFloat)) : at::empty({0}, out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route(
    const at::Tensor& logits_in, int64_t routed, int64_t shared, int64_t topk, bool with_loss, bool float_out) {
  const Layout lay(routed, shared, topk);
  check_inputs(logits_in, lay);
  const at::Tensor logits = token_rows(logits_in, lay.width);
  at::Tensor gates, probs, mask, index, loss;
  std::tie(gates, probs, mask, index, loss) = outputs(logits_in, logits, lay, with_loss, float_out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moh_routing_forward", [&] {
    if (gates.dtype() == logits.dtype())
      route_tokens<scalar_t, scalar_t>(logits, gates, probs, mask, index, loss, lay, with_loss);
    else
      route_tokens<scalar_t, float>(logits, gates, probs, mask, index, loss, lay, with_loss);
  });
  return {gates, probs, mask, index, loss};
}

// The backward over tokens: logits and their gradient of type in_t, the gates' gradient, probabilities and
// selection of type out_t (as the forward stored them). With heads, the gates' gradient of each token comes from
// the merge's (route_merge; grad_gates holds the gates then), and o's gradient is written on the way.
template <typename in_t, typename out_t>
void route_backward_tokens(const at::Tensor& grad_gates, double loss_grad, bool aux, const at::Tensor& logits,
                           const at::Tensor& probs, const at::Tensor& mask, at::Tensor& grad, const Layout& lay,
                           const Heads<in_t>* heads = nullptr) {
  using acc_t = at::opmath_type<out_t>;
  const int64_t T = logits.size(0), Zs = logits.stride(0), R = lay.routed, k = lay.topk, hs = lay.shared;
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
    std::vector<acc_t> z(lay.width), s(hs > 1 ? hs : 0), gr(R), gg(lay.heads);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < lay.width; ++i) z[i] = static_cast<acc_t>(Z[t * Zs + i]);
      if (heads != nullptr)
        heads->merge_backward(t, GG + t * lay.heads, gg.data());
      else
        for (int64_t i = 0; i < lay.heads; ++i) gg[i] = static_cast<acc_t>(GG[t * lay.heads + i]);
      in_t* d = D + t * lay.width;
      acc_t mu[2] = {1, 1};
      if (lay.mix) softmax_into(z.data() + R, 2, acc_t(2), mu);
      acc_t g_mu0 = 0, g_mu1 = 0;  // the gradient of the two mix weights
      if (hs > 1) {
        softmax_into(z.data() + lay.shared_offset(), hs, static_cast<acc_t>(hs), s.data());
        acc_t dot = 0;  // sum_i (s_i / h_s) * dL/ds_i
        for (int64_t i = 0; i < hs; ++i) {
          const acc_t g = gg[i];
          g_mu0 += s[i] * g;
          dot += s[i] / hs * mu[0] * g;
        }
        for (int64_t i = 0; i < hs; ++i)
          d[lay.shared_offset() + i] = static_cast<in_t>(s[i] * (mu[0] * gg[i] - dot));
      } else if (hs == 1) {
        g_mu0 = gg[0];
      }
      if (k > 0) {
        const out_t* p = P + t * R;
        const out_t* m = M + t * R;
        acc_t kept = 0;
        for (int64_t j = 0; j < R; ++j) kept += static_cast<acc_t>(m[j]) * static_cast<acc_t>(p[j]);
        kept = std::max(kept, eps);
        acc_t weighted = 0;  // sum over the top-k of q_j * dL/dr_j, q = p / kept
        for (int64_t j = 0; j < R; ++j) {
          gr[j] = gg[hs + j] * mu[1];
          if (m[j] != out_t(0)) {
            weighted += static_cast<acc_t>(p[j]) / kept * gr[j];
            g_mu1 += static_cast<acc_t>(p[j]) / kept * k * gg[hs + j];
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

// The logits' gradient from the gates' (or, with heads, from the merged output's: `gates` then holds the gates) and
// the loss's.
template <typename heads_t>
at::Tensor logits_backward(const at::Tensor& gates_in, const std::optional<at::Tensor>& grad_loss,
                           const at::Tensor& logits_in, const at::Tensor& probs_in, const at::Tensor& mask_in,
                           const Layout& lay, const Heads<heads_t>* heads) {
  const at::Tensor logits = token_rows(logits_in, lay.width), gates = gates_in.contiguous();
  const at::Tensor probs = probs_in.contiguous(), mask = mask_in.contiguous();
  const int64_t T = logits.size(0), k = lay.topk;
  TORCH_CHECK(gates.numel() == T * lay.heads, "moh_routing: the gates' gradient has the wrong size");
  at::Tensor grad = at::empty(logits_in.sizes(), logits.options());  // contiguous, whatever the logits' strides
  const bool aux = grad_loss.has_value() && grad_loss->defined() && k > 0;
  TORCH_CHECK(!aux || (grad_loss->scalar_type() == at::kFloat && grad_loss->numel() == 1),
              "moh_routing: the loss's gradient is one float32 number");
  const double loss_grad = aux ? static_cast<double>(*grad_loss->contiguous().data_ptr<float>()) : 0.0;

  TORCH_CHECK(gates.scalar_type() == probs.scalar_type(), "moh_routing: the gates' gradient and the "
              "probabilities differ in dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moh_routing_backward", [&] {
    const Heads<scalar_t>* view = nullptr;
    if constexpr (std::is_same_v<scalar_t, heads_t>) view = heads;
    TORCH_CHECK(view != nullptr || heads == nullptr, "moh_routing: the head outputs and the logits differ in dtype");
    if (probs.dtype() == logits.dtype())
      route_backward_tokens<scalar_t, scalar_t>(gates, loss_grad, aux, logits, probs, mask, grad, lay, view);
    else
      route_backward_tokens<scalar_t, float>(gates, loss_grad, aux, logits, probs, mask, grad, lay, view);
  });
  return grad;
}

at::Tensor route_backward(const at::Tensor& grad_gates, const std::optional<at::Tensor>& grad_loss,
                          const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& mask,
                          int64_t routed, int64_t shared, int64_t topk) {
  const Layout lay(routed, shared, topk);
  check_inputs(logits, lay);
  return logits_backward<float>(grad_gates, grad_loss, logits, probs, mask, lay, nullptr);
}

void check_heads(const at::Tensor& heads, const at::Tensor& logits, const Layout& lay) {
  TORCH_CHECK(heads.device().is_cpu() && heads.dim() == 4 && heads.size(1) == lay.heads,
              "moh_routing: the head outputs are [B, h, N, d] on the CPU with h = ", lay.heads);
  TORCH_CHECK(heads.size(0) * heads.size(2) * lay.width == logits.numel(),
              "moh_routing: the head outputs' B N differs from the logits' tokens");
  TORCH_CHECK(heads.scalar_type() == logits.scalar_type(), "moh_routing: the head outputs and the logits differ in dtype");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_merge(
    const at::Tensor& heads, const at::Tensor& logits_in, int64_t routed, int64_t shared, int64_t topk,
    bool with_loss, bool float_out) {
  const Layout lay(routed, shared, topk);
  check_inputs(logits_in, lay);
  check_heads(heads, logits_in, lay);
  const int64_t B = heads.size(0), N = heads.size(2), d = heads.size(3);
  at::Tensor merged = at::empty({B, N, lay.heads * d}, heads.options());
  at::Tensor gates, probs, mask, index, loss;
  const at::Tensor logits = token_rows(logits_in, lay.width);
  std::tie(gates, probs, mask, index, loss) = outputs(logits_in, logits, lay, with_loss, float_out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moh_routing_merge", [&] {
    Heads<scalar_t> view(heads);
    view.merged = merged.data_ptr<scalar_t>();
    if (gates.dtype() == logits.dtype())
      route_tokens<scalar_t, scalar_t>(logits, gates, probs, mask, index, loss, lay, with_loss, &view);
    else
      route_tokens<scalar_t, float>(logits, gates, probs, mask, index, loss, lay, with_loss, &view);
  });
  return {merged, gates, probs, mask, index, loss};
}

std::tuple<at::Tensor, at::Tensor> route_merge_backward(
    const at::Tensor& grad_in, const std::optional<at::Tensor>& grad_loss, const at::Tensor& heads,
    const at::Tensor& gates_in, const at::Tensor& logits_in, const at::Tensor& probs_in, const at::Tensor& mask_in,
    int64_t routed, int64_t shared, int64_t topk) {
  const Layout lay(routed, shared, topk);
  check_inputs(logits_in, lay);
  check_heads(heads, logits_in, lay);
  const at::Tensor grad = grad_in.contiguous(), gates = gates_in.contiguous();
  TORCH_CHECK(grad.numel() == heads.numel() && grad.scalar_type() == heads.scalar_type(),
              "moh_routing: the merged output's gradient has the wrong size or dtype");
  at::Tensor grad_heads = at::empty_like(heads);  // o's layout, so attention's backward gets what it expects
  at::Tensor grad_logits;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, heads.scalar_type(), "moh_routing_merge_backward", [&] {
    Heads<scalar_t> view(heads);
    view.grad = grad.data_ptr<scalar_t>();
    view.grad_o = grad_heads.data_ptr<scalar_t>();
    view.gb = grad_heads.stride(0), view.gh = grad_heads.stride(1), view.gn = grad_heads.stride(2);
    view.gd = grad_heads.stride(3);
    grad_logits = logits_backward(gates, grad_loss, logits_in, probs_in, mask_in, lay, &view);
  });
  return {grad_heads, grad_logits};
}

}  // namespace

TORCH_LIBRARY(moh_routing, m) {
  m.def("route(Tensor logits, int routed, int shared, int topk, bool with_loss, bool float_out=False) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("route_backward(Tensor grad_gates, Tensor? grad_loss, Tensor logits, Tensor probs, Tensor mask, int routed, "
        "int shared, int topk) -> Tensor");
  m.def("route_merge(Tensor heads, Tensor logits, int routed, int shared, int topk, bool with_loss, "
        "bool float_out=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("route_merge_backward(Tensor grad, Tensor? grad_loss, Tensor heads, Tensor gates, Tensor logits, "
        "Tensor probs, Tensor mask, int routed, int shared, int topk) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moh_routing, CPU, m) {
  m.impl("route", &route);
  m.impl("route_backward", &route_backward);
  m.impl("route_merge", &route_merge);
  m.impl("route_merge_backward", &route_merge_backward);
}
