// scope_handle.h — the innermost open scope as a shared string, for the
// tracer to keep without copying (see nanguard/scope.h).
#pragma once

#include <memory>
#include <string>

namespace nanguard::detail {

/// The dotted path of the innermost open scope on this thread, or nullptr.
std::shared_ptr<const std::string> current_scope_handle();

}  // namespace nanguard::detail
