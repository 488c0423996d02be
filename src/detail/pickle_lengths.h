// pickle_lengths.h — a check of the lengths a pickle stream declares, before
// torch's unpickler trusts them: it reserves what a string or bytes opcode
// declares before reading it, so a corrupt 2 KB .pt file could ask for
// gigabytes (found by fuzz/bundle_fuzz).
#pragma once

#include <cstddef>

namespace nanguard::detail {

/// Walks the opcodes of a pickle stream (protocol 0 to 5) and throws
/// c10::Error when a length-prefixed argument declares more bytes than the
/// stream has left. Stops, without judging, at STOP or at an opcode it does
/// not know (the unpickler refuses those itself).
void check_pickle_lengths(const char* data, size_t size);

}  // namespace nanguard::detail
