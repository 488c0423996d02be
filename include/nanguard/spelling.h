// spelling.h — the language nanguard's messages spell code in: C++ for the
// library and the `nanguard` command, Python once the Python module is
// imported (it says so then). An error message names the fix in its user's
// language, and a finding diagnosed without a front end (a tracer on its
// own) gets that language's remedies.
//
//   TORCH_CHECK_TYPE(x.is_floating_point(), "nanguard::census: ...; convert with ", nanguard::spelled("x.to(at::kFloat)", "x.float()"));
//   // C++: "... convert with x.to(at::kFloat)"; from Python: "... convert with x.float()"
#pragma once

namespace nanguard {

/// A language a message spells code in.
enum class spelling { cpp, python };

/// The language this process's messages spell code in: cpp unless
/// set_message_spelling chose python.
spelling message_spelling();

/// Sets message_spelling() for the whole process (the Python module, when imported).
void set_message_spelling(spelling s);

/// `cpp` or `python`, whichever language message_spelling() is.
const char* spelled(const char* cpp, const char* python);

}  // namespace nanguard
