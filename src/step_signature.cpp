#include "nanguard/step_signature.h"

#include "detail/fnv1a.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace nanguard {
namespace {

uint64_t bits_of(double x) {
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

bool within(double a, double b, double rtol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (a == b) return true;
  return std::abs(a - b) <= rtol * std::max(std::abs(a), std::abs(b));
}

}  // namespace

uint64_t signature_of(double loss, const grad_report& grads) {
  detail::fnv1a d;  // the values' bits, in order
  d.add(bits_of(loss));
  for (double n : grads.norms) d.add(bits_of(n));
  for (int64_t c : grads.nonfinite_counts) d.add(static_cast<uint64_t>(c));
  return d.value() == 0 ? 1 : d.value();  // 0 means "not measured"
}

const char* to_string(signature_match m) {
  switch (m) {
    case signature_match::identical: return "identical";
    case signature_match::close: return "close";
    case signature_match::different: return "different";
  }
  return "?";
}

signature_match compare(const step_measure& a, const step_measure& b, double rtol) {
  if (signature_of(a.loss, a.grads) == signature_of(b.loss, b.grads)) return signature_match::identical;
  const grad_report &x = a.grads, &y = b.grads;
  if (x.norms.size() != y.norms.size() || x.nonfinite_counts != y.nonfinite_counts || !within(a.loss, b.loss, rtol))
    return signature_match::different;
  for (size_t i = 0; i < x.norms.size(); ++i)
    if (!within(x.norms[i], y.norms[i], rtol)) return signature_match::different;
  return signature_match::close;
}

std::string signature_text(uint64_t signature) {
  return signature == 0 ? std::string() : fmt::format("{:016x}", signature);
}

uint64_t signature_from_text(const std::string& text) {
  if (text.empty()) return 0;
  size_t used = 0;
  uint64_t value = 0;
  try {
    value = std::stoull(text, &used, 16);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && text.size() <= 16, "nanguard: a step signature is 16 hex digits, got '", text,
              "'");
  return value;
}

}  // namespace nanguard
