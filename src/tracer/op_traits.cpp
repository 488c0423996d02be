#include "op_traits.h"

#include "detail/op_tensors.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>

namespace nanguard::detail {
namespace {

bool one_of(const char* op, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (std::strcmp(op, n) == 0) return true;
  return false;
}

// True when ATen runs the op as CompositeImplicitAutograd on every backend
// nanguard meets: no backend or explicit kernel of its own can write raw.
bool is_composite(const c10::OperatorHandle& op) {
  using c10::DispatchKey;
  return op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd) &&
         !op.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd) &&
         !op.hasKernelForDispatchKey(DispatchKey::CPU) && !op.hasKernelForDispatchKey(DispatchKey::CUDA);
}

op_traits make_traits(const at::RecordFunction& fn) {
  const char* name = fn.name();
  op_traits t;
  // In-place ops that change how a tensor is seen, not its values.
  const bool metadata_only = one_of(name, {"detach_", "aten::detach_", "aten::requires_grad_", "aten::squeeze_",
                                           "aten::unsqueeze_", "aten::t_", "aten::transpose_", "aten::as_strided_",
                                           "aten::swapdims_", "aten::swapaxes_"});
  t.inplace = is_inplace(name) && !metadata_only;
  t.overwrites_self = t.inplace && one_of(name, {"aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_",
                                                 "aten::uniform_", "aten::random_", "aten::bernoulli_",
                                                 "aten::exponential_", "aten::set_"});
  t.allocates_only = allocates_only(name);
  t.loops_over_slices = one_of(name, {"aten::bmm", "aten::baddbmm"});
  t.collective = std::strncmp(name, "c10d::", 6) == 0;
  t.rule = range_rule_for(name);
  const auto op_name = fn.operator_name();
  const auto op = op_name ? c10::Dispatcher::singleton().findOp(*op_name) : c10::nullopt;
  if (!op) {
    t.user_scope = true;
    return t;
  }
  t.composite = is_composite(*op);
  for (const auto& arg : op->schema().arguments()) {
    const bool written = arg.alias_info() && arg.alias_info()->isWrite() && !metadata_only;
    t.written_arguments.push_back(written);
    t.out_arguments.push_back(arg.kwarg_only() && written);
  }
  for (const auto& ret : op->schema().returns()) {
    const c10::AliasInfo* alias = ret.alias_info();
    t.outputs.push_back(!alias ? output_kind::fresh : alias->isWrite() ? output_kind::written : output_kind::view);
  }
  t.writes_unreturned = size_t(std::count(t.written_arguments.begin(), t.written_arguments.end(), true)) >
                        size_t(std::count(t.outputs.begin(), t.outputs.end(), output_kind::written));
  // Such an op may show its writes through the ops it runs inside (on CPU,
  // aten::_foreach_mul_ runs mul_ on each tensor): those stay checked.
  t.kernel = !t.composite && !t.writes_unreturned;
  if (metadata_only) std::fill(t.outputs.begin(), t.outputs.end(), output_kind::view);
  t.views_only = !t.inplace && !t.outputs.empty() &&
                 std::all_of(t.outputs.begin(), t.outputs.end(), [](output_kind k) { return k == output_kind::view; });
  return t;
}

}  // namespace

std::string collective_name(const std::string& op) {
  static const std::pair<const char*, const char*> kinds[] = {
      {"c10d::allreduce", "all-reduce"},   {"c10d::reduce_scatter", "reduce-scatter"},
      {"c10d::_reduce_scatter", "reduce-scatter"}, {"c10d::allgather", "all-gather"},
      {"c10d::_allgather", "all-gather"},  {"c10d::broadcast", "broadcast"},
      {"c10d::alltoall", "all-to-all"},    {"c10d::reduce_", "reduce"}};
  for (const auto& [prefix, kind] : kinds)
    if (op.rfind(prefix, 0) == 0) return kind;
  return op;
}

const op_traits& traits_of(const at::RecordFunction& fn) {
  // Keyed by the name's address, which for an ATen op lives in its schema;
  // a user scope's name lives in its RecordFunction, whose address a later
  // scope may reuse: the stored name tells them apart.
  struct entry {
    std::string name;
    op_traits traits;
  };
  thread_local std::unordered_map<const char*, entry> cache;
  const char* name = fn.name();
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, entry{name, make_traits(fn)}).first;
  else if (it->second.name != name) it->second = entry{name, make_traits(fn)};
  return it->second.traits;
}

}  // namespace nanguard::detail
