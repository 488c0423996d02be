// range_memo.h — the ranges of the tensors a thread has seen finite since
// their last recorded write. The tracer's hot path reads and writes it for
// every op (tracer.cpp), so it is inline.
#pragma once

#include "detail/op_tensors.h"
#include "detail/value_range.h"
#include "range_rules.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace nanguard::detail {

/// Where a remembered range came from: the tensor's values (a scan), or an
/// op's range rule (a bound, which may be far wider than the values).
enum class range_origin { read, bounded };

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
// generation), except for the entries kept across steps (keep_across_steps):
// an optimizer's state, which only the optimizer's recorded ops write.
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
  /// True when the range of `t` is known from its values, read since its
  /// last write.
  bool read_since_write(const at::TensorBase& t) const {
    const entry* e = find_entry(t);
    return e && e->origin == range_origin::read;
  }
  /// Records `range`, read or bounded (`origin`), as what `t` holds since
  /// its latest write.
  void insert(const at::TensorBase& t, const value_range& range, range_origin origin) {
    if (!rememberable(t)) return;
    if (writes_ - swept_at_ >= kSweepEvery || swept_generation_ != generation.load(std::memory_order_relaxed)) sweep();
    const void* data = first_element(t);
    entry& e = slot_for(data);
    entry next{weak_impl::reclaim_copy(t.unsafeGetTensorImpl()),
               weak_storage::reclaim_copy(t.storage().unsafeGetStorageImpl()),
               data,
               t.numel(),
               t.scalar_type(),
               t.is_contiguous(),
               t._version(),
               generation.load(std::memory_order_relaxed),
               ++writes_,
               range,
               origin};
    carry_owner(e, next, t);
    e = std::move(next);
    list(size_t(&e - slots_.data()));
  }
  /// Forgets the range of `t` and of any tensor remembered over its elements.
  void erase(const at::TensorBase& t) {
    if (!rememberable(t)) return;
    const void* data = first_element(t);
    if (entry* e = way_with(&slots_[first_way(data)], data)) *e = entry();
  }
  /// Keeps what the memo knows of `t`, if anything, through forget_all()
  /// until a recorded write to `t` replaces it.
  void keep_across_steps(const at::TensorBase& t) {
    if (entry* e = const_cast<entry*>(find_entry(t))) e->generation = kLasting;
  }
  /// Forgets what every thread's memo knows, but for the entries kept across steps.
  static void forget_all() { generation.fetch_add(1, std::memory_order_relaxed); }
  /// Drops the entries that can no longer match: of a past generation, or
  /// over a storage that died (what they pin goes back to the allocator).
  void sweep() {
    const uint64_t now = generation.load(std::memory_order_relaxed);
    size_t kept = 0;
    for (const uint32_t slot : in_use_) {
      entry& e = slots_[slot];
      if (e.data && (!current(e, now) || e.storage.expired())) e = entry();
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
    range_origin origin = range_origin::bounded;
    // A tensor over the same elements, remembered before a write through
    // another one (grad.data().mul_(c) writes grad's values but bumps
    // only the version of grad.data()): its version then, which a write
    // through it would bump.
    weak_impl owner = weak_impl(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
    int64_t owner_version = 0;
  };
  const entry* find_entry(const at::TensorBase& t) const {
    if (!rememberable(t)) return nullptr;
    const void* data = first_element(t);
    const entry* found = way_with(&slots_[first_way(data)], data);
    if (!found) return nullptr;
    const entry& e = *found;
    if (!current(e, generation.load(std::memory_order_relaxed)) || e.dtype != t.scalar_type() ||
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
  // The generation of the entries kept across steps: no forget_all() reaches it.
  static constexpr uint64_t kLasting = UINT64_MAX;
  static bool kept(const entry& e) { return e.generation == kLasting; }
  static bool current(const entry& e, uint64_t now) { return e.generation == now || kept(e); }
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
    return !t.is_inference() && t.has_storage() && holds_values(t);
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
  // Where `t`'s first element lies (read-only: data_ptr() would copy a
  // copy-on-write tensor's values to give a writable pointer).
  static const void* first_element(const at::TensorBase& t) { return t.const_data_ptr(); }
  static size_t first_way(const void* data) {
    return ((reinterpret_cast<uintptr_t>(data) >> 4) * 0x9E3779B97F4A7C15ull >> 53) * kWays;
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
  // an empty or forgotten one, else the one not kept across steps (a step's
  // thousands of other writes would evict those first: they are older),
  // else the older.
  entry& slot_for(const void* data) {
    entry* set = &slots_[first_way(data)];
    if (entry* e = way_with(set, data)) return *e;
    const uint64_t now = generation.load(std::memory_order_relaxed);
    for (size_t way = 0; way < kWays; ++way)
      if (!current(set[way], now)) return set[way];
    if (kept(set[0]) != kept(set[1])) return kept(set[0]) ? set[1] : set[0];
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

// This thread's memo.
inline range_memo& this_thread_memo() {
  thread_local range_memo memo;
  return memo;
}

// The range of `t` when the memo knows it; a view is known through its
// base, whose version counter it shares (and whose range holds its values).
inline maybe_range known_range(const range_memo& memo, const at::Tensor& t) {
  const value_range* r = memo.find(t);
  if (!r && t.is_view() && t._base().defined()) r = memo.find(t._base());
  return r ? maybe_range(*r) : c10::nullopt;
}

// Records what an op wrote into `t`: its range when finite, else that its
// range is unknown. A kernel may write through an op nested in it without
// bumping the version counter (masked_fill runs masked_fill_ on a clone),
// so the entry itself must change; and a write into a view changes its base.
inline void remember_write(range_memo& memo, const at::Tensor& t, const value_range& r, range_origin origin) {
  const at::TensorBase base = t.is_view() ? t._base() : at::TensorBase();
  const value_range* before = base.defined() ? memo.find(base) : nullptr;
  const maybe_range base_range = before ? maybe_range(before->hull(r)) : c10::nullopt;
  if (r.finite()) memo.insert(t, r, origin);
  else memo.erase(t);
  if (!base.defined()) return;
  if (base_range && base_range->finite()) memo.insert(base, *base_range, range_origin::bounded);
  else memo.erase(base);
}

}  // namespace nanguard::detail
