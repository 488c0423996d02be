// The op tracer: RecordFunction callbacks that check every op's outputs.
//
// Start callbacks keep the op's floating-point inputs (they are only valid
// there) and a thread-local stack of the autograd nodes being run; end
// callbacks check each new output with has_nonfinite and, on a hit only,
// take the census and write the finding.
//
// Scanning outputs is what the tracer costs, so it scans only what can hold
// values no check has seen (see op_traits.h): not views, not what composite
// ops return (the ops they ran were checked), not the work inside a kernel
// (its outputs are checked when it ends), and not what a range rule
// proves finite from the ranges of the op's arguments (range_rules.h: the
// sums, products, matrix products, softmaxes, normalisations and optimiser
// updates of tensors whose range is known since their last write, see
// range_memo). A scan reads an output's range, which the memo keeps; an
// in-place op's old values are read only when the memo does not know them.
//
// This file is the hot path: the callbacks and what they read. What a
// non-finite tensor becomes is in tracer_findings.cpp, the checks of a GPU's
// tensors in tracer_deferred.cpp, the memo in range_memo.h.
#include "nanguard/tracer.h"

#include "nanguard/scope.h"

#include "detail/op_tensors.h"
#include "detail/optimizer_state.h"
#include "detail/scope_handle.h"
#include "range_memo.h"
#include "tracer_deferred.h"
#include "tracer_findings.h"
#include "tracer_state.h"

#include <ATen/ops/scalar_tensor.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <torch/nn/module.h>
#include <torch/optim.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>

namespace nanguard::detail {
namespace {

// The site of the op `fn` on this thread, as its end callback sees it.
op_site site_of(const at::RecordFunction& fn) {
  return {fn.name(), fn.seqNr(), fn.scope() == at::RecordScope::FUNCTION, fn.threadId(), fn.outputs(),
          running_node(), op_stack()};
}

tracer_state* current_state() { return observer_slot<tracer_state>::current(); }

// True when module path `inner` is `outer` or inside it.
bool within(std::string_view inner, std::string_view outer) {
  return outer.empty() || inner == outer ||
         (inner.size() > outer.size() && inner.substr(0, outer.size()) == outer && inner[outer.size()] == '.');
}

// The innermost module holding both dotted paths ("enc.0" for "enc.0.attn"
// and "enc.0.norm1").
std::string_view common_module(std::string_view a, std::string_view b) {
  size_t common = 0;  // the length of their longest common prefix of whole names
  for (size_t i = 0; i <= std::min(a.size(), b.size()); ++i) {
    const bool end_a = i == a.size() || a[i] == '.', end_b = i == b.size() || b[i] == '.';
    if (end_a && end_b) common = i;
    if (i == a.size() || i == b.size() || a[i] != b[i]) break;
  }
  return a.substr(0, common);
}

// The module of an op: TorchScript's hierarchy; then the module owning the
// parameters it reads, within the open scope (the innermost one owning them
// all: a fused layer's kernel reads its submodules' parameters); then, for
// an op run inside another (the work of a fused kernel), that op's module;
// then the open scope.
module_ref module_of(tracer_state& st, const c10::SmallVector<at::Tensor, 4>& inputs, const op_frame* enclosing) {
  module_ref m;
  m.scripted = dotted_module_path(torch::jit::currentModuleHierarchy());
  if (!m.scripted.empty()) return m;
  m.scope = current_scope_handle();
  const std::string_view open = m.scope ? std::string_view(*m.scope) : std::string_view();
  for (const auto& t : inputs) {
    const std::string* name = st.parameters.find(t.unsafeGetTensorImpl());
    if (!name || !within(parent_of(*name), open)) continue;
    if (!m.parameter) m.parameter = name;
    else if (const std::string_view owner = m.owner ? *m.owner : parent_of(*m.parameter); owner != parent_of(*name))
      m.owner = std::string(common_module(owner, parent_of(*name)));
  }
  if (!m.parameter && enclosing && !enclosing->traits->user_scope) return enclosing->module;
  return m;
}

// Adds the time until it goes out of scope to one of the tracer's cost
// counters (a callback's, a scan's), when the tracer measures its cost.
class cost_meter {
 public:
  cost_meter(const tracer_state& st, std::atomic<int64_t>& nanoseconds)
      : into_(st.options.measure_cost() ? &nanoseconds : nullptr),
        start_(into_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point()) {}
  ~cost_meter() {
    if (!into_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    into_->fetch_add(ns.count(), std::memory_order_relaxed);
  }
  cost_meter(const cost_meter&) = delete;
  cost_meter& operator=(const cost_meter&) = delete;

 private:
  std::atomic<int64_t>* into_;
  std::chrono::steady_clock::time_point start_;
};

// The range of `t`'s values, read on this thread for `op` (its output, an
// input it writes, or a parameter it uses first); counted in the tracer's
// cost when measured.
value_range scan_range(tracer_state& st, const at::Tensor& t, const char* op, scanned what) {
  count_scan(st, t, op, what);
  const cost_meter meter(st, st.scan_nanoseconds);
  return value_range_on_this_thread(t);
}

// True when the tensors are all on the CPU.
template <typename Tensors>
bool on_cpu(const Tensors& tensors) {
  for (const at::Tensor& t : tensors)
    if (!t.is_cpu()) return false;
  return true;
}

// True when an op's outputs are all on the CPU.
bool outputs_on_cpu(c10::ArrayRef<c10::IValue> outputs) {
  for (const c10::IValue& v : outputs)
    if (v.isTensor() && !v.toTensor().is_cpu()) return false;
  return true;
}

// For each input the op will write (its in-place self, or an input that
// is also its out= buffer: x.mul_(0.5) runs as mul.out(0.5, x, out=x)),
// whether it holds a NaN or Inf now: afterwards, its values are the op's.
// A tensor the memo knows needs no scan; one scanned finite joins it.
void record_written_inputs(tracer_state& st, const op_traits& traits, c10::ArrayRef<const c10::IValue> args,
                           op_context& ctx) {
  c10::SmallVector<const at::Tensor*, 2> written;
  if (traits.inplace && !args.empty() && args[0].isTensor()) written.push_back(&args[0].toTensor());
  for (size_t i = 0; i < args.size(); ++i)
    if (i < traits.out_arguments.size() && traits.out_arguments[i] && args[i].isTensor())
      written.push_back(&args[i].toTensor());
  if (traits.writes_unreturned)  // e.g. each tensor of the list aten::_foreach_mul_ updates
    for (size_t k = 0; k < ctx.inputs.size(); ++k)
      if (traits.writes_argument(ctx.argument_of[k])) written.push_back(&ctx.inputs[k]);
  ctx.nonfinite_before.assign(ctx.inputs.size(), -1);
  if (written.empty()) return;
  range_memo& memo = this_thread_memo();
  for (size_t k = 0; k < ctx.inputs.size(); ++k) {
    const at::Tensor& in = ctx.inputs[k];
    const bool overwritten =
        std::any_of(written.begin(), written.end(), [&](const at::Tensor* w) { return in.is_alias_of(*w); });
    if (!overwritten) continue;
    if (st.options.keep_inputs()) {
      ctx.values_before.resize(ctx.inputs.size());
      ctx.values_before[k] = in.detach().clone();
    }
    if (ctx.deferred) {
      defer_old_values(st, ctx, k);
      continue;
    }
    if (known_range(memo, in)) {
      ctx.nonfinite_before[k] = 0;
      continue;
    }
    const value_range before = scan_range(st, in, ctx.op, scanned::old_values);
    ctx.nonfinite_before[k] = !before.finite();
    if (before.finite()) memo.insert(in, before, range_origin::read);  // the op's range rule and inner ops build on it
  }
}

// The ranges the op's rule gives its outputs, from its arguments' ranges
// as they are before it runs.
void bound_outputs(tracer_state& st, const op_traits& traits, c10::ArrayRef<const c10::IValue> args,
                   op_context& ctx) {
  if (!traits.rule || !st.options.range_rules() || any_complex(args)) return;
  range_memo& memo = this_thread_memo();
  // A parameter is read once a step, where it is first used: it is
  // smaller than what the ops that use it make, and used again in the
  // backward pass and by the optimiser. The optimiser's update goes on
  // from its bound, but what that bounds it to is no substitute at its
  // next use: Adam's m / (sqrt(v) + eps) is bounded by 1/eps times the
  // bound of gradients, and from such a weight on every matrix product
  // with it would have to be read.
  for (size_t k = 0; k < ctx.inputs.size(); ++k) {
    const at::Tensor& in = ctx.inputs[k];
    const at::Tensor p = in.is_view() && in._base().defined() ? at::Tensor(in._base()) : in;  // weight.t() in aten::linear
    // A complex parameter (the base of x.real) is not a range the rules use.
    if (!p.is_leaf() || !p.requires_grad() || p.is_complex()) continue;
    const bool updated = ctx.nonfinite_before[k] >= 0;  // the op writes it
    if (updated ? known_range(memo, p).has_value() : memo.read_since_write(p)) continue;
    const value_range r = scan_range(st, p, ctx.op, scanned::parameter);
    if (r.finite()) memo.insert(p, r, range_origin::read);
  }
  const auto lookup = [&](const at::Tensor& t) { return known_range(memo, t); };
  const op_arguments arguments(args, lookup);
  ctx.output_ranges.resize(std::max<size_t>(traits.outputs.size(), 1));
  for (size_t i = 0; i < ctx.output_ranges.size(); ++i) ctx.output_ranges[i] = traits.rule->output(arguments, i);
}

// The tensors an op wrote without returning them (see
// op_traits::writes_unreturned), read unless an op inside it recorded a
// write to them since it started (on CPU, aten::_foreach_mul_'s mul_ ops),
// which checked them.
void check_unreturned_writes(tracer_state& st, const at::RecordFunction& fn, op_context& ctx, range_memo& memo) {
  for (size_t k = 0; k < ctx.inputs.size(); ++k) {
    const at::Tensor& written = ctx.inputs[k];
    if (ctx.nonfinite_before[k] < 0 || !measurable(written) || memo.written_since(written, ctx.memo_writes)) continue;
    const value_range range = scan_range(st, written, ctx.op, scanned::output);
    remember_write(memo, written, range, range_origin::read);
    if (!range.finite()) {
      settle(st);
      on_nonfinite_output(st, site_of(fn), ctx, written, nullptr, kWrittenArgument);
    }
  }
}

// A collective's tensors change when its backend delivers, after the op has
// returned (on the backend's thread) and with no version bump. Marked when
// it starts, while its arguments are still there (the kernel takes them):
// the new version makes whatever reads them next be checked, not trusted
// from what the tracer saw before, and names them "received via" the
// collective (another rank's values may be in them).
void mark_arguments_written(tracer_state& st, const at::RecordFunction& fn) {
  const std::string name = "received via " + collective_name(fn.name());
  const auto mark = [&](const at::Tensor& t) {
    mark_written(t);
    std::lock_guard<std::mutex> lock(st.mutex);
    st.received.insert(t, name);
  };
  for (const c10::IValue& arg : fn.inputs()) {
    if (arg.isTensor()) mark(arg.toTensor());
    else if (arg.isTensorList())
      for (const at::Tensor& t : arg.toTensorVector()) mark(t);
  }
}

// The autograd nodes this thread has run in the current backward pass, in
// order: the one that returned a gradient no op made is found among them.
std::vector<ran_node>& nodes_run_in_this_backward() {
  thread_local std::vector<ran_node> nodes;
  thread_local uint64_t graph_task = 0;
  const uint64_t current = torch::autograd::get_current_graph_task_id();
  if (current != graph_task) nodes.clear();
  graph_task = current;
  return nodes;
}

// The node that ran before `receiver` and sends it gradients, or nullptr.
const ran_node* sender_of(const std::vector<ran_node>& ran, const torch::autograd::Node* receiver) {
  for (auto it = ran.rbegin(); it != ran.rend(); ++it) {
    const auto node = it->node.lock();
    if (!node) continue;
    for (const auto& edge : node->next_edges())
      if (edge.function.get() == receiver) return &*it;
  }
  return nullptr;
}

bool is_accumulate_grad(const char* node) { return std::strstr(node, "AccumulateGrad") != nullptr; }

// The gradients a node is handed were checked where an op made them; one no
// op made (what a Python autograd.Function's backward returns, built from
// Python numbers; the gradient given to backward()) is read here.
//
// A leaf's AccumulateGrad receives what becomes its .grad: the chain of a
// non-finite value there reached a gradient (see publish()).
void check_node_inputs(tracer_state& st, const at::RecordFunction& fn) {
  std::vector<ran_node>& ran = nodes_run_in_this_backward();
  const std::shared_ptr<torch::autograd::Node> node = torch::autograd::get_current_node();
  const bool into_leaf = is_accumulate_grad(fn.name());
  if (ran.empty()) {
    deferred_check loss(deferred_check::kind::loss);
    loss.sequence_nr = fn.seqNr();
    if (!defer_event(st, std::move(loss))) reach_from_loss(st, fn.seqNr());
  }
  range_memo& memo = this_thread_memo();
  const auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor() || !measurable(inputs[i].toTensor())) continue;
    const at::Tensor gradient = real_values(inputs[i].toTensor());
    if (st.options.deferred() || !gradient.is_cpu()) {
      defer_node_input(st, fn, sender_of(ran, node.get()), gradient, i, into_leaf);
      continue;
    }
    std::optional<taint> known = taint_of(st, gradient);
    if (!known && !known_range(memo, gradient)) {
      const value_range range = scan_range(st, gradient, fn.name(), scanned::node_input);
      remember_write(memo, gradient, range, range_origin::read);
      if (!range.finite()) {
        settle(st);  // what was deferred before it is recorded first
        on_nonfinite_node_input(st, site_of(fn), sender_of(ran, node.get()), gradient, nullptr, i);
      }
      known = taint_of(st, gradient);
    }
    if (known && into_leaf) reach_from_leaf(st, *known);
  }
  if (into_leaf && !defer_event(st, deferred_check(deferred_check::kind::leaf))) judge_all(st);
  ran.push_back({node, fn.name(), fn.seqNr()});
}

// A number argument that is NaN or Inf, as the tensor eager code wraps it
// in: TorchScript runs `x * float("nan")` as aten::mul.Scalar, which eager
// code runs as aten::mul of a 0-dim Double tensor. Listed among the op's
// inputs, the finding names it either way.
at::Tensor number_tensor(const c10::IValue& number) {
  at::Tensor t = at::scalar_tensor(number.toDouble(), at::kDouble);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);  // as eager code's Python numbers are: named a constant
  return t;
}

// Remembers a forward op by its sequence number, which the backward nodes
// it made carry. set_step() forgets them all; a trace that spans many steps
// without it keeps the newest kForwardOpsKept (the few thousand ops of a
// step, many times over), so that its memory stays bounded; the newest
// kStacksKept of them keep their call stacks (a kilobyte each in a deep
// training loop).
constexpr size_t kForwardOpsKept = size_t(1) << 18;
constexpr size_t kStacksKept = size_t(1) << 14;

void forget_forward_ops(tracer_state& st) {
  st.forward_ops.clear();
  st.forward_order.clear();
  st.forward_next = 0;
}

void remember_forward_op(tracer_state& st, int64_t sequence_nr, forward_record op) {
  st.forward_ops.insert_or_assign(sequence_nr, std::move(op));
  std::vector<int64_t>& order = st.forward_order;  // a ring once full
  const size_t position = order.size() < kForwardOpsKept ? order.size() : st.forward_next;
  if (order.size() < kForwardOpsKept) {
    order.push_back(sequence_nr);
  } else {
    int64_t& oldest = order[st.forward_next];
    st.forward_next = (st.forward_next + 1) % kForwardOpsKept;
    if (oldest != sequence_nr) st.forward_ops.erase(oldest);
    oldest = sequence_nr;
  }
  const size_t stale = (position + kForwardOpsKept - kStacksKept) % kForwardOpsKept;
  if (stale >= order.size()) return;
  if (const auto it = st.forward_ops.find(order[stale]); it != st.forward_ops.end()) it->second.stack.reset();
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  tracer_state* st = current_state();
  if (!st) return nullptr;
  const cost_meter meter(*st, st->nanoseconds);
  if (st->options.measure_cost()) st->ops.fetch_add(1, std::memory_order_relaxed);
  std::vector<node_frame>& nodes = node_stack();  // thread-locals: looked up once per call
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    {
      callback_scope no_recursion;
      check_node_inputs(*st, fn);
    }
    nodes.push_back({fn.name(), fn.seqNr(), c10::GradMode::is_enabled()});
    return std::make_unique<node_context>();  // tells the end callback to pop
  }
  const char* name = fn.name();
  // The engine's own frame around each node (a FUNCTION-scope record whose
  // name is built per call): the node's record keeps the stack above.
  if (is_engine_frame(name)) return nullptr;
  // Work inside a kernel (see op_traits::kernel) is checked through the
  // kernel's outputs: half of the ops a training step records.
  std::vector<const op_frame*>& ops = op_stack();
  if (!st->options.inside_kernels() && !ops.empty() && ops.back()->traits->kernel) {
    ops.back()->traits->runs_recorded_ops = true;  // sealed from its next call on
    return nullptr;
  }
  callback_scope no_recursion;
  const op_traits& traits = traits_of(fn);
  if (traits.collective) {
    mark_arguments_written(*st, fn);
    return nullptr;
  }
  // A view makes no values, and one no autograd node will name (nested in
  // another op, or run by the backward pass) needs no record either: the
  // cheapest exit, for the most frequent ops.
  const node_frame* node = running_node(nodes);
  if (traits.views_only && (fn.seqNr() < 0 || node)) return nullptr;
  std::unique_ptr<op_context> ctx(new op_context);  // not make_unique: that zeroes it first
  ctx->op = name;
  ctx->traits = &traits;
  const auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (traits.ignores_argument(i)) continue;
    collect_tensors(inputs[i], ctx->inputs);
    if (inputs[i].isDouble() && !std::isfinite(inputs[i].toDouble())) ctx->inputs.push_back(number_tensor(inputs[i]));
    ctx->argument_of.resize(ctx->inputs.size(), int(i));
  }
  // A GPU's tensors are checked on the deferred path (see enqueue).
  ctx->deferred = st->options.deferred() || !on_cpu(ctx->inputs);
  record_written_inputs(*st, traits, inputs, *ctx);
  if (!ctx->deferred) bound_outputs(*st, traits, inputs, *ctx);
  if (traits.writes_unreturned) ctx->memo_writes = this_thread_memo().writes();
  if (!node) {  // forward
    // Before the lock: reading the Python stack takes the GIL.
    if (st->options.record_sources()) ctx->stack = capture_call_stack();
    std::lock_guard<std::mutex> lock(st->mutex);
    ctx->module = module_of(*st, ctx->inputs, ops.empty() ? nullptr : ops.back());
    if (fn.seqNr() >= 0) remember_forward_op(*st, fn.seqNr(), {name, ctx->module, ctx->stack});
  }
  // The ops it runs go unobserved (a bmm's per-slice ops, a kernel's inner
  // work); its outputs are checked as a whole. Last, so that nothing can
  // leave the callback off without this context to turn it on again. The
  // callback of an all-threads tracer is every thread's, so it stays on.
  const bool seal = traits.loops_over_slices || (traits.runs_recorded_ops && !st->options.inside_kernels());
  if (seal && !st->options.all_threads() && st->slot.installed()) {
    ctx->sealed = st->slot.handle();
    at::disableCallback(ctx->sealed);
  }
  ops.push_back(ctx.get());
  return ctx;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (dynamic_cast<node_context*>(raw)) node_stack().pop_back();
    return;
  }
  auto* ctx = static_cast<op_context*>(raw);
  if (!ctx) return;  // started while not tracing (or from inside a callback)
  if (ctx->sealed) at::reenableCallback(ctx->sealed);
  op_stack().pop_back();  // ops end innermost first
  tracer_state* st = current_state();
  if (!st) return;
  const cost_meter meter(*st, st->nanoseconds);
  const op_traits& traits = *ctx->traits;
  if (traits.allocates_only || traits.composite) return;
  callback_scope no_recursion;
  const auto& outputs = fn.outputs();
  if (ctx->deferred || !outputs_on_cpu(outputs)) {
    defer_outputs(*st, fn, *ctx);
    settle_when_full(*st);
    return;
  }
  range_memo& memo = this_thread_memo();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].isTensor() || !measurable(outputs[i].toTensor())) continue;
    const at::Tensor out = real_values(outputs[i].toTensor());
    if (!holds_new_values(traits.output(i), out, *ctx)) continue;
    maybe_range range;
    if (i < ctx->output_ranges.size() && ctx->output_ranges[i] && !outputs[i].toTensor().is_complex())
      range = stored_range(*ctx->output_ranges[i], out.scalar_type(), *traits.rule);
    const range_origin origin = range ? range_origin::bounded : range_origin::read;
    if (!range) range = scan_range(*st, out, ctx->op, scanned::output);
    remember_write(memo, out, *range, origin);
    if (!range->finite()) {
      settle(*st);  // what was deferred before it is recorded first
      on_nonfinite_output(*st, site_of(fn), *ctx, out, nullptr, int(i));
    }
  }
  if (traits.writes_unreturned) check_unreturned_writes(*st, fn, *ctx, memo);
}


}  // namespace
}  // namespace nanguard::detail

namespace nanguard {

using detail::deferred_check;
using detail::forget_deferred;
using detail::range_memo;
using detail::settle;
using detail::this_thread_memo;

tracer::tracer(tracer_options options) : state_(std::make_unique<detail::tracer_state>()) {
  TORCH_CHECK(options.max_findings() >= 1, "nanguard::tracer: max_findings must be at least 1, got ",
              options.max_findings());
  state_->options = std::move(options);
  range_memo::forget_all();
  state_->slot.claim(state_.get(), state_->options.all_threads());
  resume();
}

tracer::~tracer() {
  range_memo::forget_all();
  this_thread_memo().sweep();  // nothing of this trace stays pinned (other threads' memos: at their next write)
}

void tracer::name_parameters(const torch::nn::Module& module, const std::string& prefix) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    state_->parameters.set(p.value(), prefix.empty() ? p.key() : prefix + "." + p.key());
}

void tracer::name_parameters(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const auto& [name, p] : named) state_->parameters.set(p, name);
}

void tracer::name_tensor(const at::Tensor& tensor, const std::string& name) {
  TORCH_CHECK(tensor.defined(), "nanguard::tracer::name_tensor: the tensor named '", name,
              "' is undefined");
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->named.set(tensor, name);
}

void tracer::set_step(int64_t step) {
  settle(*state_);  // the previous step's checks are replayed against its ops
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->step = step;
  range_memo::forget_all();
  detail::forget_forward_ops(*state_);
  state_->allowed.clear();
}

void tracer::keep_known_across_steps(const std::vector<at::Tensor>& tensors) {
  range_memo& memo = this_thread_memo();
  for (const at::Tensor& t : tensors)
    if (t.defined()) memo.keep_across_steps(t);
}

void tracer::keep_known_across_steps(const torch::optim::Optimizer& optimizer) {
  keep_known_across_steps(detail::optimizer_state_tensors(optimizer));
}

void tracer::judge_by_outputs(const std::vector<at::Tensor>& outputs) {
  const detail::callback_scope no_recursion;  // a complex output's real view is no op of the program
  for (const at::Tensor& out : outputs) {
    if (!out.defined()) continue;
    deferred_check reached(deferred_check::kind::model_output);
    reached.tensor = out;
    if (!detail::defer_event(*state_, std::move(reached))) detail::reach_from_output(*state_, out);
  }
  if (!detail::defer_event(*state_, deferred_check(deferred_check::kind::leaf))) detail::judge_all(*state_);
}

bool tracer::awaits_judgement() const {
  return detail::holds_deferred(*state_) || detail::any_open_chain(*state_);
}

const std::vector<finding>& tracer::findings() const {
  settle(*state_);
  return state_->findings;
}

bool tracer::found() const { return !findings().empty(); }

void tracer::clear() {
  forget_deferred(*state_);
  std::lock_guard<std::mutex> lock(state_->mutex);
  range_memo::forget_all();
  state_->records.clear();
  for (auto& entry : state_->forward_ops) entry.second.nonfinite_record = -1;
  state_->findings.clear();
  state_->reported.clear();
  state_->allowed.clear();
}

void tracer::throw_if_found() const {
  if (state_->options.throw_on_finding() && found()) throw nonfinite_error(findings().front());
}

void tracer::pause() { state_->slot.uninstall(); }

void tracer::resume() { state_->slot.install(detail::on_op_start, detail::on_op_end, /*autograd_nodes=*/true); }

bool tracer::active() const { return state_->slot.installed(); }

const tracer_options& tracer::options() const { return state_->options; }

tracer_cost tracer::cost() const {
  detail::tracer_state& st = *state_;
  tracer_cost c{st.ops.load(), st.scans.load(), st.scanned_bytes.load(), double(st.nanoseconds.load()) * 1e-9,
                double(st.scan_nanoseconds.load()) * 1e-9, {}};
  std::lock_guard<std::mutex> lock(st.mutex);
  for (const auto& entry : st.scans_by_op) c.scans_by_op.push_back(entry.second);
  std::sort(c.scans_by_op.begin(), c.scans_by_op.end(),
            [](const tracer_op_scans& a, const tracer_op_scans& b) { return a.bytes > b.bytes; });
  return c;
}

void mark_written(const at::Tensor& tensor) {
  // Inference tensors have no version counter, and no tracer remembers them.
  if (tensor.defined() && !tensor.is_inference()) tensor.unsafeGetTensorImpl()->bump_version();
}

}  // namespace nanguard
