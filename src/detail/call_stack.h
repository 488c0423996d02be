// call_stack.h — the Python and TorchScript frames of this thread, captured
// cheaply (code objects and offsets, LibTorch's CapturedTraceback: a
// microsecond or two) and resolved to the user's line only when a finding
// needs it (source_location.h).
#pragma once

#include "nanguard/source_location.h"

#include <memory>
#include <vector>

namespace torch {
struct CapturedTraceback;
namespace jit {
struct StackEntry;
}
}  // namespace torch

namespace nanguard::detail {

/// The frames of a thread at one moment.
struct captured_stack {
  std::shared_ptr<torch::CapturedTraceback> python;  ///< Python's frames
  std::vector<torch::jit::StackEntry> script;         ///< TorchScript's, innermost first
};

/// A captured stack; null when there was nothing to capture.
using call_stack = std::shared_ptr<const captured_stack>;

/// This thread's stack now: Python frames (none from a thread that cannot
/// take the GIL) and TorchScript's, no C++ ones.
/// NOTE: takes the GIL: never call it holding a lock that a thread holding
/// the GIL may wait for.
call_stack capture_call_stack();

/// The innermost frame of `stack` outside the library paths, TorchScript's
/// first (it runs inside the Python call; a model loaded from a file by the
/// line of the Python source it was scripted from, when its debug
/// information kept it); unknown for a null stack or one with only library
/// frames. Takes the GIL, as above.
source_location user_frame(const call_stack& stack);

}  // namespace nanguard::detail
