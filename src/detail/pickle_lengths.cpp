#include "pickle_lengths.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

namespace nanguard::detail {
namespace {

// The opcodes whose argument is a fixed number of bytes, and that number.
int fixed_argument_bytes(uint8_t op) {
  switch (op) {
    case 'K': case 'q': case 'h': case 0x80: case 0x82: return 1;  // BININT1 BINPUT BINGET PROTO EXT1
    case 'M': case 0x83: return 2;                                  // BININT2 EXT2
    case 'J': case 'r': case 'j': case 0x84: return 4;              // BININT LONG_BINPUT LONG_BINGET EXT4
    case 'G': case 0x95: return 8;                                  // BINFLOAT FRAME
    default: return -1;
  }
}

// The opcodes whose argument is a length of this many bytes, then that many bytes.
int length_prefix_bytes(uint8_t op) {
  switch (op) {
    case 0x8c: case 'C': case 'U': case 0x8a: return 1;  // SHORT_BINUNICODE SHORT_BINBYTES SHORT_BINSTRING LONG1
    case 'X': case 'B': case 'T': case 0x8b: return 4;   // BINUNICODE BINBYTES BINSTRING LONG4
    case 0x8d: case 0x8e: case 0x96: return 8;           // BINUNICODE8 BINBYTES8 BYTEARRAY8
    default: return -1;
  }
}

// The opcodes whose argument is this many newline-terminated lines.
int argument_lines(uint8_t op) {
  switch (op) {
    case 'c': case 'i': return 2;  // GLOBAL INST
    case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'g': case 'p': return 1;
    default: return 0;
  }
}

// Opcodes with no argument.
bool takes_no_argument(uint8_t op) {
  static const char kOps[] = "]})(aeltusRbNQ012do"                       // protocol 0 and 1
                             "\x81\x85\x86\x87\x88\x89"                      // NEWOBJ TUPLE1-3 NEWTRUE NEWFALSE
                             "\x8f\x90\x91\x92\x93\x94\x97\x98";             // protocol 4 and 5 sets, STACK_GLOBAL, MEMOIZE, buffers
  return std::memchr(kOps, op, sizeof kOps - 1) != nullptr;
}

}  // namespace

void check_pickle_lengths(const char* data, size_t size) {
  size_t at = 0;
  const auto take = [&](uint64_t bytes) {
    TORCH_CHECK(bytes <= size - at, "its pickle declares ", bytes, " bytes at offset ", at, " where ", size - at,
                " are left");
    at += bytes;
  };
  const auto little_endian = [&](int width) {
    take(width);
    uint64_t v = 0;
    for (int b = 0; b < width; ++b) v |= uint64_t(uint8_t(data[at - width + b])) << (8 * b);
    return v;
  };
  while (at < size) {
    const uint8_t op = uint8_t(data[at++]);
    if (op == '.') return;  // STOP
    if (const int width = fixed_argument_bytes(op); width > 0) {
      take(width);
    } else if (const int prefix = length_prefix_bytes(op); prefix > 0) {
      take(little_endian(prefix));
    } else if (const int lines = argument_lines(op); lines > 0) {
      for (int l = 0; l < lines; ++l) {
        const void* end = std::memchr(data + at, '\n', size - at);
        if (!end) return;  // the unpickler refuses a missing newline itself
        at = size_t(static_cast<const char*>(end) - data) + 1;
      }
    } else if (!takes_no_argument(op)) {
      return;
    }
  }
}

}  // namespace nanguard::detail
