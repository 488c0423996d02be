#include "guard/step_record.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace nanguard::detail {

gradient_marks mark_gradients(const std::vector<at::Tensor>& parameters) {
  gradient_marks marks;
  marks.reserve(parameters.size());
  for (const at::Tensor& p : parameters) {
    const at::Tensor& g = p.grad();
    marks.emplace_back(g.unsafeGetTensorImpl(), g.defined() ? g._version() : 0);
  }
  return marks;
}

bool gradients_written_since(const std::vector<at::Tensor>& parameters, const gradient_marks& before) {
  const gradient_marks now = mark_gradients(parameters);
  for (size_t i = 0; i < now.size(); ++i)
    if (parameters[i].grad().defined() && now[i] != before[i]) return true;
  return false;
}

at::Tensor loss_of(const step_fn& fn, const std::vector<at::Tensor>& batch, const std::vector<at::Tensor>& parameters) {
  const gradient_marks before = mark_gradients(parameters);
  at::Tensor loss = fn(batch);
  TORCH_CHECK(mark_gradients(parameters) == before,
              "nanguard::guard: the step function ran backward() itself; return the loss without calling "
              "backward(): the guard runs backward (scaled, checked, clipped), and a second one would add every "
              "gradient twice");
  return loss;
}

std::vector<std::pair<std::string, double>> top_norms(const std::vector<std::string>& names,
                                                      const std::vector<double>& norms, int64_t k) {
  // NaN sorts first (a strict weak order needs it placed somewhere).
  const auto key = [](double v) { return std::isnan(v) ? HUGE_VAL : v; };
  std::vector<size_t> order(norms.size());
  std::iota(order.begin(), order.end(), size_t(0));
  const size_t n = std::min(order.size(), static_cast<size_t>(std::max<int64_t>(k, 0)));
  std::partial_sort(order.begin(), order.begin() + n, order.end(),
                    [&](size_t a, size_t b) { return key(norms[a]) > key(norms[b]); });
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < n; ++i) out.emplace_back(names[order[i]], norms[order[i]]);
  return out;
}

}  // namespace nanguard::detail
