// op_traits.h — what the tracer knows about an op before it runs, from its
// name and its schema: which outputs hold new values, whether every value it
// writes is written by other recorded ops, and the rule that bounds its
// results (range_rules.h). Worked out once per op and thread.
#pragma once

#include "range_rules.h"

#include <ATen/record_function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nanguard::detail {

/// What an op's output is, from the alias annotations of its schema.
enum class output_kind : uint8_t {
  fresh,    // new values (`-> Tensor`)
  written,  // an input it wrote: in-place or out= (`-> Tensor(a!)`)
  view,     // an input seen another way, no new values (`-> Tensor(a)`)
  unknown,  // no schema (a user RecordFunction scope): compare with the inputs
};

struct op_traits {
  bool inplace = false;          // writes its first argument (aten::add_)
  bool overwrites_self = false;  // ... all of it, so self's old values are no input (aten::copy_)
  bool allocates_only = false;   // its outputs are uninitialised memory (aten::empty)
  // CompositeImplicitAutograd (aten::linear, aten::dropout): it computes
  // through other ops, each recorded and checked, and writes nothing itself.
  bool composite = false;
  // An ATen op with a kernel of its own: the ops it runs inside (aten::mul
  // turning its scalar into a tensor with aten::to) are its implementation,
  // writing only its temporaries and its outputs, which are checked when it
  // ends. Not a composite op, not a user's RecordFunction scope, and not an
  // op that writes arguments it does not return.
  bool kernel = false;
  // It writes arguments it does not return (aten::_foreach_mul_ updates a
  // list in place and returns nothing): those are checked when it ends.
  bool writes_unreturned = false;
  // A c10d collective (c10d::allreduce_): its backend writes the tensors it
  // was given after the op returns (asynchronously), without a version bump;
  // the tracer marks them written instead of checking the op.
  bool collective = false;
  // Every output is a view of an input (aten::select, aten::as_strided):
  // it holds no new values.
  bool views_only = false;
  // A RecordFunction scope of user code (no schema): it shows the inputs it
  // chooses, not all it reads, and its outputs are unknown.
  bool user_scope = false;
  // Its CPU kernel loops over the batch with recorded ops on each slice
  // (aten::bmm: select, resolve_conj, mm): some hundred recorded calls per
  // call, whose values all end up in its own output, which is checked.
  bool loops_over_slices = false;
  // Learned on this thread: a recorded op ran inside this kernel (aten::mul
  // turning its scalar into a tensor with aten::to). The tracer then turns
  // its callback off while the kernel runs, so that RecordFunction does not
  // even box those inner ops (it would for the tracer to ignore them).
  mutable bool runs_recorded_ops = false;
  // How its outputs' ranges follow from its arguments' (nullptr: read them).
  const range_rule* rule = nullptr;
  std::vector<output_kind> outputs;  // by return index
  std::vector<bool> out_arguments;   // by argument index: an out= buffer, whose old values are no input
  std::vector<bool> written_arguments;  // by argument index: written (self of an in-place op, out=, a list)

  output_kind output(size_t i) const { return i < outputs.size() ? outputs[i] : output_kind::unknown; }
  bool writes_argument(size_t i) const { return i < written_arguments.size() && written_arguments[i]; }
  /// True when argument i's values are not read: out= buffers, or self of
  /// an op that overwrites all of it.
  bool ignores_argument(size_t i) const {
    return (i == 0 && overwrites_self) || (i < out_arguments.size() && out_arguments[i]);
  }
};

/// The traits of the op `fn` records (cached per thread by name).
const op_traits& traits_of(const at::RecordFunction& fn);

/// What a c10d collective op does, as the guard's notes name it:
/// "c10d::allreduce_" is "all-reduce", "c10d::reduce_scatter_tensor_coalesced_"
/// "reduce-scatter" (to_string(backward_collective) spells them the same);
/// an op it does not know, its own name.
std::string collective_name(const std::string& op);

}  // namespace nanguard::detail
