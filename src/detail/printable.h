// printable.h — user text (a CSV cell, a line of an event log) quoted in an
// error message, with its control bytes shown rather than sent to the terminal.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace nanguard::detail {

/// `s` with its control bytes written as \xNN: a NUL cut the message short,
/// an escape sequence redrew the user's terminal.
inline std::string printable(std::string_view s) {
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f)
      out += fmt::format("\\x{:02x}", u);
    else
      out += c;
  }
  return out;
}

}  // namespace nanguard::detail
