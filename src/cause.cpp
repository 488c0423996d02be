#include "nanguard/cause.h"

#include "detail/enum_from_string.h"

#include <fmt/format.h>

#include <iterator>

namespace nanguard {
namespace {

// In the order of enum class cause (all_causes).
constexpr const char* kCauseNames[] = {
    "unclassified", "log_of_nonpositive", "division_by_zero", "overflow", "fully_masked_softmax", "sqrt_at_zero",
    "inverse_trig_at_bound", "inf_arithmetic", "precision_range", "divergence", "bad_data",
    "masked_infinity_reduced", "constant_in_model"};
static_assert(std::size(kCauseNames) == size_t(cause::constant_in_model) + 1, "a name for every cause");
static_assert(std::size(all_causes) == std::size(kCauseNames), "every cause in all_causes");

// In the order of enum class confidence (all_confidences).
constexpr const char* kConfidenceNames[] = {"low", "medium", "high"};
static_assert(std::size(kConfidenceNames) == size_t(confidence::high) + 1, "a name for every confidence");
static_assert(std::size(all_confidences) == std::size(kConfidenceNames), "every confidence in all_confidences");

}  // namespace

const char* to_string(cause c) { return kCauseNames[static_cast<int>(c)]; }

cause cause_from_string(const std::string& name) { return detail::enum_from_string(name, all_causes, "cause"); }

const char* to_string(confidence c) { return kConfidenceNames[static_cast<int>(c)]; }

confidence confidence_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_confidences, "confidence");
}

std::string to_string(const diagnosis& d) {
  return fmt::format("{} ({}): {}\n  remedy: {}", to_string(d.cause), to_string(d.confidence), d.evidence, d.remedy);
}

}  // namespace nanguard
