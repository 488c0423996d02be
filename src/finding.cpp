// finding.cpp — a finding as text (to_string, to_text), the names of its
// enums, and the error that carries it. Its JSON form is finding_json.cpp.
#include "nanguard/finding.h"

#include "detail/enum_from_string.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace nanguard {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// "nan", "inf", "-inf" (fmt would print "-nan" for some NaNs).
std::string value_string(double v) {
  if (std::isnan(v)) return "nan";
  return fmt::format("{}", v);
}

}  // namespace

const char* to_string(direction d) {
  switch (d) {
    case direction::forward: return "forward";
    case direction::backward: return "backward";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: direction ", static_cast<int>(d), " has no name");
}

direction direction_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_directions, "direction");
}

const char* to_string(role r) {
  switch (r) {
    case role::producer: return "producer";
    case role::propagator: return "propagator";
    case role::input: return "input";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: role ", static_cast<int>(r), " has no name");
}

role role_from_string(const std::string& name) { return detail::enum_from_string(name, all_roles, "role"); }

std::vector<int64_t> element_position(const finding& f) {
  const bool listed = f.output >= 0 && f.output < int(f.outputs.size()) && f.index >= 0;
  if (!listed) return {f.index};
  const std::vector<int64_t>& shape = f.outputs[size_t(f.output)].shape;
  std::vector<int64_t> position(shape.size());
  int64_t rest = f.index;
  for (size_t d = shape.size(); d-- > 0;) {  // row-major: the last dimension varies fastest
    if (shape[d] <= 0) return {f.index};
    position[d] = rest % shape[d];
    rest /= shape[d];
  }
  return rest == 0 ? position : std::vector<int64_t>{f.index};
}

std::string to_string(const finding& f) {
  const std::string source = to_string(f.source);
  std::string where = f.module.empty() ? "" : " in " + f.module;
  std::string node = f.node.empty() ? "" : fmt::format(" ({} of {})", f.node, f.forward_op.empty() ? "?" : f.forward_op);
  std::string culprit = f.culprit.empty() ? "" : fmt::format(" from {}", f.culprit);
  std::string rank = f.rank >= 0 ? fmt::format(" rank {}", f.rank) : "";
  std::string sample = f.dataset_index >= 0 ? fmt::format(", dataset index {}", f.dataset_index) : "";
  return fmt::format("{}step {}{} {} {}{}{}: {}{}, output {} {} = {}{}", source.empty() ? "" : source + ": ", f.step,
                     rank, to_string(f.direction), f.op, node, where, to_string(f.role), culprit, f.output,
                     shape_string(element_position(f)), value_string(f.value), sample);
}

std::string to_text(const finding& f) {
  std::string out = fmt::format("non-finite value at step {}{}\n", f.step,
                                f.rank >= 0 ? fmt::format(" on rank {}", f.rank) : "");
  if (f.source.known()) out += fmt::format("  source:    {}\n", to_string(f.source));
  out += fmt::format("  op:        {} ({}{})\n", f.op, to_string(f.direction),
                     f.caller.empty() ? "" : ", inside " + f.caller);
  if (!f.node.empty())
    out += fmt::format("  node:      {} (created by forward {})\n", f.node,
                       f.forward_op.empty() ? "?" : f.forward_op);
  out += fmt::format("  module:    {}\n", f.module.empty() ? "(unknown)" : f.module);
  out += fmt::format("  role:      {}{}\n", to_string(f.role),
                     f.culprit.empty() ? "" : " (non-finite " + f.culprit + ")");
  out += fmt::format("  element:   output {} {} (flat index {}) = {}\n", f.output, shape_string(element_position(f)),
                     f.index, value_string(f.value));
  if (f.dataset_index >= 0) out += fmt::format("  sample:    dataset index {}\n", f.dataset_index);
  for (const auto* group : {&f.inputs, &f.outputs})
    for (const auto& r : *group)
      out += fmt::format("  {:<10} {} {}: {}\n", r.name + ":", r.dtype, shape_string(r.shape),
                         to_string(r.stats));
  const diagnosis& d = f.diagnosis;
  out += fmt::format("  cause:     {} ({} confidence)\n", to_string(d.cause), to_string(d.confidence));
  out += fmt::format("  evidence:  {}\n", d.evidence);
  out += fmt::format("  remedy:    {}\n", d.remedy);
  for (const remedy_check& c : f.remedy_checks) out += fmt::format("  verified:  {}\n", to_string(c));
  if (!f.backtrace.empty()) out += "  backtrace:\n" + f.backtrace + "\n";
  return out;
}

namespace {

// What a nonfinite_error says: where the value was born, its likely cause and the remedy.
std::string error_message(const finding& f) {
  std::string m = "nanguard: non-finite value: " + to_string(f) + "; cause: " + to_string(f.diagnosis.cause);
  if (!f.diagnosis.remedy.empty()) m += "; remedy: " + f.diagnosis.remedy;
  std::replace(m.begin(), m.end(), '\n', ' ');
  return m;
}

}  // namespace

nonfinite_error::nonfinite_error(nanguard::finding f)
    : c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, error_message(f)), finding_(std::move(f)) {}

}  // namespace nanguard
