#include "nanguard/policy.h"

#include "detail/enum_from_string.h"

#include <c10/util/Exception.h>

namespace nanguard {

const char* to_string(policy p) {
  switch (p) {
    case policy::automatic: return "auto";
    case policy::skip: return "skip";
    case policy::backoff: return "backoff";
    case policy::rollback: return "rollback";
    case policy::abort: return "abort";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: policy ", static_cast<int>(p), " has no name");
}

policy policy_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_policies, "policy");
}

}  // namespace nanguard
