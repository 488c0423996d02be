#include "nanguard/remedy_check.h"

#include "detail/enum_from_string.h"

#include <fmt/format.h>

#include <iterator>

namespace nanguard {
namespace {

// In the order of enum class remedy_kind (all_remedy_kinds).
constexpr const char* kRemedyNames[] = {"none",    "lr_cut",       "loss_scale_cut",  "skip_rows",
                                        "float32", "safe_softmax", "denominator_eps", "clamp_input"};
static_assert(std::size(kRemedyNames) == size_t(remedy_kind::clamp_input) + 1, "a name for every remedy kind");
static_assert(std::size(all_remedy_kinds) == std::size(kRemedyNames), "every remedy kind in all_remedy_kinds");

// In the order of enum class check_result (all_check_results).
constexpr const char* kResultNames[] = {"finite", "still_nonfinite", "not_checkable"};
static_assert(std::size(kResultNames) == size_t(check_result::not_checkable) + 1, "a name for every result");
static_assert(std::size(all_check_results) == std::size(kResultNames), "every result in all_check_results");

}  // namespace

const char* to_string(remedy_kind k) { return kRemedyNames[static_cast<int>(k)]; }

remedy_kind remedy_kind_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_remedy_kinds, "remedy_kind");
}

const char* to_string(check_result r) { return kResultNames[static_cast<int>(r)]; }

check_result check_result_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_check_results, "check_result");
}

std::string to_string(const remedy_check& c) {
  const std::string what = c.applied.empty() ? to_string(c.remedy) : c.applied;
  const std::string detail = c.detail.empty() ? "" : ": " + c.detail;
  switch (c.result) {
    case check_result::finite:
      return fmt::format("verified finite: {} (replayed loss {:.6g}){}", what, c.loss, detail);
    case check_result::still_nonfinite: return fmt::format("still non-finite: {}{}", what, detail);
    case check_result::not_checkable: return fmt::format("not checkable: {}{}", what, detail);
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: check result ", static_cast<int>(c.result), " has no name");
}

const remedy_check* verified_remedy(const std::vector<remedy_check>& checks) {
  for (const remedy_check& c : checks)
    if (c.result == check_result::finite) return &c;
  return nullptr;
}

}  // namespace nanguard
