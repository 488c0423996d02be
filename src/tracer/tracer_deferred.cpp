// The tracer's deferred path: see tracer_deferred.h.
#include "tracer_deferred.h"

#include "detail/op_tensors.h"
#include "tracer_findings.h"

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace nanguard::detail {
namespace {

// Enqueues `c`, with the check of its tensor when it has one.
void enqueue(tracer_state& st, deferred_check c) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  if (c.tensor.defined() && c.ordinal < 0) {
    c.ordinal = st.pending_record.add(detail::real_values(c.tensor));
    st.pending_bytes += c.tensor.numel() * int64_t(c.tensor.element_size());
  }
  if (c.what == deferred_check::kind::output)
    st.checked_outputs[c.tensor.unsafeGetTensorImpl()] = {c.tensor._version(), c.ordinal};
  st.pending.push_back(std::move(c));
}

// The record position of `t`'s check when `t`, unchanged since, is an
// output checked since the last read (a gradient handed on by the node that
// made it); -1 otherwise.
int64_t checked_since_read(tracer_state& st, const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  const auto it = st.checked_outputs.find(t.unsafeGetTensorImpl());
  return it != st.checked_outputs.end() && it->second.first == t._version() ? it->second.second : -1;
}

// A copy of the op `fn`'s context (moved out of `ctx`) and of its site on
// this thread, for the deferred path.
std::shared_ptr<deferred_op> keep_op(const at::RecordFunction& fn, op_context&& ctx) {
  auto op = std::make_shared<deferred_op>();
  op->ctx = std::move(ctx);
  op->name = fn.name();
  op->ctx.op = op->name.c_str();
  op->seq_nr = fn.seqNr();
  op->function_scope = fn.scope() == at::RecordScope::FUNCTION;
  op->thread = fn.threadId();
  op->outputs = fn.outputs();
  if (const node_frame* node = running_node()) op->node = *node;
  op->enclosing.reserve(op_stack().size());
  op->enclosing_names.reserve(op_stack().size());
  for (const op_frame* f : op_stack()) {
    op->enclosing_names.emplace_back(f->op);
    op->enclosing.push_back(*f);
    op->enclosing.back().op = op->enclosing_names.back().c_str();
    op->stack.push_back(&op->enclosing.back());
  }
  return op;
}

// Runs `c` as the eager path would have; `stats` are the record's census
// by position, nullptr when every tensor in it was finite.
void replay(tracer_state& st, const deferred_check& c, const std::vector<tensor_stats>* stats) {
  TORCH_INTERNAL_ASSERT(!stats || c.ordinal < int64_t(stats->size()), "a deferred check past the end of its record");
  const tensor_stats* census_then = stats && c.ordinal >= 0 ? &(*stats)[c.ordinal] : nullptr;
  const bool bad = census_then && !census_then->all_finite();
  switch (c.what) {
    case deferred_check::kind::old_values:
      *c.before = bad;
      return;
    case deferred_check::kind::output: {
      if (!bad) return;
      op_context& ctx = c.op->ctx;
      for (size_t k = 0; k < ctx.before_cells.size(); ++k)
        if (ctx.before_cells[k]) ctx.nonfinite_before[k] = *ctx.before_cells[k];
      on_nonfinite_output(st, c.op->site(), ctx, c.tensor, census_then, c.index);
      return;
    }
    case deferred_check::kind::node_input: {
      std::optional<taint> known = taint_of(st, c.tensor);
      if (!known && bad) {
        const ran_node* sender = c.op->sender ? &*c.op->sender : nullptr;
        on_nonfinite_node_input(st, c.op->site(), sender, c.tensor, census_then, size_t(c.index));
        known = taint_of(st, c.tensor);
      }
      if (known && c.into_leaf) reach_from_leaf(st, *known);
      return;
    }
    case deferred_check::kind::loss:
      reach_from_loss(st, c.sequence_nr);
      return;
    case deferred_check::kind::leaf:
      judge_all(st);
      return;
    case deferred_check::kind::model_output:
      reach_from_output(st, c.tensor);
      return;
  }
}

// Lets go of what the record holds. REQUIRES: deferred_mutex held.
void drop_pending(tracer_state& st) {
  st.pending.clear();
  st.pending_record.clear();
  st.pending_bytes = 0;
  st.checked_outputs.clear();
}

// Checks a record holds at most between reads, far under its 2^20.
constexpr int64_t kMaxDeferredChecks = int64_t(1) << 16;

}  // namespace

void defer_old_values(tracer_state& st, op_context& ctx, size_t k) {
  count_scan(st, ctx.inputs[k], ctx.op, scanned::old_values);
  ctx.before_cells.resize(ctx.inputs.size());
  ctx.before_cells[k] = std::make_shared<int8_t>(0);
  ctx.nonfinite_before[k] = 0;  // written; whether it held a NaN or Inf is read into the cell
  deferred_check c(deferred_check::kind::old_values);
  c.tensor = ctx.inputs[k];
  c.before = ctx.before_cells[k];
  enqueue(st, std::move(c));
}

void defer_outputs(tracer_state& st, const at::RecordFunction& fn, op_context& ctx) {
  const op_traits& traits = *ctx.traits;
  const auto& outputs = fn.outputs();
  c10::SmallVector<std::pair<at::Tensor, int>, 2> checks;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].isTensor() || !measurable(outputs[i].toTensor())) continue;
    const at::Tensor out = detail::real_values(outputs[i].toTensor());
    if (holds_new_values(traits.output(i), out, ctx)) checks.emplace_back(out, int(i));
  }
  if (traits.writes_unreturned)
    for (size_t k = 0; k < ctx.inputs.size(); ++k)
      if (ctx.nonfinite_before[k] >= 0) checks.emplace_back(ctx.inputs[k], kWrittenArgument);
  if (checks.empty()) return;
  for (const auto& check : checks) count_scan(st, check.first, ctx.op, scanned::output);
  const std::shared_ptr<deferred_op> op = keep_op(fn, std::move(ctx));
  for (auto& [tensor, index] : checks) {
    deferred_check c(deferred_check::kind::output, op, std::move(tensor));
    c.index = index;
    enqueue(st, std::move(c));
  }
}

void defer_node_input(tracer_state& st, const at::RecordFunction& fn, const ran_node* sender,
                      const at::Tensor& gradient, size_t input, bool into_leaf) {
  const int64_t checked = checked_since_read(st, gradient);
  if (checked < 0) count_scan(st, gradient, fn.name(), scanned::node_input);
  auto op = std::make_shared<deferred_op>();
  op->name = fn.name();
  op->seq_nr = fn.seqNr();
  op->thread = fn.threadId();
  if (sender) op->sender = *sender;
  deferred_check c(deferred_check::kind::node_input, std::move(op), gradient);
  c.ordinal = checked;
  c.index = int(input);
  c.into_leaf = into_leaf;
  enqueue(st, std::move(c));
}

bool defer_event(tracer_state& st, deferred_check c) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  if (st.pending.empty()) return false;
  st.pending.push_back(std::move(c));
  return true;
}

void settle(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  if (st.pending.empty()) return;
  callback_scope no_recursion;  // the censuses of a finding are not the program's ops
  std::vector<tensor_stats> stats;
  if (!st.pending_record.verdict().all_finite()) stats = st.pending_record.stats();
  for (const deferred_check& c : st.pending) replay(st, c, stats.empty() ? nullptr : &stats);
  drop_pending(st);
}

void settle_when_full(tracer_state& st) {
  if (!op_stack().empty()) return;
  {
    std::lock_guard<std::mutex> lock(st.deferred_mutex);
    if (st.pending_bytes < st.options.deferred_bytes() && st.pending_record.size() < kMaxDeferredChecks) return;
  }
  settle(st);
}

bool holds_deferred(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  return !st.pending.empty();
}

void forget_deferred(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  drop_pending(st);
}

}  // namespace nanguard::detail
