// step_signature.h — a step's fingerprint, at no extra pass over the
// gradients: its loss and the per-parameter gradient norms and NaN/Inf
// counts the sentinel's one fused pass measured, hashed into 64 bits. A run
// of the same step from the same parameters, batch and RNG state gives the
// same signature when the run is deterministic (docs/hardware-or-software.md
// says what to turn on); another one says that one of the two runs computed
// something else: a transient fault, or a kernel that is not deterministic.
//
//   const nanguard::step_measure first{loss_value, sentinel.inspect_grads()};
//   // ... the step again, from the same parameters, batch and RNG state ...
//   const nanguard::step_measure second{loss_value, sentinel.inspect_grads()};
//   if (nanguard::compare(first, second) == nanguard::signature_match::different) std::cerr << "one run differs\n";
#pragma once

#include <nanguard/sentinel.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nanguard {

/// What a step's run measured of itself: enough to compare two runs.
struct step_measure {
  double loss = 0;
  grad_report grads;
};

/// The 64-bit fingerprint of a run (never 0: 0 means "not measured").
uint64_t signature_of(double loss, const grad_report& grads);

/// How two runs of one step compare.
enum class signature_match {
  identical,  ///< the same bits: loss, every norm and count
  close,      ///< not bit-identical, every value within `rtol` (a reduction in another order)
  different,  ///< a value apart by more, or NaN/Inf counts that differ
};
const char* to_string(signature_match m);

/// Compares two runs of the same step, value by value.
signature_match compare(const step_measure& a, const step_measure& b, double rtol = 1e-5);

/// 16 hex digits, as the event log writes a signature; "" for 0.
std::string signature_text(uint64_t signature);
/// The signature of `signature_text`'s text ("" is 0). Throws c10::Error for another text.
uint64_t signature_from_text(const std::string& text);

}  // namespace nanguard
