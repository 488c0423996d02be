// source_location.h — the line of the user's code an op ran from: what a
// finding shows first (`train.py:42 (forward): step 3 forward aten::div ...`).
//
// The tracer reads it from the Python stack of the thread that ran the op
// (and from TorchScript's call stack inside scripted code), at the moment it
// makes a finding, so healthy ops pay nothing; a backward node's is the
// stack of the forward op that made the node, recorded only by a tracer
// with tracer_options::record_sources (the guard's replay, nanguard.trace).
// The innermost
// frame outside the library paths is the user's: the Python module sets
// torch's and nanguard's packages, so that `x / x.std()` written in a
// model's forward is named there, not in torch/_tensor.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nanguard {

/// A line of the user's code.
struct source_location {
  std::string file;      ///< as Python names it: "/home/me/train.py"
  int64_t line = 0;      ///< 1-based; 0 when unknown
  std::string function;  ///< "forward", "<module>"

  /// True when a line is known.
  bool known() const { return line > 0; }
};

/// `train.py:42 (forward)`; "" when unknown.
std::string to_string(const source_location& where);

/// Frames from files under these directories are library code, not the
/// user's: a source_location names the innermost frame outside them. By
/// default the torch package LibTorch was loaded from (a scripted model's
/// archive names torch's own Python files: nn.Linear's forward).
/// NOTE: process-wide; set once, before tracing.
void set_library_paths(std::vector<std::string> directories);

/// The directories set_library_paths() set.
std::vector<std::string> library_paths();

}  // namespace nanguard
