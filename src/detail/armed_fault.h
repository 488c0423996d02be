// armed_fault.h — what the guard's replays tell the armed fault injector
// (fault_injection.h), without holding it: a run of the step starts again.
#pragma once

namespace nanguard::detail {

/// Counts the targeted op's calls from 0 again (nothing when no fault is armed).
void rewind_armed_fault();

}  // namespace nanguard::detail
