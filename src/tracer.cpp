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
#include "nanguard/tracer.h"

#include "nanguard/nonfinite_record.h"
#include "nanguard/scope.h"

#include "detail/op_tensors.h"
#include "detail/observer_slot.h"
#include "detail/op_traits.h"
#include "detail/range_rules.h"
#include "detail/scope_handle.h"

#include <ATen/record_function.h>
#include <c10/util/Backtrace.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <torch/nn/module.h>

#include <fnmatch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>

namespace nanguard {

using detail::collect_tensors;
using detail::maybe_range;
using detail::measurable;
using detail::op_traits;
using detail::output_kind;
using detail::value_range;

namespace {

// The owner of a dotted name: "encoder.0.weight" -> "encoder.0".
std::string_view parent_of(std::string_view name) {
  const size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
}

// Where an op ran, kept per op without building strings; resolved to a
// dotted module path only when a finding needs it (see module_of).
struct module_ref {
  std::string scripted;                      // TorchScript's hierarchy, inside scripted code
  const std::string* parameter = nullptr;    // a parameter it reads, owned by the open scope
  std::shared_ptr<const std::string> scope;  // the open scope

  std::string path() const {
    if (!scripted.empty()) return scripted;
    if (parameter) return std::string(parent_of(*parameter));
    return scope ? *scope : "";
  }
};

struct forward_record {
  std::string op;  // owned: a Python autograd.Function's name dies with its call
  module_ref module;
  int nonfinite_record = -1;  // the finding record of its non-finite output, if any
};

// An autograd node being run on this thread.
struct node_frame {
  std::string name;
  int64_t sequence_nr;
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

// The ranges of tensors this thread has seen finite since their last
// recorded write, read by a scan or bounded by a rule: an in-place op on
// one needs no scan of its old values, and range rules build on them.
//
// An entry remembers a tensor by TensorImpl, storage, first element, size,
// dtype and version counter, which every recorded in-place write bumps. A
// set of two slots is chosen by the first element, and a recorded write
// through any tensor starting there replaces the entry that has it.
// Another tensor over the same memory reads the entry too when its
// elements lie within the remembered (contiguous) ones and those are
// unchanged: autograd's saved outputs, detach(), _unsafe_view, a bias
// expanded inside addmm. Weak references keep a remembered TensorImpl's or
// StorageImpl's memory from going to a new one, which would otherwise match
// a dead one's entry. Writes behind LibTorch's back (through data_ptr())
// bump nothing, so what the memo knows lasts one tracer step (see
// generation).
//
// A weak reference pins the TensorImpl or StorageImpl object (not the data)
// of a dead tensor until its entry goes. Pinned all over the heap, such
// objects keep glibc from reusing the freed blocks between them: a traced
// loop grew by tens of MB a step and paid for it in page faults inside
// ATen's kernels. So the entries of a past generation go at the first
// write of a new one, and those whose storage died every kSweepEvery writes:
// a sweep visits only the slots in use (a few hundred of the 4096), so it
// can run often enough that a freed activation's objects go back to the
// allocator within a few ops of its death.
class range_memo {
  using weak_impl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  using weak_storage = c10::weak_intrusive_ptr<c10::StorageImpl>;

 public:
  /// The range of `t`, when known since its last write.
  const value_range* find(const at::TensorBase& t) const {
    const entry* e = find_entry(t);
    return e ? &e->range : nullptr;
  }
  /// How many ranges this memo has recorded so far.
  uint64_t writes() const { return writes_; }
  /// True when `t`'s range is known from a write recorded after the memo
  /// had recorded `writes` of them.
  bool written_since(const at::TensorBase& t, uint64_t writes) const {
    const entry* e = find_entry(t);
    return e && e->write > writes;
  }
  void insert(const at::TensorBase& t, const value_range& range) {
    if (!rememberable(t)) return;
    if (writes_ - swept_at_ >= kSweepEvery || swept_generation_ != generation.load(std::memory_order_relaxed)) sweep();
    entry& e = slot_for(t);
    entry next{weak_impl::reclaim_copy(t.unsafeGetTensorImpl()),
               weak_storage::reclaim_copy(t.storage().unsafeGetStorageImpl()),
               t.data_ptr(),
               t.numel(),
               t.scalar_type(),
               t.is_contiguous(),
               t._version(),
               generation.load(std::memory_order_relaxed),
               ++writes_,
               range};
    carry_owner(e, next, t);
    e = std::move(next);
    list(size_t(&e - slots_.data()));
  }
  /// Forgets the range of `t` and of any tensor remembered over its elements.
  void erase(const at::TensorBase& t) {
    if (!rememberable(t)) return;
    if (entry* e = way_with(&slots_[first_way(t)], t.data_ptr())) *e = entry();
  }
  /// Forgets what every thread's memo knows.
  static void forget_all() { generation.fetch_add(1, std::memory_order_relaxed); }
  /// Drops the entries that can no longer match: of a past generation, or
  /// over a storage that died (what they pin goes back to the allocator).
  void sweep() {
    const uint64_t now = generation.load(std::memory_order_relaxed);
    size_t kept = 0;
    for (const uint32_t slot : in_use_) {
      entry& e = slots_[slot];
      if (e.data && (e.generation != now || e.storage.expired())) e = entry();
      if (e.data) in_use_[kept++] = slot;
      else listed_[slot] = false;
    }
    in_use_.resize(kept);
    swept_at_ = writes_;
    swept_generation_ = now;
  }

 private:
  struct entry {
    weak_impl impl = weak_impl(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
    weak_storage storage = weak_storage(c10::intrusive_ptr<c10::StorageImpl>());
    const void* data = nullptr;
    int64_t numel = 0;
    at::ScalarType dtype = at::ScalarType::Undefined;
    bool contiguous = false;
    int64_t version = 0;
    uint64_t generation = 0;
    uint64_t write = 0;  // the memo's count of writes when this one was recorded
    value_range range;
    // A tensor over the same elements, remembered before a write through
    // another one (grad.data().mul_(c) writes grad's values but bumps
    // only the version of grad.data()): its version then, which a write
    // through it would bump.
    weak_impl owner = weak_impl(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
    int64_t owner_version = 0;
  };
  const entry* find_entry(const at::TensorBase& t) const {
    if (!rememberable(t)) return nullptr;
    const entry* found = way_with(&slots_[first_way(t)], t.data_ptr());
    if (!found) return nullptr;
    const entry& e = *found;
    if (e.generation != generation.load(std::memory_order_relaxed) || e.dtype != t.scalar_type() ||
        e.storage._unsafe_get_target() != t.storage().unsafeGetStorageImpl())
      return nullptr;
    const c10::TensorImpl* remembered = e.impl._unsafe_get_target();
    if (remembered == t.unsafeGetTensorImpl())
      return e.version == t._version() && e.numel == t.numel() ? &e : nullptr;
    if (e.owner._unsafe_get_target() == t.unsafeGetTensorImpl())
      return e.owner_version == t._version() && e.numel == t.numel() ? &e : nullptr;
    if (!e.contiguous || !within(t, e.numel)) return nullptr;
    // Unchanged: the remembered tensor is at its version. Once it is gone,
    // only writes through others could change them, and a write through `t`
    // would have bumped `t`'s version: a view shares the remembered one's
    // counter, an alias of its own (detach(), .data) starts at 0. So a
    // gradient stays known after a clip wrote it through grad.data().
    if (e.impl.use_count() > 0) return remembered->version_counter().current_version() == e.version ? &e : nullptr;
    return t._version() == e.version || t._version() == 0 ? &e : nullptr;
  }
  static bool unchanged_since(const weak_impl& impl, int64_t version) {
    return impl.use_count() > 0 && impl._unsafe_get_target()->version_counter().current_version() == version;
  }
  // Keeps, in `next` (about to replace `e` for a write through `t`), the
  // tensor `e` knew over the same elements while it is unchanged since.
  void carry_owner(const entry& e, entry& next, const at::TensorBase& t) const {
    const bool same_elements = e.generation == next.generation && e.data == next.data &&
                               e.storage._unsafe_get_target() == next.storage._unsafe_get_target() &&
                               e.dtype == next.dtype && e.numel == next.numel && e.contiguous && next.contiguous;
    if (!same_elements) return;
    const c10::TensorImpl* writer = t.unsafeGetTensorImpl();
    if (e.impl._unsafe_get_target() != writer && unchanged_since(e.impl, e.version)) {
      next.owner = e.impl;
      next.owner_version = e.version;
    } else if (e.owner._unsafe_get_target() != writer && unchanged_since(e.owner, e.owner_version)) {
      next.owner = e.owner;
      next.owner_version = e.owner_version;
    }
  }
  // Adds a slot that now holds an entry to those a sweep visits.
  void list(size_t slot) {
    if (listed_[slot]) return;
    listed_[slot] = true;
    in_use_.push_back(uint32_t(slot));
  }
  // Inference tensors have no version counter, sparse ones no storage, a
  // FakeTensor no values (a range rule looks its arguments up here).
  static bool rememberable(const at::TensorBase& t) {
    return !t.is_inference() && t.has_storage() && detail::holds_values(t);
  }
  // True when every element of `t` is among the `numel` that follow its first.
  static bool within(const at::TensorBase& t, int64_t numel) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return last < numel;
  }
  // Two ways per set: only a third tensor whose first element maps there
  // evicts one (the older), which costs a scan. Direct-mapped, any two
  // tensors could evict each other, depending on where the allocator put
  // them: a program would rescan the same tensors on every step.
  static constexpr size_t kWays = 2, kSets = 2048;  // 2^11 sets: the hash's top 11 bits
  static_assert(kWays == 2, "slot_for picks the older of two ways");
  static size_t first_way(const at::TensorBase& t) {
    return ((reinterpret_cast<uintptr_t>(t.data_ptr()) >> 4) * 0x9E3779B97F4A7C15ull >> 53) * kWays;
  }
  // The way of `set` that has the entry starting at `data`, or nullptr: at
  // most one has it, since a write goes to that way (slot_for).
  template <typename Entry>
  static Entry* way_with(Entry* set, const void* data) {
    for (size_t way = 0; way < kWays; ++way)
      if (set[way].data == data) return &set[way];
    return nullptr;
  }
  // The slot for a write to `t`: the one that has its first element, else
  // an empty or forgotten one, else the older.
  entry& slot_for(const at::TensorBase& t) {
    entry* set = &slots_[first_way(t)];
    if (entry* e = way_with(set, t.data_ptr())) return *e;
    const uint64_t now = generation.load(std::memory_order_relaxed);
    for (size_t way = 0; way < kWays; ++way)
      if (set[way].generation != now) return set[way];
    return set[0].write < set[1].write ? set[0] : set[1];
  }
  // Pins held longer cost page faults (see above); a sweep costs a few us.
  static constexpr uint64_t kSweepEvery = 16;
  static inline std::atomic<uint64_t> generation{1};
  std::vector<entry> slots_ = std::vector<entry>(kSets * kWays);
  std::vector<uint32_t> in_use_;                           // the slots a sweep visits
  std::vector<bool> listed_ = std::vector<bool>(kSets * kWays);  // in in_use_
  uint64_t writes_ = 0;
  uint64_t swept_at_ = 0;           // writes_ at the last sweep
  uint64_t swept_generation_ = 0;  // the generation then
};

range_memo& this_thread_memo() {
  thread_local range_memo memo;
  return memo;
}

// The range of `t` when the memo knows it; a view is known through its
// base, whose version counter it shares (and whose range holds its values).
maybe_range known_range(const range_memo& memo, const at::Tensor& t) {
  const value_range* r = memo.find(t);
  if (!r && t.is_view() && t._base().defined()) r = memo.find(t._base());
  return r ? maybe_range(*r) : c10::nullopt;
}

// Records what an op wrote into `t`: its range when finite, else that its
// range is unknown. A kernel may write through an op nested in it without
// bumping the version counter (masked_fill runs masked_fill_ on a clone),
// so the entry itself must change; and a write into a view changes its base.
void remember_write(range_memo& memo, const at::Tensor& t, const value_range& r) {
  const at::TensorBase base = t.is_view() ? t._base() : at::TensorBase();
  const value_range* before = base.defined() ? memo.find(base) : nullptr;
  const maybe_range base_range = before ? maybe_range(before->hull(r)) : c10::nullopt;
  if (r.finite()) memo.insert(t, r);
  else memo.erase(t);
  if (!base.defined()) return;
  if (base_range && base_range->finite()) memo.insert(base, *base_range);
  else memo.erase(base);
}

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

 private:
  struct entry {
    weak_impl tensor;
    std::string name;
  };
  std::unordered_map<const c10::TensorImpl*, entry> names_;
};

// Tensors marked by their data (an output already in a finding, one whose
// non-finite values are allowed), for as long as that data lives: a freed
// buffer's address comes back for new tensors, which must not inherit the
// mark. The weak reference keeps the storage's own address from going to a
// new storage and tells whether the marked one is still alive.
// What the tracer knows of a non-finite tensor it saw made: the record of
// the chain its values belong to, and whether it holds NaN.
struct taint {
  int record = 0;
  bool nan = false;
};

class marked_data {
  using weak_storage = c10::weak_intrusive_ptr<c10::StorageImpl>;
  struct mark {
    weak_storage storage;
    taint what;
  };

 public:
  void insert(const at::TensorBase& t, taint what = {}) {
    if (t.has_storage())
      marks_.insert_or_assign(t.data_ptr(), mark{weak_storage::reclaim_copy(t.storage().unsafeGetStorageImpl()), what});
  }
  /// What `t` was marked with, or nullptr.
  const taint* find(const at::TensorBase& t) const {
    if (!t.has_storage()) return nullptr;
    const auto it = marks_.find(t.data_ptr());
    const bool live = it != marks_.end() && !it->second.storage.expired() &&
                      it->second.storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl();
    return live ? &it->second.what : nullptr;
  }
  bool contains(const at::TensorBase& t) const { return find(t) != nullptr; }
  void clear() { marks_.clear(); }

 private:
  std::unordered_map<const void*, mark> marks_;
};

// A finding as recorded, before the step shows whether its values mattered.
struct finding_record {
  nanguard::finding finding;
  int origin;                     // the record of the producer or input its values descend from (itself for those)
  bool judged = false;            // (origins) a leaf received a gradient since it was recorded
  bool reached = false;           // (origins) its non-finite values reached the loss or a leaf's gradient
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
  };
  explicit deferred_check(kind what, std::shared_ptr<deferred_op> op = nullptr, at::Tensor tensor = {})
      : what(what), op(std::move(op)), tensor(std::move(tensor)) {}

  kind what;
  std::shared_ptr<deferred_op> op;  // output, node_input
  at::Tensor tensor;                // output, old_values, node_input
  int64_t ordinal = -1;             // the tensor's position in the record (set: an earlier check's)
  int index = 0;                    // output: its index (kWrittenArgument); node_input: its input
  bool into_leaf = false;           // node_input: of an AccumulateGrad
  int64_t sequence_nr = -1;         // loss
  std::shared_ptr<int8_t> before;   // old_values: where to write whether they were non-finite
};

}  // namespace

struct tracer::state {
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
  detail::observer_slot<state> slot{"nanguard::tracer"};  // last: uninstalled before the rest goes
};

// What the RecordFunction callbacks below (free functions: callbacks are
// plain function pointers) use to reach the tracer's private state.
struct tracer_callbacks {
  using state = tracer::state;
};

namespace {

using tracer_state = tracer_callbacks::state;

std::vector<node_frame>& node_stack() {
  thread_local std::vector<node_frame> stack;
  return stack;
}

// The ops running on this thread, outermost first: a composite op (aten::mean)
// runs others inside it, not all of them recorded.
std::vector<const op_frame*>& op_stack() {
  thread_local std::vector<const op_frame*> stack;
  return stack;
}

// The site of the op `fn` on this thread, as its end callback sees it.
op_site site_of(const at::RecordFunction& fn) {
  const auto& nodes = node_stack();
  return {fn.name(), fn.seqNr(), fn.scope() == at::RecordScope::FUNCTION, fn.threadId(), fn.outputs(),
          nodes.empty() ? nullptr : &nodes.back(), op_stack()};
}

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

using detail::callback_scope;

tracer_state* current_state() { return detail::observer_slot<tracer_state>::current(); }

constexpr char kEngineFrame[] = "autograd::engine::evaluate_function: ";

// True for the engine's frame; the first two characters turn away every
// aten:: op before the whole prefix is compared.
bool is_engine_frame(const char* name) {
  return name[0] == 'a' && name[1] == 'u' && std::strncmp(name, kEngineFrame, sizeof(kEngineFrame) - 1) == 0;
}

std::string strip_node_prefix(const char* name) {
  return is_engine_frame(name) ? std::string(name + sizeof(kEngineFrame) - 1) : std::string(name);
}

// True when module path `inner` is `outer` or inside it.
bool within(std::string_view inner, std::string_view outer) {
  return outer.empty() || inner == outer ||
         (inner.size() > outer.size() && inner.substr(0, outer.size()) == outer && inner[outer.size()] == '.');
}

// The module of an op: TorchScript's hierarchy, then the parameters it
// reads (when inside the open scope), then the open scope.
module_ref module_of(tracer_state& st, const c10::SmallVector<at::Tensor, 4>& inputs) {
  module_ref m;
  m.scripted = dotted_module_path(torch::jit::currentModuleHierarchy());
  if (!m.scripted.empty()) return m;
  m.scope = detail::current_scope_handle();
  const std::string_view open = m.scope ? std::string_view(*m.scope) : std::string_view();
  for (const auto& t : inputs) {
    const std::string* name = st.parameters.find(t.unsafeGetTensorImpl());
    if (!name) continue;
    if (within(parent_of(*name), open)) {
      m.parameter = name;
      return m;
    }
  }
  return m;
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

std::string name_of(tracer_state& st, const at::Tensor& t, const std::string& fallback) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (const std::string* name = st.parameters.find(impl)) return *name;
  if (const std::string* name = st.named.find(impl)) return *name;
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

// on_nonfinite_output's output index for a tensor the op wrote without
// returning it: the finding lists it after the outputs.
constexpr int kWrittenArgument = -1;

// How records become what findings() returns: judged by their consequence.
// Every non-finite output is marked with the record of the producer (or
// input) its values descend from; propagators join that chain. A chain
// matters when its values reach the loss (the output whose backward node
// starts a backward pass) or a gradient (what a leaf's AccumulateGrad
// receives). Each leaf judges every chain recorded so far: one that
// mattered is a finding; one absorbed on the way (a masked score that
// softmax turned into a zero, an infinity a backward formula masks out) is
// not. A chain no leaf has judged yet (the step is still running, or has no
// backward pass) is shown.
void publish(tracer_state& st) {
  st.findings.clear();
  for (const finding_record& r : st.records) {
    if (int64_t(st.findings.size()) >= st.options.max_findings()) break;
    const finding_record& origin = st.records[r.origin];
    if (!origin.judged || origin.reached) st.findings.push_back(r.finding);
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
            bool out_holds_nan) {
  const int index = int(st.records.size());
  f.diagnosis = diagnose(f);
  st.records.push_back({std::move(f), origin < 0 ? index : origin});
  mark(st, site, out, {index, out_holds_nan});
  publish(st);
}

// Infinities written as constants (a mask) or handed in as data are meant;
// a NaN made from them (a softmax row with nothing left to attend to) is a
// new finding. A NaN made from computed infinities (inf - inf, 0 * inf after
// an overflow) belongs to the infinity's chain.
bool meant(const finding& origin) {
  static const char* const constant_writers[] = {
      "aten::full",      "aten::full_like",    "aten::new_full",    "aten::fill_", "aten::masked_fill",
      "aten::masked_fill_", "aten::index_put_", "aten::index_fill_", "aten::where", "aten::scatter_",
      "aten::copy_"};
  if (origin.role == role::input) return true;
  for (const char* op : constant_writers)
    if (origin.op == op) return true;
  return false;
}

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
    const taint* t = st.reported.find(in);
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

// `out_stats`: the census of `out` as the op left it when the deferred path
// took it; nullptr to take it now (the eager path, only when needed).
void on_nonfinite_output(tracer_state& st, const op_site& site, const op_context& ctx, const at::Tensor& out,
                         const tensor_stats* out_census, int output_index) {
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

  const std::string op = site.name;
  const tensor_stats out_stats = out_census ? *out_census : census(out);
  const node_frame* node = site.node;
  const bool backward = node != nullptr;
  std::string module = ctx.module.path();
  if (backward) {
    if (auto it = st.forward_ops.find(node->sequence_nr); it != st.forward_ops.end())
      module = it->second.module.path();
  }
  if (allowed_by_rules(st.options, op, module, out_stats)) {
    st.allowed.insert(out);
    return;
  }

  // Which inputs were non-finite, and were those intentional?
  bool any_bad_input = false, bad_inputs_allowed = true, allowed_nan = false, bad_inputs_hold_nan = false;
  int first_bad_input = -1;
  std::vector<tensor_record> inputs;
  for (size_t i = 0; i < ctx.inputs.size(); ++i) {
    const at::Tensor& in = ctx.inputs[i];
    const bool self_inplace = ctx.nonfinite_before[i] >= 0 && in.is_alias_of(out);
    tensor_record r = record_of(in, name_of(st, in, "input " + std::to_string(ctx.argument_of[i])));
    if (self_inplace) r.name += " (in place: as the op left it)";
    const bool bad = self_inplace ? ctx.nonfinite_before[i] == 1 : !r.stats.all_finite();
    if (bad) {
      any_bad_input = true;
      bad_inputs_hold_nan |= self_inplace || r.stats.nan > 0;  // what an in-place op overwrote is unknown
      if (first_bad_input < 0) first_bad_input = int(i);
      if (st.allowed.contains(in)) allowed_nan |= r.stats.nan > 0;
      else bad_inputs_allowed = false;
    }
    inputs.push_back(std::move(r));
  }
  if (any_bad_input && bad_inputs_allowed && (out_stats.nan == 0 || allowed_nan)) {
    st.allowed.insert(out);  // intentional infinities flowing on (mask + scores)
    return;
  }
  if (via && (out_stats.nan == 0 || bad_inputs_hold_nan || !meant(st.records[st.records[via->record].origin].finding))) {
    mark(st, site, out, {via->record, out_stats.nan > 0});
    return;
  }

  finding f;
  f.step = st.step;
  f.op = op;
  f.direction = backward ? direction::backward : direction::forward;
  if (backward) {
    f.node = strip_node_prefix(node->name.c_str());
    if (auto it = st.forward_ops.find(node->sequence_nr); it != st.forward_ops.end())
      f.forward_op = it->second.op;
    f.sequence_nr = node->sequence_nr;
  } else {
    f.sequence_nr = site.seq_nr;
  }
  f.module = module;
  if (!site.stack.empty() && site.stack.front()->op != op) f.caller = site.stack.front()->op;
  const op_frame* named_op = &ctx;  // the op the finding names, whose inputs it lists
  int origin = -1;
  if (!any_bad_input || bad_inputs_allowed) {
    f.role = role::producer;
  } else {
    const at::Tensor& culprit = ctx.inputs[first_bad_input];
    const std::string& culprit_name = inputs[first_bad_input].name;
    const bool named = culprit_name.rfind("input ", 0) != 0;
    const op_frame* maker = named ? nullptr : unrecorded_maker(site.stack, culprit);
    if (const taint* from = st.reported.find(culprit)) {
      f.culprit = culprit_name;
      origin = st.records[from->record].origin;
      const bool nan_from_meant_infinities =
          out_stats.nan > 0 && !bad_inputs_hold_nan && meant(st.records[origin].finding);
      f.role = nan_from_meant_infinities ? role::producer : role::propagator;
      if (nan_from_meant_infinities) origin = -1;  // a chain of its own, naming the infinity it came from
    } else if (maker) {
      // Made inside an enclosing op by unrecorded work: that op is the producer.
      f.op = maker->op;
      named_op = maker;
      f.caller = maker == site.stack.front() ? "" : site.stack.front()->op;
      f.role = role::producer;
      if (!backward) f.module = maker->module.path();
      inputs.clear();
      for (size_t i = 0; i < maker->inputs.size(); ++i) {
        const at::Tensor& in = maker->inputs[i];
        inputs.push_back(record_of(in, name_of(st, in, "input " + std::to_string(maker->argument_of[i]))));
        // Unless the enclosing op was handed a non-finite value itself.
        if (f.role == role::producer && !inputs.back().stats.all_finite()) {
          const taint* from = st.reported.find(in);
          f.role = from ? role::propagator : role::input;
          if (from) origin = st.records[from->record].origin;
          f.culprit = inputs.back().name;
        }
      }
    } else {
      f.role = role::input;
      f.culprit = culprit_name;
      // The next op that reads the same data propagates this finding.
      st.reported.insert(culprit, {int(st.records.size()), inputs[first_bad_input].stats.nan > 0});
    }
  }
  if (backward && origin < 0) {
    // The backward of an op whose forward already went non-finite is the
    // same failure: log(0) is -inf forward and 0/0 in LogBackward0.
    const auto it = st.forward_ops.find(node->sequence_nr);
    if (it != st.forward_ops.end() && it->second.nonfinite_record >= 0)
      origin = st.records[it->second.nonfinite_record].origin;
  }
  f.inputs = std::move(inputs);
  if (st.options.keep_inputs()) f.input_values = values_as_started(*named_op);
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
  f.index = out_stats.first_nonfinite_index;
  f.value = out_stats.first_nonfinite_value;
  f.thread = site.thread;
  if (st.options.capture_backtrace() && !out_census) f.backtrace = c10::get_backtrace(/*frames_to_skip=*/3);
  record(st, site, std::move(f), origin, out, out_stats.nan > 0);
}

// Whether an op's output can hold values that no check has seen. Outputs
// the schema calls new can still alias an input (aten::_unsafe_view).
bool holds_new_values(output_kind kind, const at::Tensor& out, const op_context& ctx) {
  if (kind == output_kind::view) return false;
  if (kind == output_kind::written || ctx.traits->inplace) return true;
  for (const auto& in : ctx.inputs)
    if (out.is_alias_of(in)) return false;
  return true;
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

// What a scan reads for an op.
enum class scanned { output, old_values, parameter, node_input };

// Counts a read of `t` for `op` in the tracer's cost, when measured.
void count_scan(tracer_state& st, const at::Tensor& t, const char* op, scanned what) {
  if (st.options.measure_cost()) {
    const int64_t bytes = t.numel() * int64_t(t.element_size());
    st.scans.fetch_add(1, std::memory_order_relaxed);
    st.scanned_bytes.fetch_add(bytes, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(st.mutex);
    const char* suffix = what == scanned::old_values  ? " (old values)"
                         : what == scanned::parameter ? " (parameter)"
                         : what == scanned::node_input ? " (gradient into the node)"
                                                       : "";
    const std::string key = std::string(op) + suffix;
    tracer_op_scans& entry = st.scans_by_op[key];
    entry.op = key;
    entry.scans += 1;
    entry.bytes += bytes;
  }
}

// The range of `t`'s values, read on this thread for `op` (its output, an
// input it writes, or a parameter it uses first); counted in the tracer's
// cost when measured.
value_range scan_range(tracer_state& st, const at::Tensor& t, const char* op, scanned what) {
  count_scan(st, t, op, what);
  const cost_meter meter(st, st.scan_nanoseconds);
  return detail::value_range_on_this_thread(t);
}

// The deferred path. A tensor on a device other than the CPU (or on the
// CPU too, with tracer_options::deferred) is not read when its op ends,
// which would be a host sync per op on a GPU: its check is enqueued on a
// nonfinite_record, on the tensor's stream, and the op's context and site
// are kept (deferred_op) with the tensors they hold. The record is read
// once (settle): when findings are asked for, when the step changes, or
// when what it holds reaches tracer_options::deferred_bytes; the checks
// are then replayed in order through the eager path's finding logic, with
// the census each check took as the op left the tensor. Ranges are not
// known without a read, so no range rule bounds a deferred op's outputs.

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

// The deferred record_written_inputs for input `k`: the check of its old
// values, read into the cell its nonfinite_before comes from.
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
    if (before.finite()) memo.insert(in, before);  // the op's range rule and inner ops build on it
  }
}

// The ranges the op's rule gives its outputs, from its arguments' ranges
// as they are before it runs.
void bound_outputs(tracer_state& st, const op_traits& traits, c10::ArrayRef<const c10::IValue> args,
                   op_context& ctx) {
  if (!traits.rule || detail::any_complex(args)) return;
  range_memo& memo = this_thread_memo();
  // A parameter is read once a step, where it is first used: it is
  // smaller than what the ops that use it make, and used again in the
  // backward pass and by the optimiser.
  for (const at::Tensor& in : ctx.inputs) {
    const at::Tensor p = in.is_view() && in._base().defined() ? at::Tensor(in._base()) : in;  // weight.t() in aten::linear
    if (!p.is_leaf() || !p.requires_grad() || known_range(memo, p)) continue;
    const value_range r = scan_range(st, p, ctx.op, scanned::parameter);
    if (r.finite()) memo.insert(p, r);
  }
  const auto lookup = [&](const at::Tensor& t) { return known_range(memo, t); };
  const detail::op_arguments arguments(args, lookup);
  ctx.output_ranges.resize(std::max<size_t>(traits.outputs.size(), 1));
  for (size_t i = 0; i < ctx.output_ranges.size(); ++i) ctx.output_ranges[i] = traits.rule->output(arguments, i);
}

void settle(tracer_state& st);

// The tensors an op wrote without returning them (see
// op_traits::writes_unreturned), read unless an op inside it recorded a
// write to them since it started (on CPU, aten::_foreach_mul_'s mul_ ops),
// which checked them.
void check_unreturned_writes(tracer_state& st, const at::RecordFunction& fn, op_context& ctx, range_memo& memo) {
  for (size_t k = 0; k < ctx.inputs.size(); ++k) {
    const at::Tensor& written = ctx.inputs[k];
    if (ctx.nonfinite_before[k] < 0 || !measurable(written) || memo.written_since(written, ctx.memo_writes)) continue;
    const value_range range = scan_range(st, written, ctx.op, scanned::output);
    remember_write(memo, written, range);
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
// from what the tracer saw before.
void mark_arguments_written(const at::RecordFunction& fn) {
  for (const c10::IValue& arg : fn.inputs()) {
    if (arg.isTensor()) mark_written(arg.toTensor());
    else if (arg.isTensorList())
      for (const at::Tensor& t : arg.toTensorVector()) mark_written(t);
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

// A gradient no op made, non-finite: the finding of the node that returned
// it (detect_anomaly's check, NaN and Inf), or of the gradient handed to
// backward() when no node did.
// `census_then`: as in on_nonfinite_output.
void on_nonfinite_node_input(tracer_state& st, const op_site& site, const ran_node* sender,
                             const at::Tensor& gradient, const tensor_stats* census_then, size_t input) {
  std::lock_guard<std::mutex> lock(st.mutex);
  tensor_record bad = record_of(gradient, "gradient " + std::to_string(input) + " into " + site.name);
  if (census_then) bad.stats = *census_then;
  finding f;
  f.step = st.step;
  f.direction = direction::backward;
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

// A backward pass starts at the loss's node: a non-finite loss mattered.
void reach_from_loss(tracer_state& st, int64_t sequence_nr) {
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto it = st.forward_ops.find(sequence_nr);
  if (it == st.forward_ops.end() || it->second.nonfinite_record < 0) return;
  st.records[st.records[it->second.nonfinite_record].origin].reached = true;
  publish(st);
}

bool is_accumulate_grad(const char* node) { return std::strstr(node, "AccumulateGrad") != nullptr; }

// What the tracer knows of a gradient (or of the tensor it views).
std::optional<taint> taint_of(tracer_state& st, const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(st.mutex);
  const taint* known = st.reported.find(t);
  if (!known && t.is_view() && t._base().defined()) known = st.reported.find(t._base());
  return known ? std::optional<taint>(*known) : std::nullopt;
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
  if (!node_stack().empty()) op->node = node_stack().back();
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

// The deferred on_op_end: enqueues the outputs that can hold new values
// and the inputs written without being returned.
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

// The deferred check of gradient `input` into the node `fn` runs.
// A gradient an op's output check has (the eager path knows those from the
// range memo) is not read again: the replay takes that check's census.
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

// Enqueues the event `c` behind the deferred checks, when there are any
// (findings they make must be recorded first); false when none are, and
// the caller handles it now.
bool defer_event(tracer_state& st, deferred_check c) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  if (st.pending.empty()) return false;
  st.pending.push_back(std::move(c));
  return true;
}

// A leaf received its gradient: every chain recorded so far is judged.
void judge_all(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.mutex);
  for (finding_record& r : st.records) r.judged = true;
  publish(st);
}

// Runs `c` as the eager path would have; `stats` are the record's census
// by position, nullptr when every tensor in it was finite.
void replay(tracer_state& st, const deferred_check& c, const std::vector<tensor_stats>* stats) {
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
      if (known && c.into_leaf) {
        std::lock_guard<std::mutex> lock(st.mutex);
        st.records[st.records[known->record].origin].reached = true;
      }
      return;
    }
    case deferred_check::kind::loss:
      reach_from_loss(st, c.sequence_nr);
      return;
    case deferred_check::kind::leaf:
      judge_all(st);
      return;
  }
}

// Reads the deferred path's record (a host sync per device it used; a
// census of each tensor only when one was not finite) and replays what it
// holds, in order; then lets the tensors go.
void settle(tracer_state& st) {
  std::lock_guard<std::mutex> lock(st.deferred_mutex);
  if (st.pending.empty()) return;
  callback_scope no_recursion;  // the censuses of a finding are not the program's ops
  std::vector<tensor_stats> stats;
  if (!st.pending_record.verdict().all_finite()) stats = st.pending_record.stats();
  for (const deferred_check& c : st.pending) replay(st, c, stats.empty() ? nullptr : &stats);
  st.pending.clear();
  st.pending_record.clear();
  st.pending_bytes = 0;
  st.checked_outputs.clear();
}

// Checks a record holds at most between reads, far under its 2^20.
constexpr int64_t kMaxDeferredChecks = int64_t(1) << 16;

// Reads the record once it holds tensor_options::deferred_bytes or too
// many checks; only between outermost ops, so that no op is halfway
// through its checks.
void settle_when_full(tracer_state& st) {
  if (!op_stack().empty()) return;
  {
    std::lock_guard<std::mutex> lock(st.deferred_mutex);
    if (st.pending_bytes < st.options.deferred_bytes() && st.pending_record.size() < kMaxDeferredChecks) return;
  }
  settle(st);
}

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
    const at::Tensor gradient = detail::real_values(inputs[i].toTensor());
    if (st.options.deferred() || !gradient.is_cpu()) {
      defer_node_input(st, fn, sender_of(ran, node.get()), gradient, i, into_leaf);
      continue;
    }
    std::optional<taint> known = taint_of(st, gradient);
    if (!known && !known_range(memo, gradient)) {
      const value_range range = scan_range(st, gradient, fn.name(), scanned::node_input);
      remember_write(memo, gradient, range);
      if (!range.finite()) {
        settle(st);  // what was deferred before it is recorded first
        on_nonfinite_node_input(st, site_of(fn), sender_of(ran, node.get()), gradient, nullptr, i);
      }
      known = taint_of(st, gradient);
    }
    if (known && into_leaf) {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.records[st.records[known->record].origin].reached = true;
    }
  }
  if (into_leaf && !defer_event(st, deferred_check(deferred_check::kind::leaf))) judge_all(st);
  ran.push_back({node, fn.name(), fn.seqNr()});
}

// Remembers a forward op by its sequence number, which the backward nodes
// it made carry. set_step() forgets them all; a trace that spans many steps
// without it keeps the newest kForwardOpsKept (the few thousand ops of a
// step, many times over), so that its memory stays bounded.
constexpr size_t kForwardOpsKept = size_t(1) << 18;

void forget_forward_ops(tracer_state& st) {
  st.forward_ops.clear();
  st.forward_order.clear();
  st.forward_next = 0;
}

void remember_forward_op(tracer_state& st, int64_t sequence_nr, forward_record op) {
  st.forward_ops.insert_or_assign(sequence_nr, std::move(op));
  std::vector<int64_t>& order = st.forward_order;  // a ring once full
  if (order.size() < kForwardOpsKept) return order.push_back(sequence_nr);
  int64_t& oldest = order[st.forward_next];
  st.forward_next = (st.forward_next + 1) % kForwardOpsKept;
  if (oldest != sequence_nr) st.forward_ops.erase(oldest);
  oldest = sequence_nr;
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  tracer_state* st = current_state();
  if (!st) return nullptr;
  const cost_meter meter(*st, st->nanoseconds);
  if (st->options.measure_cost()) st->ops.fetch_add(1, std::memory_order_relaxed);
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    {
      callback_scope no_recursion;
      check_node_inputs(*st, fn);
    }
    node_stack().push_back({fn.name(), fn.seqNr()});
    return std::make_unique<node_context>();  // tells the end callback to pop
  }
  // The engine's own frame around each node (a FUNCTION-scope record whose
  // name is built per call): the node's record keeps the stack above.
  if (is_engine_frame(fn.name())) return nullptr;
  // Work inside a kernel (see op_traits::kernel) is checked through the
  // kernel's outputs: half of the ops a training step records.
  if (!st->options.inside_kernels() && !op_stack().empty() && op_stack().back()->traits->kernel) {
    op_stack().back()->traits->runs_recorded_ops = true;  // sealed from its next call on
    return nullptr;
  }
  callback_scope no_recursion;
  const op_traits& traits = detail::traits_of(fn);
  if (traits.collective) {
    mark_arguments_written(fn);
    return nullptr;
  }
  // A view makes no values, and one no autograd node will name (nested in
  // another op, or run by the backward pass) needs no record either: the
  // cheapest exit, for the most frequent ops.
  if (traits.views_only && (fn.seqNr() < 0 || !node_stack().empty())) return nullptr;
  std::unique_ptr<op_context> ctx(new op_context);  // not make_unique: that zeroes it first
  ctx->op = fn.name();
  ctx->traits = &traits;
  const auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (traits.ignores_argument(i)) continue;
    collect_tensors(inputs[i], ctx->inputs);
    ctx->argument_of.resize(ctx->inputs.size(), int(i));
  }
  // A GPU's tensors are checked on the deferred path (see enqueue).
  ctx->deferred = st->options.deferred() || !on_cpu(ctx->inputs);
  record_written_inputs(*st, traits, inputs, *ctx);
  if (!ctx->deferred) bound_outputs(*st, traits, inputs, *ctx);
  if (traits.writes_unreturned) ctx->memo_writes = this_thread_memo().writes();
  const bool backward = !node_stack().empty();
  if (!backward) {
    std::lock_guard<std::mutex> lock(st->mutex);
    ctx->module = module_of(*st, ctx->inputs);
    if (fn.seqNr() >= 0) remember_forward_op(*st, fn.seqNr(), {fn.name(), ctx->module});
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
  op_stack().push_back(ctx.get());
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
    const at::Tensor out = detail::real_values(outputs[i].toTensor());
    if (!holds_new_values(traits.output(i), out, *ctx)) continue;
    maybe_range range;
    if (i < ctx->output_ranges.size() && ctx->output_ranges[i] && !outputs[i].toTensor().is_complex())
      range = detail::stored_range(*ctx->output_ranges[i], out.scalar_type(), *traits.rule);
    if (!range) range = scan_range(*st, out, ctx->op, scanned::output);
    remember_write(memo, out, *range);
    if (!range->finite()) {
      settle(*st);  // what was deferred before it is recorded first
      on_nonfinite_output(*st, site_of(fn), *ctx, out, nullptr, int(i));
    }
  }
  if (traits.writes_unreturned) check_unreturned_writes(*st, fn, *ctx, memo);
}

}  // namespace

tracer::tracer(tracer_options options) : state_(std::make_unique<state>()) {
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
  forget_forward_ops(*state_);
  state_->allowed.clear();
}

const std::vector<finding>& tracer::findings() const {
  settle(*state_);
  return state_->findings;
}

bool tracer::found() const { return !findings().empty(); }

void tracer::clear() {
  {
    std::lock_guard<std::mutex> lock(state_->deferred_mutex);
    state_->pending.clear();
    state_->pending_record.clear();
    state_->pending_bytes = 0;
    state_->checked_outputs.clear();
  }
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

void tracer::resume() {
  state_->slot.install(at::RecordFunctionCallback(on_op_start, on_op_end)
                           .needsInputs(true)
                           .needsOutputs(true)
                           .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

bool tracer::active() const { return state_->slot.installed(); }

const tracer_options& tracer::options() const { return state_->options; }

tracer_cost tracer::cost() const {
  state& st = *state_;
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
