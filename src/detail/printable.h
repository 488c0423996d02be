// printable.h — user text (a CSV cell or column name, a line of an event
// log) quoted in an error message or a table, with its control bytes shown
// rather than sent to the terminal, and cut without splitting a UTF-8 character.
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

/// The number of characters (code points) of UTF-8 `s`; a byte that starts
/// none (invalid UTF-8) counts as one.
inline size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
  return n;
}

/// The first `n` characters of UTF-8 `s`: a cut that never splits one.
inline std::string_view utf8_prefix(std::string_view s, size_t n) {
  size_t end = 0;
  for (size_t chars = 0; end < s.size(); ++end)
    if ((static_cast<unsigned char>(s[end]) & 0xc0) != 0x80 && chars++ == n) break;
  return s.substr(0, end);
}

}  // namespace nanguard::detail
