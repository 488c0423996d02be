// printable.h — user text (a CSV cell or column name, a line of an event
// log) quoted in an error message or a table, with its control bytes shown
// rather than sent to the terminal, and measured in the columns it takes.
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

/// The columns UTF-8 `s` takes in a terminal, counted as fmt counts them
/// when it pads a field (`{:<{}}`) or cuts one (`{:.{}}`): two for an East
/// Asian wide character, one for any other. So a table whose widths come
/// from here lines up with what fmt prints.
inline size_t display_width(std::string_view s) {
  size_t width = 0;
  fmt::detail::for_each_codepoint(fmt::string_view(s.data(), s.size()), [&](uint32_t cp, fmt::string_view) {
    width += fmt::detail::display_width_of(cp);
    return true;
  });
  return width;
}

}  // namespace nanguard::detail
