// enum_from_string.h — the one way nanguard reads an enum back from its
// name: the value whose to_string is `name`, else an error listing the names.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <string>

namespace nanguard::detail {

/// Every name of `values`, quoted: "'a', 'b', 'c'".
template <typename E, size_t N>
std::string quoted_names(const E (&values)[N]) {
  std::string valid;
  for (E v : values) valid += (valid.empty() ? "'" : ", '") + std::string(to_string(v)) + "'";
  return valid;
}

/// The value among `values` whose to_string is `name`. Throws c10::Error
/// naming `what` ("policy"), the value and every valid name.
template <typename E, size_t N>
E enum_from_string(const std::string& name, const E (&values)[N], const char* what) {
  for (E v : values)
    if (name == to_string(v)) return v;
  TORCH_CHECK(false, "nanguard::", what, "_from_string: ", what, " must be one of ", quoted_names(values), " but is '",
              name, "'");
}

/// The same for the field `key` of a file a reader (`where`:
/// "nanguard::finding_from_json") reads: the error names the reader, the
/// field, the value and every valid name.
template <typename E, size_t N>
E enum_field_from_string(const std::string& name, const E (&values)[N], const char* where, const char* key) {
  for (E v : values)
    if (name == to_string(v)) return v;
  TORCH_CHECK(false, where, ": '", key, "' is '", name, "'; expected one of ", quoted_names(values));
}

}  // namespace nanguard::detail
