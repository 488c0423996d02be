// cause.h — the likely cause of a non-finite value as a finding carries it:
// the cause, the evidence, the remedy and how sure (struct diagnosis), with
// the names of the causes and confidences. diagnose() (diagnosis.h) decides
// it; the finding (finding.h) holds it.
//
//   const nanguard::cause c = nanguard::cause_from_string("division_by_zero");
//   std::cout << nanguard::to_string(c) << "\n";  // division_by_zero
#pragma once

#include <string>

namespace nanguard {

/// The likely cause of a non-finite value (docs/diagnosis.md).
enum class cause {
  unclassified,           ///< no class fits: the evidence is given raw
  log_of_nonpositive,     ///< log / log2 / log10 / log1p of 0 or a negative
  division_by_zero,       ///< 0/0 or x/0, typically a normalisation by a zero std, var, norm or sum
  overflow,               ///< exp / pow / cosh (or a sum, a product) beyond the dtype's largest value
  fully_masked_softmax,   ///< softmax of a row with no finite entry
  sqrt_at_zero,           ///< the backward of sqrt, a fractional pow or a norm at 0
  inverse_trig_at_bound,  ///< acos / asin / atanh at or beyond ±1
  inf_arithmetic,         ///< inf − inf or 0 × inf: the infinity came first
  precision_range,        ///< beyond float16 / bfloat16 range, or flushed to 0 by it
  divergence,             ///< the gradient norm or the loss spiked in the steps before
  bad_data,               ///< the non-finite value came in with the input batch
  masked_infinity_reduced,  ///< a sum, mean or loss read the infinities of a mask (label smoothing over -inf)
  constant_in_model,        ///< a NaN or Inf written in the model's code as a number (`x * float("nan")`)
};

/// Every cause, in declaration order.
inline constexpr cause all_causes[] = {cause::unclassified,
                                       cause::log_of_nonpositive,
                                       cause::division_by_zero,
                                       cause::overflow,
                                       cause::fully_masked_softmax,
                                       cause::sqrt_at_zero,
                                       cause::inverse_trig_at_bound,
                                       cause::inf_arithmetic,
                                       cause::precision_range,
                                       cause::divergence,
                                       cause::bad_data,
                                       cause::masked_infinity_reduced,
                                       cause::constant_in_model};
/// "log_of_nonpositive", "division_by_zero", ... (the enum's name).
const char* to_string(cause c);
/// The cause whose to_string is `name`. Throws c10::Error listing the names for another.
cause cause_from_string(const std::string& name);

/// How far the evidence goes: `high` when the op and its numbers agree,
/// `low` when the class is a guess (and for `unclassified`).
enum class confidence { low, medium, high };

/// Every confidence, in declaration order.
inline constexpr confidence all_confidences[] = {confidence::low, confidence::medium, confidence::high};
/// "low" / "medium" / "high".
const char* to_string(confidence c);
/// The confidence whose to_string is `name`. Throws c10::Error listing the names for another.
confidence confidence_from_string(const std::string& name);

/// A finding's likely cause, the evidence for it, and the fix.
struct diagnosis {
  nanguard::cause cause = cause::unclassified;  ///< the class
  std::string evidence;  ///< one sentence with the numbers it rests on
  std::string remedy;    ///< what to change: C++ and Python one-liners, the nanguard option
  nanguard::confidence confidence = confidence::low;  ///< how sure
};

/// Two lines: `cause (confidence): evidence` and `  remedy: ...`.
std::string to_string(const diagnosis& d);

}  // namespace nanguard
