// enum_from_string.h — the one way nanguard reads an enum back from its
// name: the value whose to_string is `name`, else an error listing the names.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <string>

namespace nanguard::detail {

/// The value among `values` whose to_string is `name`. Throws c10::Error
/// naming `what` ("policy"), the value and every valid name.
template <typename E, size_t N>
E enum_from_string(const std::string& name, const E (&values)[N], const char* what) {
  std::string valid;
  for (E v : values) {
    if (name == to_string(v)) return v;
    valid += (valid.empty() ? "'" : ", '") + std::string(to_string(v)) + "'";
  }
  TORCH_CHECK(false, "nanguard::", what, "_from_string: ", what, " must be one of ", valid, " but is '", name, "'");
}

}  // namespace nanguard::detail
