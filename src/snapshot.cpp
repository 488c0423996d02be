#include "nanguard/snapshot.h"

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <type_traits>
#include <utility>

namespace nanguard {

// What the optimizer's state map is keyed by: the parameter's TensorImpl
// (void* in torch 2.x).
using optimizer_state_key =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

struct snapshot_ring::data {
  int64_t step = 0;
  std::vector<std::string> param_names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  // Optimizer state, deep-copied per parameter key; or, for optimizers whose
  // state type is not known here, the whole optimizer serialized.
  std::vector<std::pair<optimizer_state_key, std::unique_ptr<torch::optim::OptimizerParamState>>> state;
  std::string serialized;
};

namespace {

at::Tensor copy(const at::Tensor& t) { return t.defined() ? t.detach().clone() : t; }

// A deep copy of one optimizer state (clone() alone shares the tensors);
// nullptr for a state type this function does not know.
std::unique_ptr<torch::optim::OptimizerParamState> deep_copy(const torch::optim::OptimizerParamState& s) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<const AdamParamState*>(&s)) {
    auto c = std::make_unique<AdamParamState>(*a);
    c->exp_avg(copy(a->exp_avg())).exp_avg_sq(copy(a->exp_avg_sq())).max_exp_avg_sq(copy(a->max_exp_avg_sq()));
    return c;
  }
  if (auto* a = dynamic_cast<const AdamWParamState*>(&s)) {
    auto c = std::make_unique<AdamWParamState>(*a);
    c->exp_avg(copy(a->exp_avg())).exp_avg_sq(copy(a->exp_avg_sq())).max_exp_avg_sq(copy(a->max_exp_avg_sq()));
    return c;
  }
  if (auto* a = dynamic_cast<const SGDParamState*>(&s)) {
    auto c = std::make_unique<SGDParamState>(*a);
    c->momentum_buffer(copy(a->momentum_buffer()));
    return c;
  }
  if (auto* a = dynamic_cast<const RMSpropParamState*>(&s)) {
    auto c = std::make_unique<RMSpropParamState>(*a);
    c->square_avg(copy(a->square_avg())).momentum_buffer(copy(a->momentum_buffer())).grad_avg(copy(a->grad_avg()));
    return c;
  }
  if (auto* a = dynamic_cast<const AdagradParamState*>(&s)) {
    auto c = std::make_unique<AdagradParamState>(*a);
    c->sum(copy(a->sum()));
    return c;
  }
  return nullptr;
}

double l2(const at::Tensor& t) { return t.to(at::kDouble).norm().item<double>(); }

}  // namespace

snapshot_ring::snapshot_ring(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t capacity)
    : module_(module), optimizer_(optimizer), capacity_(capacity) {
  TORCH_CHECK(capacity >= 1, "nanguard::snapshot_ring: capacity must be >= 1 but is ", capacity,
              "; keep at least one snapshot");
}

snapshot_ring::~snapshot_ring() = default;

void snapshot_ring::take(int64_t step) {
  at::NoGradGuard no_grad;
  auto d = std::make_shared<data>();
  d->step = step;
  for (const auto& item : module_.named_parameters()) {
    d->param_names.push_back(item.key());
    d->params.push_back(copy(item.value()));
  }
  for (const auto& b : module_.buffers()) d->buffers.push_back(copy(b));
  bool known = true;
  for (const auto& [key, state] : optimizer_.state()) {
    auto c = deep_copy(*state);
    if (!c) {
      known = false;
      break;
    }
    d->state.emplace_back(key, std::move(c));
  }
  if (!known) {
    d->state.clear();
    torch::serialize::OutputArchive archive;
    optimizer_.save(archive);
    std::ostringstream out;
    archive.save_to(out);
    d->serialized = out.str();
  }
  ring_.push_back(std::move(d));
  while (int64_t(ring_.size()) > capacity_) ring_.pop_front();
}

int64_t snapshot_ring::restore() {
  TORCH_CHECK(!ring_.empty(), "nanguard::snapshot_ring::restore: no snapshot was taken yet; call "
              "take(step) first (the guard takes one every snapshot_every steps)");
  at::NoGradGuard no_grad;
  const data& d = *ring_.back();
  const auto params = module_.parameters();
  const auto buffers = module_.buffers();
  TORCH_CHECK(params.size() == d.params.size() && buffers.size() == d.buffers.size(),
              "nanguard::snapshot_ring::restore: the module has ", params.size(), " parameters and ",
              buffers.size(), " buffers but the snapshot ", d.params.size(), " and ", d.buffers.size(),
              "; do not add parameters after making the ring");
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(d.params[i]);
  for (size_t i = 0; i < buffers.size(); ++i)
    if (buffers[i].defined()) buffers[i].copy_(d.buffers[i]);
  // Learning rates are not part of the snapshot: keep the current ones.
  std::vector<double> lrs;
  for (const auto& g : optimizer_.param_groups()) lrs.push_back(g.options().get_lr());
  if (!d.serialized.empty()) {
    torch::serialize::InputArchive archive;
    std::istringstream in(d.serialized);
    archive.load_from(in);
    optimizer_.load(archive);
  } else {
    auto& state = optimizer_.state();
    state.clear();
    for (const auto& [key, s] : d.state) state[key] = deep_copy(*s);
  }
  for (size_t i = 0; i < lrs.size() && i < optimizer_.param_groups().size(); ++i)
    optimizer_.param_groups()[i].options().set_lr(lrs[i]);
  return d.step;
}

void snapshot_ring::drop_newest() {
  if (!ring_.empty()) ring_.pop_back();
}

int64_t snapshot_ring::newest_step() const { return ring_.empty() ? -1 : ring_.back()->step; }

std::vector<param_change> snapshot_ring::diff() const {
  TORCH_CHECK(!ring_.empty(), "nanguard::snapshot_ring::diff: no snapshot was taken yet; call take(step) first");
  at::NoGradGuard no_grad;
  const data& d = *ring_.back();
  const auto params = module_.parameters();
  std::vector<param_change> out;
  for (size_t i = 0; i < params.size() && i < d.params.size(); ++i) {
    param_change c;
    c.name = d.param_names[i];
    c.norm_then = l2(d.params[i]);
    c.norm_now = l2(params[i]);
    c.finite = std::isfinite(c.norm_now);
    c.absolute = c.finite ? l2(params[i].detach().to(at::kDouble) - d.params[i].to(at::kDouble))
                          : std::numeric_limits<double>::infinity();
    c.relative = c.finite ? c.absolute / (c.norm_then + 1e-12) : std::numeric_limits<double>::infinity();
    out.push_back(std::move(c));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const param_change& a, const param_change& b) { return a.relative > b.relative; });
  return out;
}

}  // namespace nanguard
