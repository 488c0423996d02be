// The tracer's findings: what it records of a non-finite tensor, and which
// records the step shows mattered (see publish).
#include "tracer_findings.h"

#include "nanguard/census.h"
#include "nanguard/diagnosis.h"

#include "detail/op_tensors.h"

#include <c10/util/Backtrace.h>
#include <fmt/format.h>

#include <fnmatch.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace nanguard::detail {
namespace {

// The enclosing op that made `t` with work ATen does not record (e.g. the
// sum inside aten::mean): the innermost one `t` did not come in through.
// A user scope lists only the inputs it chooses, so it makes nothing here.
const op_frame* unrecorded_maker(c10::ArrayRef<const op_frame*> stack, const at::Tensor& t) {
  for (auto it = stack.rbegin(); it != stack.rend(); ++it) {
    if ((*it)->traits->user_scope) continue;
    bool came_in = false;
    for (const auto& in : (*it)->inputs) came_in |= t.is_alias_of(in);
    if (!came_in) return *it;
  }
  return nullptr;
}

// A node's name without the engine's frame around it.
std::string strip_node_prefix(const char* name) {
  return is_engine_frame(name) ? std::string(name + sizeof(kEngineFrame) - 1) : std::string(name);
}

bool glob(const std::string& pattern, const std::string& text) {
  return pattern.empty() || fnmatch(pattern.c_str(), text.c_str(), 0) == 0;
}

// True when every non-finite kind in `s` is allowed for this op and module.
bool allowed_by_rules(const tracer_options& o, const std::string& op, const std::string& module,
                      const tensor_stats& s) {
  for (const auto& r : o.allow()) {
    if (!glob(r.op(), op) || !glob(r.module(), module)) continue;
    if ((s.nan == 0 || r.nan()) && (s.pos_inf == 0 || r.pos_inf()) && (s.neg_inf == 0 || r.neg_inf()))
      return true;
  }
  return false;
}

tensor_record record_of(const at::Tensor& t, std::string name) {
  return {std::move(name), c10::toString(t.scalar_type()), t.sizes().vec(), census(t)};
}

// The name of an unnamed input, the op's argument `argument`: "input 1";
// "constant (argument 1)" for a number (a Python float eager code wraps in a
// tensor, a TorchScript double): written in the model's code, not data.
std::string input_name(const at::Tensor& t, int argument) {
  return t.unsafeGetTensorImpl()->is_wrapped_number() ? fmt::format("constant (argument {})", argument)
                                                      : fmt::format("input {}", argument);
}

std::string name_of(tracer_state& st, const at::Tensor& t, const std::string& fallback) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (const std::string* name = st.parameters.find(impl)) return *name;
  if (const std::string* name = st.named.find(impl)) return *name;
  if (const std::string* via = st.received.find(t)) return *via;
  if (t.is_view() && t._base().defined()) {  // e.g. weight.t() inside aten::linear
    const std::string base = name_of(st, at::Tensor(t._base()), "");
    if (!base.empty()) return base + " (view)";
  }
  return fallback;
}

// True inside ops that compare against infinities on purpose (isfinite(x)
// builds an inf scalar): what they make inside is not a finding.
bool inside_infinity_test(c10::ArrayRef<const op_frame*> stack) {
  static const char* const ops[] = {"aten::isfinite", "aten::isinf", "aten::isposinf",
                                    "aten::isneginf", "aten::nan_to_num", "aten::nan_to_num_"};
  for (const op_frame* c : stack)
    for (const char* op : ops)
      if (std::strcmp(c->op, op) == 0) return true;
  return false;
}

// How records become what findings() returns: judged by their consequence.
// Every non-finite output is marked with the record of the producer (or
// input) its values descend from; propagators join that chain. A chain
// matters when its values reach the loss (the output whose backward node
// starts a backward pass) or a gradient (what a leaf's AccumulateGrad
// receives). Each leaf judges every chain recorded so far: one that
// mattered is a finding; one absorbed on the way (a masked score that
// softmax turned into a zero, an infinity a backward formula masks out) is
// not. A chain no leaf has judged yet (the step is still running, or has no
// backward pass) is shown, unless it gathered intended infinities (a sum
// over a mask, see gathers()): such a chain is shown once it has reached the
// loss, a gradient or the model's outputs, or when nothing else is.
void publish(tracer_state& st) {
  st.findings.clear();
  for (const bool fallback : {false, true}) {
    if (fallback && !st.findings.empty()) return;
    for (const finding_record& r : st.records) {
      if (int64_t(st.findings.size()) >= st.options.max_findings()) return;
      const finding_record& origin = st.records[r.origin];
      const bool unjudged = !origin.judged && origin.gathered == fallback;
      if (unjudged || (origin.reached && !fallback)) st.findings.push_back(r.finding);
    }
  }
}

// Marks the non-finite `out` of `fn` as belonging to the chain of `record`.
// A forward op remembers it: its backward node may be where a backward
// pass starts, and then `out` is the loss.
void mark(tracer_state& st, const op_site& site, const at::Tensor& out, taint what) {
  st.reported.insert(out, what);
  if (!site.function_scope || site.seq_nr < 0 || site.node) return;
  if (auto it = st.forward_ops.find(site.seq_nr); it != st.forward_ops.end()) it->second.nonfinite_record = what.record;
}

// Records `f`, about the non-finite `out` of `fn`; `origin` is the record
// its values descend from, or -1 when it starts a chain of its own.
void record(tracer_state& st, const op_site& site, finding f, int origin, const at::Tensor& out,
            bool out_holds_nan, bool gathered = false) {
  const int index = int(st.records.size());
  // What name_tensor named is the data (the batch, the traced model's arguments).
  diagnosis_context context;
  if (f.role == role::input) context.data = st.named.live_names();
  f.diagnosis = diagnose(f, context);
  st.records.push_back({std::move(f), origin < 0 ? index : origin});
  st.records.back().gathered = gathered;
  mark(st, site, out, {index, out_holds_nan});
  publish(st);
}

// True for the ops that write constants into a tensor (a mask).
bool writes_constants(std::string_view op) {
  static const char* const constant_writers[] = {
      "aten::full",      "aten::full_like",    "aten::new_full",    "aten::fill_", "aten::masked_fill",
      "aten::masked_fill_", "aten::index_put_", "aten::index_fill_", "aten::where", "aten::scatter_",
      "aten::copy_"};
  for (const char* writer : constant_writers)
    if (op == writer) return true;
  return false;
}

// True when the chain's first finding wrote its infinities as constants (a mask).
bool written_as_constant(const finding& origin) { return writes_constants(origin.op); }

// True when the chain's first finding is an input that holds -inf and no
// other non-finite value: a mask handed in. +inf or NaN handed in is bad data.
bool mask_handed_in(const finding& origin) {
  if (origin.role != role::input) return false;
  for (const tensor_record& r : origin.inputs)
    if (r.name == origin.culprit) return r.stats.neg_inf > 0 && r.stats.pos_inf == 0 && r.stats.nan == 0;
  return false;
}

// Infinities written as constants (a mask) or handed in as a mask are meant;
// a NaN made from them (a softmax row with nothing left to attend to) is a
// new finding. A NaN made from computed infinities (inf - inf, 0 * inf after
// an overflow) or from bad data belongs to the infinity's chain.
bool meant(const finding& origin) { return mask_handed_in(origin) || written_as_constant(origin); }

// Records past this many in one chain are not kept, only marked: a NaN
// reaches most of a step's tensors, and each record costs a census.
int64_t chain_limit(const tracer_state& st) { return st.options.max_findings(); }

int64_t chain_length(const tracer_state& st, int origin) {
  return std::count_if(st.records.begin(), st.records.end(),
                       [&](const finding_record& r) { return r.origin == origin; });
}

// What the tracer knows of an input of the op whose chain is full, or nullptr.
const taint* full_chain_input(const tracer_state& st, const op_context& ctx) {
  for (const at::Tensor& in : ctx.inputs) {
    const taint* t = st.reported.find_viewed(in);
    if (t && chain_length(st, st.records[t->record].origin) >= chain_limit(st)) return t;
  }
  return nullptr;
}

// Copies of the op's inputs as it started (keep_inputs): those it writes
// were copied before it ran, the rest are as they are now.
std::vector<at::Tensor> values_as_started(const op_frame& ctx) {
  std::vector<at::Tensor> values;
  for (size_t k = 0; k < ctx.inputs.size(); ++k) {
    const bool copied_before = k < ctx.values_before.size() && ctx.values_before[k].defined();
    values.push_back(copied_before ? ctx.values_before[k] : ctx.inputs[k].detach().clone());
  }
  return values;
}

// The module a finding about the op at `site` names: a backward op's is
// its forward op's.
std::string module_at(const tracer_state& st, const op_site& site, const op_context& ctx) {
  if (site.node)
    if (auto it = st.forward_ops.find(site.node->sequence_nr); it != st.forward_ops.end())
      return it->second.module.path();
  return ctx.module.path();
}

// The inputs of an op as a finding lists them, and which were non-finite.
struct input_records {
  std::vector<tensor_record> records;
  int first_bad = -1;           // the first non-finite input not allowed, else the first; -1 for none
  bool all_bad_allowed = true;  // every non-finite one holds intentional values
  bool allowed_nan = false;     // one of those holds NaN
  bool bad_hold_nan = false;    // a non-finite one holds NaN (or was overwritten in place)

  bool any_bad() const { return first_bad >= 0; }
};

// Which inputs of the op were non-finite (an input it wrote, `out` itself:
// as it held before the op), and were those intentional?
input_records read_inputs(tracer_state& st, const op_context& ctx, const at::Tensor& out) {
  input_records in;
  for (size_t i = 0; i < ctx.inputs.size(); ++i) {
    const at::Tensor& t = ctx.inputs[i];
    const bool self_inplace = ctx.nonfinite_before[i] >= 0 && t.is_alias_of(out);
    tensor_record r = record_of(t, name_of(st, t, input_name(t, ctx.argument_of[i])));
    if (self_inplace) r.name += " (in place: as the op left it)";
    const bool bad = self_inplace ? ctx.nonfinite_before[i] == 1 : !r.stats.all_finite();
    if (bad) {
      in.bad_hold_nan |= self_inplace || r.stats.nan > 0;  // what an in-place op overwrote is unknown
      const bool allowed = st.allowed.contains(t);
      // The first non-finite input, one not allowed first: that is what the op is blamed on.
      if (in.first_bad < 0 || (!allowed && in.all_bad_allowed)) in.first_bad = int(i);
      if (allowed) in.allowed_nan |= r.stats.nan > 0;
      else in.all_bad_allowed = false;
    }
    in.records.push_back(std::move(r));
  }
  return in;
}

// True when `out` gathers the infinities of `in`, written on purpose (a
// mask), into fewer elements: a sum, a mean, a loss over masked classes
// (label smoothing reads every class). Elementwise a mask's infinities flow
// on as meant; gathered, they make a result non-finite as a whole: a chain
// of its own (finding_record::gathered), a finding when it reaches the loss,
// a gradient or the model's outputs, or when nothing else is found: the op
// a non-finite loss made of intended infinities names. A NaN made from it
// (the max of a fully masked row, minus itself) starts a chain of its own.
bool gathers(const at::Tensor& in, const at::Tensor& out) { return out.numel() < in.numel(); }

// True when the op starts a chain of its own from the meant infinities of
// the chain `origin`: a NaN made from them, or their gathering.
bool starts_own_chain(const tracer_state& st, int origin, const tensor_stats& out_stats, const input_records& in,
                      const at::Tensor& bad_input, const at::Tensor& out) {
  if (in.bad_hold_nan) return false;
  const finding& first = st.records[origin].finding;
  return (out_stats.nan > 0 && (meant(first) || st.records[origin].gathered)) ||
         (written_as_constant(first) && gathers(bad_input, out));
}

// The user's line of the forward op `sequence_nr`, from the stack recorded as it ran (record_sources).
source_location forward_source(const tracer_state& st, int64_t sequence_nr) {
  const auto it = st.forward_ops.find(sequence_nr);
  return it == st.forward_ops.end() ? source_location() : user_frame(it->second.stack);
}

// The user's line the op at `site` ran from: a backward node's forward op's;
// a forward op's from the stack recorded as it started, or else from this
// thread's stack now, when `now` is its own (the eager path, as the op
// ends; the deferred path checks it later, under another stack).
source_location source_at(const tracer_state& st, const op_site& site, const call_stack& recorded, bool now) {
  if (site.node) return forward_source(st, site.node->sequence_nr);
  if (recorded) return user_frame(recorded);
  return now ? user_frame(capture_call_stack()) : source_location();
}

// A finding about the op at `site`: when and where it ran. Its role and
// tensors are filled in by the caller.
finding finding_at(const tracer_state& st, const op_site& site, std::string module, source_location source) {
  finding f;
  f.step = st.step;
  f.source = std::move(source);
  f.op = site.name;
  f.direction = site.node ? direction::backward : direction::forward;
  if (site.node) {
    f.node = strip_node_prefix(site.node->name.c_str());
    if (auto it = st.forward_ops.find(site.node->sequence_nr); it != st.forward_ops.end())
      f.forward_op = it->second.op;
    f.sequence_nr = site.node->sequence_nr;
  } else {
    f.sequence_nr = site.seq_nr;
  }
  f.module = std::move(module);
  if (!site.stack.empty() && site.stack.front()->op != f.op) f.caller = site.stack.front()->op;
  f.thread = site.thread;
  return f;
}

// Made inside the enclosing op `maker` by unrecorded work: that op is the
// producer, unless it was handed a non-finite value itself. Lists its
// inputs instead; returns the record of the chain it continues, or -1.
int blame_enclosing_op(tracer_state& st, const op_site& site, const op_frame& maker, input_records& in,
                       finding& f) {
  f.op = maker.op;
  f.caller = &maker == site.stack.front() ? "" : site.stack.front()->op;
  f.role = role::producer;
  if (!site.node) f.module = maker.module.path();
  int origin = -1;
  in.records.clear();
  for (size_t i = 0; i < maker.inputs.size(); ++i) {
    const at::Tensor& t = maker.inputs[i];
    in.records.push_back(record_of(t, name_of(st, t, input_name(t, maker.argument_of[i]))));
    if (f.role == role::producer && !in.records.back().stats.all_finite()) {
      const taint* from = st.reported.find_viewed(t);
      f.role = from ? role::propagator : role::input;
      if (from) origin = st.records[from->record].origin;
      f.culprit = in.records.back().name;
    }
  }
  return origin;
}

// The role of an op handed non-finite values (`in`) in `f`, and the record
// of the chain its output continues, or -1 for a chain of its own.
// `named_op` becomes the enclosing op when that one is named instead.
int blame_inputs(tracer_state& st, const op_site& site, const op_context& ctx, const at::Tensor& out,
                 const tensor_stats& out_stats, input_records& in, finding& f, const op_frame*& named_op) {
  TORCH_INTERNAL_ASSERT(in.any_bad(), "blame_inputs with no non-finite input");
  const at::Tensor& culprit = ctx.inputs[in.first_bad];
  const std::string culprit_name = in.records[in.first_bad].name;
  if (const taint* from = st.reported.find_viewed(culprit)) {
    f.culprit = culprit_name;
    const int origin = st.records[from->record].origin;
    // A chain of its own, naming the infinity it came from.
    const bool own_chain = starts_own_chain(st, origin, out_stats, in, culprit, out);
    f.role = own_chain ? role::producer : role::propagator;
    return own_chain ? -1 : origin;
  }
  const bool named = culprit_name.rfind("input ", 0) != 0;
  if (!named && culprit.dim() == 0 && writes_constants(ctx.op)) {
    // A constant no op made, written in: TorchScript runs `mask[0] =
    // float("-inf")` as a copy_ of a constant tensor, where eager code runs
    // a fill_ of the number. The op writes the constant, as fill_ does.
    f.role = role::producer;
    return -1;
  }
  if (const op_frame* maker = named ? nullptr : unrecorded_maker(site.stack, culprit)) {
    named_op = maker;
    return blame_enclosing_op(st, site, *maker, in, f);
  }
  f.role = role::input;
  f.culprit = culprit_name;
  // The next op that reads the same data propagates this finding.
  st.reported.insert(culprit, {int(st.records.size()), in.records[in.first_bad].stats.nan > 0});
  return -1;
}

// The backward of an op whose forward already went non-finite is the same
// failure (log(0) is -inf forward and 0/0 in LogBackward0): the record of
// the forward's chain, or -1.
int forward_origin(const tracer_state& st, int64_t sequence_nr) {
  const auto it = st.forward_ops.find(sequence_nr);
  if (it == st.forward_ops.end() || it->second.nonfinite_record < 0) return -1;
  return st.records[it->second.nonfinite_record].origin;
}

// Lists the op's outputs in `f`, and which is non-finite: `out`, its output
// `output_index`, or an input it wrote (kWrittenArgument), listed last.
void list_outputs(finding& f, const op_site& site, const at::Tensor& out, int output_index) {
  for (size_t i = 0; i < site.outputs.size(); ++i) {
    std::vector<at::Tensor> outs;
    collect_tensors(site.outputs[i], outs);
    for (const auto& o : outs) f.outputs.push_back(record_of(o, "output " + std::to_string(i)));
  }
  f.output = output_index;
  if (output_index == kWrittenArgument) {
    f.outputs.push_back(record_of(out, "written in place"));
    f.output = int(f.outputs.size()) - 1;
  }
}

}  // namespace

void on_nonfinite_output(tracer_state& st, const op_site& site, const op_context& ctx, const at::Tensor& out,
                         const tensor_stats* census_then, int output_index) {
  std::lock_guard<std::mutex> lock(st.mutex);
  if (inside_infinity_test(site.stack)) return;
  if (st.reported.contains(out) || st.allowed.contains(out)) return;  // a nested op's result

  // Values of a full chain flowing on: marked, not recorded (a NaN made
  // from its infinities is recorded below, as a chain of its own).
  const taint* via = full_chain_input(st, ctx);
  if (via && via->nan) {
    mark(st, site, out, *via);
    return;
  }
  const tensor_stats out_stats = census_then ? *census_then : census(out);
  std::string module = module_at(st, site, ctx);
  if (allowed_by_rules(st.options, site.name, module, out_stats)) {
    st.allowed.insert(out);
    return;
  }
  input_records in = read_inputs(st, ctx, out);
  if (in.any_bad() && in.all_bad_allowed && (out_stats.nan == 0 || in.allowed_nan) &&
      !gathers(ctx.inputs[in.first_bad], out)) {
    st.allowed.insert(out);  // intentional infinities flowing on (mask + scores)
    return;
  }
  if (via && !starts_own_chain(st, st.records[via->record].origin, out_stats, in,
                               in.any_bad() ? ctx.inputs[in.first_bad] : out, out)) {
    mark(st, site, out, {via->record, out_stats.nan > 0});
    return;
  }

  finding f = finding_at(st, site, std::move(module), source_at(st, site, ctx.stack, !census_then));
  const op_frame* named_op = &ctx;  // the op the finding names, whose inputs it lists
  int origin = -1;
  if (!in.any_bad() || in.all_bad_allowed) f.role = role::producer;
  else origin = blame_inputs(st, site, ctx, out, out_stats, in, f, named_op);
  if (site.node && origin < 0) origin = forward_origin(st, site.node->sequence_nr);
  f.inputs = std::move(in.records);
  if (st.options.keep_inputs()) f.input_values = values_as_started(*named_op);
  list_outputs(f, site, out, output_index);
  f.index = out_stats.first_nonfinite_index;
  f.value = out_stats.first_nonfinite_value;
  if (st.options.capture_backtrace() && !census_then) f.backtrace = c10::get_backtrace(/*frames_to_skip=*/3);
  const bool gathered = named_op == &ctx && f.role == role::producer && in.any_bad() && out_stats.nan == 0 &&
                        gathers(ctx.inputs[in.first_bad], out);
  record(st, site, std::move(f), origin, out, out_stats.nan > 0, gathered);
}

void on_nonfinite_node_input(tracer_state& st, const op_site& site, const ran_node* sender,
                             const at::Tensor& gradient, const tensor_stats* census_then, size_t input) {
  std::lock_guard<std::mutex> lock(st.mutex);
  tensor_record bad = record_of(gradient, "gradient " + std::to_string(input) + " into " + site.name);
  if (census_then) bad.stats = *census_then;
  finding f;
  f.step = st.step;
  f.direction = direction::backward;
  f.source = forward_source(st, sender ? sender->sequence_nr : site.seq_nr);
  if (sender) {
    f.op = f.node = sender->name;
    f.role = role::producer;
    f.sequence_nr = sender->sequence_nr;
    if (auto it = st.forward_ops.find(sender->sequence_nr); it != st.forward_ops.end()) {
      f.forward_op = it->second.op;
      f.module = it->second.module.path();
    }
    f.outputs.push_back(bad);
  } else {
    f.op = f.node = site.name;
    f.role = role::input;
    f.culprit = bad.name;
    f.sequence_nr = site.seq_nr;
    f.inputs.push_back(bad);
  }
  f.index = bad.stats.first_nonfinite_index;
  f.value = bad.stats.first_nonfinite_value;
  f.thread = site.thread;
  if (st.options.capture_backtrace() && !census_then) f.backtrace = c10::get_backtrace(/*frames_to_skip=*/3);
  record(st, site, std::move(f), -1, gradient, bad.stats.nan > 0);
}

void reach_from_loss(tracer_state& st, int64_t sequence_nr) {
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto it = st.forward_ops.find(sequence_nr);
  if (it == st.forward_ops.end() || it->second.nonfinite_record < 0) return;
  st.records[st.records[it->second.nonfinite_record].origin].reached = true;
  publish(st);
}

void reach_from_leaf(tracer_state& st, const taint& t) {
  std::lock_guard<std::mutex> lock(st.mutex);
  st.records[st.records[t.record].origin].reached = true;
}

void reach_from_output(tracer_state& st, const at::Tensor& out) {
  if (!measurable(out)) return;
  if (const std::optional<taint> known = taint_of(st, real_values(out))) reach_from_leaf(st, *known);
}

void judge_all(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.mutex);
  for (finding_record& r : st.records) r.judged = true;
  publish(st);
}

bool any_open_chain(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.mutex);
  return std::any_of(st.records.begin(), st.records.end(), [&](const finding_record& r) {
    const finding_record& origin = st.records[r.origin];
    return !origin.judged || !origin.reached;
  });
}

std::optional<taint> taint_of(tracer_state& st, const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(st.mutex);
  const taint* known = st.reported.find_viewed(t);
  return known ? std::optional<taint>(*known) : std::nullopt;
}

}  // namespace nanguard::detail
