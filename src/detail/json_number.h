// json_number.h — JSON has no NaN or Inf: nanguard writes them as the
// strings "nan", "inf" and "-inf" and reads them back.
#pragma once

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <string>

namespace nanguard::detail {

/// `v` as JSON: a number, or "nan" / "inf" / "-inf".
inline nlohmann::json json_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

/// Reads back `json_number`; `where` names the caller in the error.
inline double number_from_json(const nlohmann::json& j, const char* where) {
  if (j.is_number()) return j.get<double>();
  TORCH_CHECK(j.is_string(), where, ": expected a number or \"nan\"/\"inf\"/\"-inf\", got ", j.dump());
  const std::string s = j.get<std::string>();
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  TORCH_CHECK(false, where, ": '", s, "' is not a number (expected a number or nan/inf/-inf)");
}

}  // namespace nanguard::detail
