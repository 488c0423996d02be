// tracer_deferred.h — the tracer's deferred path (tracer_deferred.cpp). A
// tensor on a device other than the CPU (or on the CPU too, with
// tracer_options::deferred) is not read when its op ends, which would be a
// host sync per op on a GPU: its check is enqueued on a nonfinite_record,
// on the tensor's stream, and the op's context and site are kept
// (deferred_op) with the tensors they hold. The record is read once
// (settle): when findings are asked for, when the step changes, or when
// what it holds reaches tracer_options::deferred_bytes; the checks are then
// replayed in order through the eager path's finding logic
// (tracer_findings.h), with the census each check took as the op left the
// tensor. Ranges are not known without a read, so no range rule bounds a
// deferred op's outputs.
#pragma once

#include "tracer_state.h"

#include <cstddef>

namespace nanguard::detail {

/// The deferred read, for the old values of input `k` the op writes, of
/// whether they held a NaN or Inf: into a cell its nonfinite_before is set
/// from once the record is read.
void defer_old_values(tracer_state& st, op_context& ctx, size_t k);

/// The deferred end of the op `fn`: enqueues its outputs that can hold new
/// values and the inputs it wrote without returning them; keeps `ctx`.
void defer_outputs(tracer_state& st, const at::RecordFunction& fn, op_context& ctx);

/// The deferred check of gradient `input` into the node `fn` runs, sent by
/// `sender` (or nullptr); `into_leaf`: the node is an AccumulateGrad.
void defer_node_input(tracer_state& st, const at::RecordFunction& fn, const ran_node* sender,
                      const at::Tensor& gradient, size_t input, bool into_leaf);

/// Enqueues the event `c` behind the deferred checks, when there are any
/// (findings they make must be recorded first); false when none are, and
/// the caller handles it now.
bool defer_event(tracer_state& st, deferred_check c);

/// Reads the record (a host sync per device it used; a census of each
/// tensor only when one was not finite) and replays what it holds, in
/// order; then lets the tensors go.
void settle(tracer_state& st);

/// settle(), once the record holds tracer_options::deferred_bytes or too
/// many checks; only between outermost ops, so that no op is halfway
/// through its checks.
void settle_when_full(tracer_state& st);

/// True while checks wait on the record, unread.
bool holds_deferred(tracer_state& st);

/// Drops what the record holds, unread.
void forget_deferred(tracer_state& st);

}  // namespace nanguard::detail
