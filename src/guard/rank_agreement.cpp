#include "guard/rank_agreement.h"

#include <c10/util/Exception.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace nanguard::detail {

namespace {

// "1, 3".
std::string rank_list(const std::vector<int64_t>& ranks) { return fmt::format("{}", fmt::join(ranks, ", ")); }

// This rank's verdict, note and findings (tagged with `rank`), as share_findings sends them.
std::string findings_payload(step_event& e, int64_t rank) {
  nlohmann::json j;
  j["verdict"] = to_string(e.verdict);
  j["note"] = e.note;
  j["findings"] = nlohmann::json::array();
  for (finding& f : e.findings) {
    f.rank = rank;
    j["findings"].push_back(nlohmann::json::parse(to_json(f)));
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

rank_agreement::rank_agreement(distributed& group, const sentinel& sentinel, const loss_scaler& scaler,
                               const guard_options& options)
    : group_(group), sentinel_(sentinel), scaler_(scaler), options_(options) {}

void rank_agreement::check_same_parameters() const {
  // Ranks that each hold a shard of the model have as many parameters, not as many elements.
  group_.check_same_parameters(sentinel_.parameters(), collective() != backward_collective::reduce_scatter &&
                                                           group_.options().average_gradients());
}

int64_t rank_agreement::rank0s(int64_t value) const {
  return std::stoll(group_.broadcast(std::to_string(value), 0));
}

bool rank_agreement::agree(step_record& r, int64_t step) {
  step_event& e = r.event;
  e.rank = group_.rank();
  const bool finite = r.locally_finite;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double norm = r.report.finite() ? e.grad_norm : nan;  // NaN: every rank learns of it
  const consensus c = group_.agree(!finite, finite ? norm : 0.0, finite ? e.loss : 0.0, step);
  e.nonfinite_ranks = c.nonfinite_ranks;
  if (!c.finite()) {
    if (e.reason.empty()) e.reason = "non-finite on rank(s) " + rank_list(c.nonfinite_ranks);
    return false;
  }
  if (!std::isfinite(c.grad_norm)) {
    // Every rank's loss was finite: the replay tells whose own gradients were not (name_origin).
    e.reason = "non-finite gradients after the " + std::string(to_string(collective()));
    return false;
  }
  e.loss = c.loss_sum / static_cast<double>(group_.world_size());  // the spike windows see the same loss everywhere
  if (collective() == backward_collective::all_reduce) return true;  // averaged: the same norm on every rank
  if (collective() == backward_collective::reduce_scatter || !group_.options().average_gradients()) {
    e.grad_norm = c.grad_norm;  // each rank holds a shard of the gradients
    return true;
  }
  return average_and_measure(r, step);
}

// Averages the gradients and measures them again: the norm every rank clips by.
bool rank_agreement::average_and_measure(step_record& r, int64_t step) {
  step_event& e = r.event;
  group_.average_gradients_(sentinel_.parameters(), step);
  r.report = sentinel_.inspect_grads(scaler_.inv_scale());
  e.grad_norm = r.report.total_norm;
  e.top_norms = top_norms(sentinel_.names(), r.report.norms, options_.log_top_norms());
  if (r.report.finite()) return true;
  // Identical on every rank: the sum overflowed in the all-reduce.
  e.reason = "non-finite averaged gradients";
  add_note(e.note, "the averaged gradients are not finite although every rank's were (overflow in the gradient "
                   "all-reduce)");
  return false;
}

bool rank_agreement::checksums_agree(step_event& e, int64_t step) {
  const int64_t k = group_.options().check_every();
  if (k <= 0 || step % k != 0 || !group_.options().average_gradients() || collective() != backward_collective::none)
    return true;
  const std::vector<int64_t> differ = group_.check_consistency(sentinel_.parameters());
  if (differ.empty()) return true;
  e.reason = "gradient checksum differs on rank(s) " + rank_list(differ);
  const std::string note =
      "gradient checksum differs after averaging on rank(s) " + rank_list(differ) + " (silent data corruption?)";
  add_note(e.note, note);
  TORCH_WARN("nanguard::guard: step ", step, ": ", note);
  return false;
}

void rank_agreement::share_findings(step_event& e) {
  if (e.nonfinite_ranks.empty()) return;  // overflow in the all-reduce: nobody replayed
  std::vector<finding> all;
  std::optional<nanguard::verdict> first_verdict;
  std::string note;
  for (int64_t r : e.nonfinite_ranks) {
    const bool own = r == group_.rank();
    const nlohmann::json j = nlohmann::json::parse(group_.broadcast(own ? findings_payload(e, r) : "", r));
    if (!first_verdict) first_verdict = verdict_from_string(j.value("verdict", std::string()));
    const std::string n = j.value("note", std::string());
    if (!n.empty()) add_note(note, "rank " + std::to_string(r) + ": " + n);
    if (own)  // this rank's own, with the input values (for the bundle) JSON does not carry
      all.insert(all.end(), e.findings.begin(), e.findings.end());
    else
      for (const auto& f : j.at("findings")) all.push_back(finding_from_json(f.dump()));
  }
  e.findings = std::move(all);
  e.verdict = first_verdict.value_or(verdict::none);
  e.note = note;
}

// Under trace_every_step the first consensus carried every rank's own
// gradients already: none of them was bad. Without a replay or a live
// trace nobody knows.
void rank_agreement::name_origin(std::optional<bool> own_bad, step_event& e, int64_t step) {
  const std::string c = to_string(collective());
  if (!own_bad && !options_.trace_every_step()) {
    add_note(e.note, fmt::format("every rank's loss was finite: the NaN/Inf came from a rank's own gradients or "
                                 "the model's {}; a replay (replay on, and guard.check's replay=) names the rank",
                                 c));
    return;
  }
  if (own_bad) e.nonfinite_ranks = group_.agree(*own_bad, 0.0, 0.0, step).nonfinite_ranks;
  if (e.nonfinite_ranks.empty())
    add_note(e.note, fmt::format("the gradients are not finite after the model's {} although every rank's own "
                                 "were in the replay (overflow in the {})", c, c));
  else
    e.reason = "non-finite gradients on rank(s) " + rank_list(e.nonfinite_ranks);
}

void rank_agreement::note_received(const grad_report& report, step_event& e) const {
  if (report.finite() || e.nonfinite_ranks.empty()) return;
  add_note(e.note, fmt::format("this rank's own gradients were finite: the NaN/Inf was received from rank {} via {}",
                               rank_list(e.nonfinite_ranks), to_string(collective())));
}

bool rank_agreement::is_origin(const step_event& e) {
  return e.rank < 0 || std::find(e.nonfinite_ranks.begin(), e.nonfinite_ranks.end(), e.rank) != e.nonfinite_ranks.end();
}

}  // namespace nanguard::detail
