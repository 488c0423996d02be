// tracer_state.h — the tracer's private state, and the records of the ops
// it watches: shared by its RecordFunction callbacks (tracer.cpp), its
// findings (tracer_findings.cpp) and its deferred path (tracer_deferred.cpp).
#pragma once

#include "nanguard/finding.h"
#include "nanguard/nonfinite_record.h"
#include "nanguard/tracer_options.h"

#include "detail/call_stack.h"
#include "detail/observer_slot.h"
#include "op_traits.h"
#include "range_rules.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nanguard::detail {

/// A tracer's state (defined below): what its RecordFunction callbacks
/// (plain function pointers), its findings and its deferred path share.
struct tracer_state;

// The owner of a dotted name: "encoder.0.weight" -> "encoder.0".
inline std::string_view parent_of(std::string_view name) {
  const size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
}

// Where an op ran, kept per op without building strings; resolved to a
// dotted module path only when a finding needs it (see module_of).
struct module_ref {
  std::string scripted;                      // TorchScript's hierarchy, inside scripted code
  const std::string* parameter = nullptr;    // a parameter it reads, owned by the open scope
  std::optional<std::string> owner;          // the module owning all the parameters it reads, when they are several
  std::shared_ptr<const std::string> scope;  // the open scope

  std::string path() const {
    if (!scripted.empty()) return scripted;
    if (owner) return *owner;
    if (parameter) return std::string(parent_of(*parameter));
    return scope ? *scope : "";
  }
};

// A forward op as the findings of its backward nodes name it.
struct forward_record {
  std::string op;  // owned: a Python autograd.Function's name dies with its call
  module_ref module;
  call_stack stack;  // with record_sources: where the user's code ran it
  int nonfinite_record = -1;  // the finding record of its non-finite output, if any
};

// An autograd node being run on this thread.
struct node_frame {
  std::string name;
  int64_t sequence_nr;
  bool grad_mode;  // as the engine runs the node: on only for create_graph
};

// An autograd node's start callback pushed a node_frame.
struct node_context : at::ObserverContext {};

// An op as a finding names it: what it was handed and where it ran.
struct op_frame {
  const char* op = "";
  const op_traits* traits = nullptr;
  c10::SmallVector<at::Tensor, 4> inputs;
  c10::SmallVector<int, 4> argument_of;  // inputs[k] came from the op's argument argument_of[k]
  // With keep_inputs: copies of the inputs the op writes, taken before it runs.
  c10::SmallVector<at::Tensor, 1> values_before;
  module_ref module;
  call_stack stack;  // forward, with record_sources: this thread's stack as it started
};

// What a start callback hands its end callback.
struct op_context : at::ObserverContext, op_frame {
  // Inputs the op writes (in-place self, or the same tensor as an out=
  // buffer): whether each held a NaN or Inf before the op; -1 for the rest.
  c10::SmallVector<int8_t, 4> nonfinite_before;
  // Deferred: where the record's read of those old values will be written
  // (null for the rest); nonfinite_before is read from it on the way out.
  c10::SmallVector<std::shared_ptr<int8_t>, 1> before_cells;
  c10::SmallVector<maybe_range, 1> output_ranges;  // by output index, from the op's range rule
  uint64_t memo_writes = 0;  // this thread's range_memo::writes() as the op started (writes_unreturned)
  at::CallbackHandle sealed = 0;         // the tracer's callback, disabled while this op runs
  bool deferred = false;                 // checked on the deferred path (see deferred_check)
};

// Where an op ran, as its end callback sees it: what a finding names. On
// the eager path read from the RecordFunction and this thread's stacks; on
// the deferred path from a deferred_op, kept until the record is read.
struct op_site {
  const char* name = "";
  int64_t seq_nr = -1;
  bool function_scope = false;           // a FUNCTION-scope record (an op, not a node)
  uint64_t thread = 0;
  c10::ArrayRef<c10::IValue> outputs;
  const node_frame* node = nullptr;      // the autograd node being run; nullptr forward
  c10::ArrayRef<const op_frame*> stack;  // the ops running around it, outermost first
};

// A node that ran in the current backward pass (see check_node_inputs).
struct ran_node {
  std::weak_ptr<torch::autograd::Node> node;
  std::string name;
  int64_t sequence_nr;
};

// An op whose checks are deferred: its context and site, copied out of
// the callbacks (whose stacks and RecordFunction are gone by the time the
// record is read) and kept, with its tensors, until then.
struct deferred_op {
  op_context ctx;
  std::string name;  // owned: ctx.op and site().name point here
  int64_t seq_nr = -1;
  bool function_scope = false;
  uint64_t thread = 0;
  std::vector<c10::IValue> outputs;
  std::optional<node_frame> node;
  std::vector<op_frame> enclosing;  // copies of the ops around it (reserved: addresses stay)
  std::vector<std::string> enclosing_names;
  std::vector<const op_frame*> stack;
  std::optional<ran_node> sender;  // a node input's sender (see on_nonfinite_node_input)

  op_site site() const {
    return {name.c_str(), seq_nr, function_scope, thread, outputs, node ? &*node : nullptr, stack};
  }
};

// Names of tensors by their TensorImpl. The weak reference keeps the impl's
// memory from being reused while named (so a new tensor at the same address
// cannot inherit the name) and tells whether the tensor is still alive.
class tensor_names {
  using weak_impl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

 public:
  void set(const at::Tensor& t, std::string name) {
    names_.insert_or_assign(t.unsafeGetTensorImpl(), entry{weak_impl(t.getIntrusivePtr()), std::move(name)});
  }
  /// The name of the live tensor `impl`, or nullptr.
  const std::string* find(const c10::TensorImpl* impl) const {
    const auto it = names_.find(impl);
    return it == names_.end() || it->second.tensor.expired() ? nullptr : &it->second.name;
  }
  /// The names of the live tensors, sorted.
  std::vector<std::string> live_names() const {
    std::vector<std::string> out;
    for (const auto& entry : names_)
      if (!entry.second.tensor.expired()) out.push_back(entry.second.name);
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  struct entry {
    weak_impl tensor;
    std::string name;
  };
  std::unordered_map<const c10::TensorImpl*, entry> names_;
};

// What the tracer knows of a non-finite tensor it saw made: the record of
// the chain its values belong to, and whether it holds NaN.
struct taint {
  int record = 0;
  bool nan = false;
};

// Tensors marked by their data (an output already in a finding, one whose
// non-finite values are allowed), for as long as that data lives: a freed
// buffer's address comes back for new tensors, which must not inherit the
// mark. The weak reference keeps the storage's own address from going to a
// new storage and tells whether the marked one is still alive.
class marked_data {
  using weak_storage = c10::weak_intrusive_ptr<c10::StorageImpl>;
  struct mark {
    weak_storage storage;
    taint what;
  };

 public:
  /// Marks `t` and, when it is a view written in place (`mask[:, 4:].fill_(-inf)`),
  /// the tensor it views: reading that one reads the marked values too.
  void insert(const at::TensorBase& t, taint what = {}) {
    if (!t.has_storage()) return;
    marks_.insert_or_assign(t.const_data_ptr(), mark{weak_storage::reclaim_copy(t.storage().unsafeGetStorageImpl()), what});
    if (t.is_view() && t._base().defined() && !contains(t._base())) insert(t._base(), what);
  }
  /// What `t` was marked with, or nullptr.
  const taint* find(const at::TensorBase& t) const {
    return t.has_storage() ? find_at(t.const_data_ptr(), t) : nullptr;
  }
  /// What `t`, or the tensor it views, was marked with, or nullptr: a slice
  /// (`hidden[:, -1:]`) starts inside its base's data. Found at the start of
  /// the storage, as inference-mode views keep no `_base`.
  const taint* find_viewed(const at::TensorBase& t) const {
    if (!t.has_storage()) return nullptr;
    const taint* own = find_at(t.const_data_ptr(), t);
    if (own || t.storage_offset() == 0) return own;
    return find_at(static_cast<const char*>(t.const_data_ptr()) - t.storage_offset() * int64_t(t.itemsize()), t);
  }
  bool contains(const at::TensorBase& t) const { return find(t) != nullptr; }
  void clear() { marks_.clear(); }

 private:
  // The mark at `data` if it was made on `t`'s storage, still alive.
  const taint* find_at(const void* data, const at::TensorBase& t) const {
    const auto it = marks_.find(data);
    const bool live = it != marks_.end() && !it->second.storage.expired() &&
                      it->second.storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl();
    return live ? &it->second.what : nullptr;
  }

  std::unordered_map<const void*, mark> marks_;
};

// A finding as recorded, before the step shows whether its values mattered.
struct finding_record {
  nanguard::finding finding;
  int origin;                     // the record of the producer or input its values descend from (itself for those)
  bool judged = false;            // (origins) a leaf received a gradient since it was recorded
  bool reached = false;           // (origins) its non-finite values reached the loss or a leaf's gradient
  // (origins) intended infinities a reduction gathered (see gathers()): shown
  // once reached, or when nothing else is found; unjudged, no finding of its own.
  bool gathered = false;
};

// What the deferred path enqueued on its record (a tensor's check), or an
// event of the backward pass that judges findings, in the order the eager
// path would have run them; replayed so once the record is read.
struct deferred_check {
  enum class kind {
    output,      // an op's output (or an input it wrote without returning it)
    old_values,  // what an op is about to overwrite
    node_input,  // a gradient handed to an autograd node
    loss,        // a backward pass starts at `sequence_nr` (see reach_from_loss)
    leaf,        // a leaf received its gradient: every record is judged
    model_output,  // the traced model returned `tensor` (see tracer::judge_by_outputs)
  };
  explicit deferred_check(kind what, std::shared_ptr<deferred_op> op = nullptr, at::Tensor tensor = {})
      : what(what), op(std::move(op)), tensor(std::move(tensor)) {}

  kind what;
  std::shared_ptr<deferred_op> op;  // output, node_input
  at::Tensor tensor;                // output, old_values, node_input, model_output
  int64_t ordinal = -1;             // the tensor's position in the record (set: an earlier check's)
  int index = 0;                    // output: its index (kWrittenArgument); node_input: its input
  bool into_leaf = false;           // node_input: of an AccumulateGrad
  int64_t sequence_nr = -1;         // loss
  std::shared_ptr<int8_t> before;   // old_values: where to write whether they were non-finite
};

// The autograd nodes being run on this thread, innermost last.
inline std::vector<node_frame>& node_stack() {
  thread_local std::vector<node_frame> stack;
  return stack;
}

// The autograd node this thread's current op runs in as its backward, or
// nullptr for a forward op. An op run with grad mode on inside a node the
// engine runs with it off is a forward run inside the backward pass: the
// recomputation of a checkpoint (torch.utils.checkpoint), whose graph the
// backward runs next, its nodes made by these ops.
inline const node_frame* running_node(const std::vector<node_frame>& nodes = node_stack()) {
  if (nodes.empty() || (!nodes.back().grad_mode && c10::GradMode::is_enabled())) return nullptr;
  return &nodes.back();
}

// The ops running on this thread, outermost first: a composite op (aten::mean)
// runs others inside it, not all of them recorded.
inline std::vector<const op_frame*>& op_stack() {
  thread_local std::vector<const op_frame*> stack;
  return stack;
}

inline constexpr char kEngineFrame[] = "autograd::engine::evaluate_function: ";

// True for the engine's frame; the first two characters turn away every
// aten:: op before the whole prefix is compared.
inline bool is_engine_frame(const char* name) {
  return name[0] == 'a' && name[1] == 'u' && std::strncmp(name, kEngineFrame, sizeof(kEngineFrame) - 1) == 0;
}

// Whether an op's output can hold values that no check has seen. Outputs
// the schema calls new can still alias an input (aten::_unsafe_view).
inline bool holds_new_values(output_kind kind, const at::Tensor& out, const op_context& ctx) {
  if (kind == output_kind::view) return false;
  if (kind == output_kind::written || ctx.traits->inplace) return true;
  for (const auto& in : ctx.inputs)
    if (out.is_alias_of(in)) return false;
  return true;
}

// on_nonfinite_output's output index for a tensor the op wrote without
// returning it: the finding lists it after the outputs.
inline constexpr int kWrittenArgument = -1;

// What a scan reads for an op.
enum class scanned { output, old_values, parameter, node_input };

// count_scan's work, when the tracer measures its cost (tracer_state.cpp).
void add_scan_to_cost(tracer_state& st, const at::Tensor& t, const char* op, scanned what);

// Tensors a collective wrote: another rank's values, named "received via
// all-reduce" (the collective) from then on, for as long as the storage
// lives (another collective into it renames it). The version cannot tell
// when the values stop being the collective's: a backend writes them on its
// own thread (Gloo's reduce-scatter copies its result in), bumping it.
class received_data {
  using weak_storage = c10::weak_intrusive_ptr<c10::StorageImpl>;
  struct mark {
    weak_storage storage;
    int64_t version = 0;
    std::string name;
  };

 public:
  void insert(const at::Tensor& t, std::string name) {
    if (!t.has_storage()) return;
    if (marks_.size() >= 256)  // one per collective: forget the freed ones
      for (auto it = marks_.begin(); it != marks_.end();) it = it->second.storage.expired() ? marks_.erase(it) : ++it;
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    marks_.insert_or_assign(storage, mark{weak_storage::reclaim_copy(storage), t._version(), std::move(name)});
  }
  /// The name of the collective that wrote `t` (or a view of it), or nullptr.
  const std::string* find(const at::Tensor& t) const {
    if (!t.has_storage()) return nullptr;
    const auto it = marks_.find(t.storage().unsafeGetStorageImpl());
    const bool live = it != marks_.end() && !it->second.storage.expired() && t._version() >= it->second.version;
    return live ? &it->second.name : nullptr;
  }

 private:
  std::unordered_map<const c10::StorageImpl*, mark> marks_;
};

// What a tracer holds: its options and findings, what it knows of the
// step's ops and tensors, its cost, and its deferred checks.
struct tracer_state {
  tracer_options options;
  std::mutex mutex;  // the fields below; taken per op, uncontended unless all_threads
  int64_t step = 0;
  // Every finding recorded, in order; `findings` is what the step showed
  // mattered (see publish()), what findings() returns.
  std::vector<finding_record> records;
  std::vector<finding> findings;
  // What the callbacks cost (options.measure_cost only).
  std::atomic<int64_t> ops{0}, scans{0}, scanned_bytes{0}, nanoseconds{0}, scan_nanoseconds{0};
  std::unordered_map<std::string, tracer_op_scans> scans_by_op;  // under mutex
  tensor_names parameters;
  tensor_names named;
  std::unordered_map<int64_t, forward_record> forward_ops;  // by sequence number (remember_forward_op)
  std::vector<int64_t> forward_order;                       // their sequence numbers, oldest first from forward_next
  size_t forward_next = 0;
  marked_data allowed;   // outputs holding intentional non-finite values
  marked_data reported;  // non-finite outputs seen, marked with the record of their origin
  received_data received;  // what the collectives wrote
  // The deferred path (see settle): its record, what it holds until read,
  // and the bytes of the tensors checked; under deferred_mutex, taken
  // before `mutex` when both are.
  std::mutex deferred_mutex;
  nonfinite_record pending_record{record_options().stats(true)};
  std::vector<deferred_check> pending;
  int64_t pending_bytes = 0;
  // The outputs checked since the last read (held by `pending`, so their
  // addresses are theirs), by TensorImpl: their version then, and position.
  std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, int64_t>> checked_outputs;
  observer_slot<tracer_state> slot{"nanguard::tracer"};  // last: uninstalled before the rest goes
};

// Counts a read of `t` for `op` in the tracer's cost, when measured: inline,
// as every scan on the hot path calls it.
inline void count_scan(tracer_state& st, const at::Tensor& t, const char* op, scanned what) {
  if (st.options.measure_cost()) add_scan_to_cost(st, t, op, what);
}

}  // namespace nanguard::detail
