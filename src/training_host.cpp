#include "nanguard/training_host.h"

#include "detail/optimizer_state.h"

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <sstream>
#include <type_traits>
#include <utility>

namespace nanguard {

namespace {

// What the optimizer's state map is keyed by: the parameter's TensorImpl
// (void* in torch 2.x).
using optimizer_state_key =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

// A module_host's copy: parameters (in saved_state), buffers, optimizer state.
struct module_state : saved_state {
  std::vector<at::Tensor> buffers;
  // Optimizer state, deep-copied per parameter key; or, for optimizers whose
  // state type is not known here, the whole optimizer serialized.
  std::vector<std::pair<optimizer_state_key, std::unique_ptr<torch::optim::OptimizerParamState>>> state;
  std::string serialized;
};

// A snapshot's copy of `t`: a tensor on an accelerator goes to pinned host
// memory (the accelerator's memory is the model's), copied asynchronously on
// the current stream, before which what writes `t` next is queued; a CPU
// tensor is cloned.
at::Tensor copy(const at::Tensor& t) {
  if (!t.defined()) return t;
  if (t.is_cpu()) return t.detach().clone();
  at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  host.copy_(t.detach(), /*non_blocking=*/true);
  return host;
}

// A copy of a snapshot's tensor `t` back on `device`, the model's.
at::Tensor copy_to(const at::Tensor& t, const at::Device& device) {
  return t.defined() ? t.to(device, /*non_blocking=*/true, /*copy=*/true) : t;
}

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? int64_t(t.nbytes()) : 0; }

// A deep copy of one optimizer state (clone() alone shares the tensors);
// nullptr for a state type this function does not know.
std::unique_ptr<torch::optim::OptimizerParamState> deep_copy(const torch::optim::OptimizerParamState& s,
                                                              const std::function<at::Tensor(const at::Tensor&)>& copy) {
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

}  // namespace

module_host::module_host(torch::nn::Module& module, torch::optim::Optimizer& optimizer)
    : module_(module), optimizer_(optimizer) {}

named_tensors module_host::named_parameters() {
  named_tensors out;
  for (const auto& p : module_.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  return out;
}

void module_host::zero_grad() { optimizer_.zero_grad(); }

void module_host::optimizer_step() { optimizer_.step(); }

std::vector<double> module_host::lrs() {
  std::vector<double> out;
  for (const auto& g : optimizer_.param_groups()) out.push_back(g.options().get_lr());
  return out;
}

void module_host::set_lrs(const std::vector<double>& lrs) {
  auto& groups = optimizer_.param_groups();
  TORCH_CHECK(lrs.size() == groups.size(), "nanguard::module_host::set_lrs: ", lrs.size(),
              " learning rates for ", groups.size(), " param groups");
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

int64_t training_host::state_bytes() {
  int64_t total = 0;
  for (const auto& [name, p] : named_parameters()) total += bytes_of(p);
  return total;
}

int64_t module_host::state_bytes() {
  int64_t total = 0;
  for (const auto& p : module_.parameters()) total += bytes_of(p);
  for (const auto& b : module_.buffers()) total += bytes_of(b);
  // An optimizer whose state is serialized (not a LibTorch one) is not counted.
  for (const auto& t : detail::optimizer_state_tensors(optimizer_)) total += bytes_of(t);
  return total;
}

std::shared_ptr<const saved_state> module_host::save() {
  at::NoGradGuard no_grad;
  auto s = std::make_shared<module_state>();
  for (const auto& p : module_.named_parameters()) s->parameters.emplace_back(p.key(), copy(p.value()));
  for (const auto& b : module_.buffers()) s->buffers.push_back(copy(b));
  for (const auto& [key, state] : optimizer_.state()) {
    auto c = deep_copy(*state, nanguard::copy);
    if (!c) {
      s->state.clear();
      torch::serialize::OutputArchive archive;
      optimizer_.save(archive);
      std::ostringstream out;
      archive.save_to(out);
      s->serialized = out.str();
      break;
    }
    s->state.emplace_back(key, std::move(c));
  }
  return s;
}

void module_host::restore(const saved_state& saved) {
  const auto* s = dynamic_cast<const module_state*>(&saved);
  TORCH_INTERNAL_ASSERT(s, "nanguard::module_host::restore: the state was not saved by a module_host");
  at::NoGradGuard no_grad;
  const auto params = module_.parameters();
  const auto buffers = module_.buffers();
  TORCH_CHECK(params.size() == s->parameters.size() && buffers.size() == s->buffers.size(),
              "nanguard::module_host::restore: the module has ", params.size(), " parameters and ",
              buffers.size(), " buffers but the saved state ", s->parameters.size(), " and ", s->buffers.size(),
              "; do not add parameters after saving");
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(s->parameters[i].second);
  for (size_t i = 0; i < buffers.size(); ++i)
    if (buffers[i].defined()) buffers[i].copy_(s->buffers[i]);
  if (!s->serialized.empty()) {
    torch::serialize::InputArchive archive;
    std::istringstream in(s->serialized);
    archive.load_from(in);
    optimizer_.load(archive);
  } else {
    auto& state = optimizer_.state();
    state.clear();
    const at::Device device = params.empty() ? at::Device(at::kCPU) : params.front().device();
    for (const auto& [key, st] : s->state)
      state[key] = deep_copy(*st, [&](const at::Tensor& t) { return copy_to(t, device); });
  }
}

void scale_lrs(training_host& host, double factor) {
  std::vector<double> lrs = host.lrs();
  for (double& lr : lrs) lr *= factor;
  host.set_lrs(lrs);
}

}  // namespace nanguard
