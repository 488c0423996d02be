#include "nanguard/snapshot.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

namespace nanguard {

namespace {

double l2(const at::Tensor& t) { return t.to(at::kDouble).norm().item<double>(); }

// "84 GB", "1.2 MB", "512 B".
std::string byte_text(int64_t bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  double v = double(bytes);
  size_t u = 0;
  while (v >= 1000 && u + 1 < std::size(units)) {
    v /= 1000;
    ++u;
  }
  return fmt::format("{:.3g} {}", v, units[u]);
}

void check_sizes(int64_t capacity, int64_t far_every) {
  TORCH_CHECK(capacity >= 1, "nanguard::snapshot_ring: capacity must be >= 1 but is ", capacity,
              "; keep at least one snapshot");
  TORCH_CHECK(far_every >= 0, "nanguard::snapshot_ring: far_every must be >= 0 but is ", far_every,
              "; 0 keeps no older snapshots");
}

}  // namespace

snapshot_ring::snapshot_ring(training_host& host, int64_t capacity, int64_t far_every)
    : host_(host), capacity_(capacity), far_every_(far_every) {
  check_sizes(capacity, far_every);
}

snapshot_ring::snapshot_ring(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t capacity,
                             int64_t far_every)
    : own_host_(std::make_unique<module_host>(module, optimizer)), host_(*own_host_), capacity_(capacity),
      far_every_(far_every) {
  check_sizes(capacity, far_every);
}

snapshot_ring::~snapshot_ring() = default;

bool snapshot_ring::take(int64_t step) {
  TORCH_CHECK(ring_.empty() || step > ring_.back().step, "nanguard::snapshot_ring::take: step ", step,
              " is not after the newest snapshot's (", ring_.back().step, ")");
  const int64_t bytes = host_.state_bytes();
  if (memory_budget_ > 0 && bytes > memory_budget_) {
    refusal_ = fmt::format("a snapshot takes {}, over the memory budget of {}", byte_text(bytes),
                           byte_text(memory_budget_));
    return false;
  }
  refusal_.clear();
  fit(bytes);
  const auto last_far = std::find_if(ring_.rbegin(), ring_.rend(), [](const snapshot& s) { return s.far; });
  const bool far = far_every_ > 0 && (last_far == ring_.rend() || step / far_every_ > last_far->step / far_every_);
  ring_.push_back({step, host_.save(), far, bytes});
  prune();
  return true;
}

void snapshot_ring::set_memory_budget(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "nanguard::snapshot_ring::set_memory_budget: the budget must be >= 0 bytes but is ",
              bytes, "; 0 sets no bound");
  memory_budget_ = bytes;
  fit(0);
}

int64_t snapshot_ring::held_bytes() const {
  int64_t total = 0;
  for (const snapshot& s : ring_) total += s.bytes;
  return total;
}

// Drops the oldest snapshots until `more` bytes fit besides the others.
void snapshot_ring::fit(int64_t more) {
  while (memory_budget_ > 0 && !ring_.empty() && held_bytes() + more > memory_budget_) ring_.pop_front();
}

// Keeps the `capacity` newest snapshots and the `capacity` newest far ones.
void snapshot_ring::prune() {
  int64_t newer = 0, newer_far = 0;
  for (auto it = ring_.end(); it != ring_.begin();) {
    --it;
    const bool keep = newer < capacity_ || (it->far && newer_far < capacity_);
    ++newer;
    newer_far += it->far;
    if (!keep) it = ring_.erase(it);
  }
}

int64_t snapshot_ring::restore() {
  TORCH_CHECK(!ring_.empty(), "nanguard::snapshot_ring::restore: no snapshot was taken yet; call "
              "take(step) first (the guard takes one every snapshot_every steps)");
  // Learning rates are not part of the snapshot: keep the current ones.
  const std::vector<double> lrs = host_.lrs();
  host_.restore(*ring_.back().state);
  host_.set_lrs(lrs);
  return ring_.back().step;
}

void snapshot_ring::drop_newest() {
  if (!ring_.empty()) ring_.pop_back();
}

int64_t snapshot_ring::newest_step() const { return ring_.empty() ? -1 : ring_.back().step; }

std::vector<int64_t> snapshot_ring::steps() const {
  std::vector<int64_t> out;
  for (const snapshot& s : ring_) out.push_back(s.step);
  return out;
}

std::vector<param_change> snapshot_ring::diff() const {
  TORCH_CHECK(!ring_.empty(), "nanguard::snapshot_ring::diff: no snapshot was taken yet; call take(step) first");
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> now;
  for (auto& [name, p] : host_.named_parameters()) now.emplace(name, p);
  std::vector<param_change> out;
  for (const auto& [name, then] : ring_.back().state->parameters) {
    const auto it = now.find(name);
    if (it == now.end()) continue;
    param_change c;
    c.name = name;
    // A snapshot of an accelerator's tensor is in host memory: compared on
    // the accelerator, after the snapshot's copy on the same stream.
    const at::Tensor before = then.to(it->second.device(), at::kDouble);
    c.norm_then = l2(before);
    c.norm_now = l2(it->second.detach());
    c.finite = std::isfinite(c.norm_now);
    c.absolute = c.finite ? l2(it->second.detach().to(at::kDouble) - before) : std::numeric_limits<double>::infinity();
    c.relative = c.finite ? c.absolute / (c.norm_then + 1e-12) : std::numeric_limits<double>::infinity();
    out.push_back(std::move(c));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const param_change& a, const param_change& b) { return a.relative > b.relative; });
  return out;
}

}  // namespace nanguard
