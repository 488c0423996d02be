// observer_slot.h — where an observer (the tracer, the precision advisor, the
// precision emulator) is installed, and how its callbacks find it.
//
// An observer watches one thread (ATen's thread-local RecordFunction
// callbacks) or every thread (global callbacks): at most one of each kind per
// thread plus one for all threads. A thread-local callback can be removed
// only on its own thread, but users close observers wherever their code ends
// up (a Python `with` block left on another thread, a tracer handed to a
// worker). So a thread's slot is shared with the observer in it: closed on
// another thread, the observer empties the slot and leaves its callback there
// (it finds no observer and returns at once); the slot's thread removes that
// callback the next time it installs one of the same kind.
//
// A thread-local callback also runs on threads that work on behalf of its
// thread: ATen hands a thread's RecordFunction state (at::ThreadLocalState)
// to autograd's device threads, which run CUDA backward, and to at::launch
// tasks. Such a thread has no slot of its own; its ops go to the thread-local
// observer when there is exactly one (with several, no one can tell whose
// work it is, and the ops go unobserved, as before).
#pragma once

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace nanguard::detail {

/// True while this thread runs a callback of any nanguard observer: the ATen
/// ops a callback runs (a contiguous copy, a census) are not the model's, and
/// no observer, this one or another, may see them (they would recurse). A
/// plain flag, because at::RecordFunctionGuard rebuilds ATen's callback cache
/// each time (microseconds per op).
inline thread_local bool in_observer_callback = false;

/// How many pause_observers() (observer_pause.h) are open on this thread:
/// while any is, no observer sees its ops.
inline thread_local int observer_pauses = 0;

/// Marks the calling thread as inside an observer callback for its scope.
class callback_scope {
 public:
  callback_scope() : was_(in_observer_callback) { in_observer_callback = true; }
  ~callback_scope() { in_observer_callback = was_; }
  callback_scope(const callback_scope&) = delete;
  callback_scope& operator=(const callback_scope&) = delete;

 private:
  bool was_;
};

/// How an observer's RecordFunction callbacks (free functions: ATen takes
/// plain function pointers) reach its private state: the observer's class
/// (precision_advisor, precision_emulator) befriends this. The tracer keeps
/// its state in a type of its own (tracer/tracer_state.h) instead.
struct observer_access {
  // A member class, not a bare alias template: clang checks an alias
  // template's access outside the befriended class (a member class has the
  // access its enclosing class has).
  template <class Observer>
  struct state_of {
    using type = typename Observer::state;
  };
  template <class Observer>
  using state = typename state_of<Observer>::type;
};

template <class State>
class observer_slot {
 public:
  /// `name` prefixes errors: "nanguard::tracer".
  explicit observer_slot(const char* name) : name_(name) {}
  observer_slot(const observer_slot&) = delete;
  observer_slot& operator=(const observer_slot&) = delete;
  ~observer_slot() { release(); }

  /// Takes this thread's slot (or the all-threads one) for `observer`.
  void claim(State* observer, bool all_threads) {
    all_threads_ = all_threads;
    if (all_threads) {
      State* expected = nullptr;
      TORCH_CHECK(everywhere_.compare_exchange_strong(expected, observer), name_,
                  ": another all-threads one is already active; destroy it first");
    } else {
      if (!this_thread_) this_thread_ = std::make_shared<thread_binding>();
      remove_orphan(*this_thread_);
      TORCH_CHECK(this_thread_->observer.load() == nullptr, name_,
                  ": another one is already active on this thread; destroy it first (one per thread)");
      this_thread_->observer.store(observer, std::memory_order_release);
      binding_ = this_thread_;
      thread_ = std::this_thread::get_id();
      count_thread_local(observer, +1);
    }
    observer_ = observer;
  }

  /// Registers `start` and `end` with ATen for the ops (and, with
  /// `autograd_nodes`, the backward nodes) run, handed their inputs and
  /// outputs; nothing when they already are.
  void install(at::RecordFunctionCallback::StartCallback start, at::RecordFunctionCallback::EndCallback end,
               bool autograd_nodes) {
    if (handle_) return;
    check_on_own_thread("resume");
    at::RecordFunctionCallback callback(start, end);
    callback.needsInputs(true).needsOutputs(true);
    if (autograd_nodes) callback.scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION});
    else callback.scopes({at::RecordScope::FUNCTION});
    handle_ = all_threads_ ? at::addGlobalCallback(std::move(callback))
                           : at::addThreadLocalCallback(std::move(callback));
  }

  /// Removes the callback; nothing when it is not registered.
  void uninstall() {
    if (!handle_) return;
    check_on_own_thread("pause");
    at::removeCallback(*handle_);
    handle_.reset();
  }

  bool installed() const { return handle_.has_value(); }
  /// Its callback's handle. REQUIRES: installed().
  at::CallbackHandle handle() const {
    TORCH_INTERNAL_ASSERT(handle_, name_, ": no callback installed");
    return *handle_;
  }

  /// The observer watching the calling thread: its own, else the
  /// all-threads one; on a thread with no slot (an autograd device thread),
  /// the only thread-local one; none inside an observer's callback or
  /// while the thread's observers are paused.
  static State* current() {
    if (in_observer_callback || observer_pauses > 0) return nullptr;
    if (!this_thread_) {
      State* everywhere = everywhere_.load(std::memory_order_acquire);
      return everywhere ? everywhere : sole_thread_local_.load(std::memory_order_acquire);
    }
    State* s = this_thread_->observer.load(std::memory_order_acquire);
    return s ? s : everywhere_.load(std::memory_order_acquire);
  }

 private:
  struct thread_binding {
    std::atomic<State*> observer{nullptr};
    std::atomic<at::CallbackHandle> orphan{0};  // left by an observer closed elsewhere; 0 for none
  };

  // Counts the thread-local observers of this kind: `sole_thread_local_` is
  // the one there is, or null.
  static void count_thread_local(State* observer, int change) {
    const std::lock_guard<std::mutex> lock(thread_local_mutex_);
    thread_local_count_ += change;
    if (change > 0) last_thread_local_ = observer;
    // Of two, the survivor is not known here: device threads go unobserved
    // until the next claim (two tracers on two threads at once is rare).
    else if (last_thread_local_ == observer) last_thread_local_ = nullptr;
    sole_thread_local_.store(thread_local_count_ == 1 ? last_thread_local_ : nullptr, std::memory_order_release);
  }

  static void remove_orphan(thread_binding& b) {
    if (const at::CallbackHandle h = b.orphan.exchange(0)) at::removeCallback(h);
  }

  bool on_own_thread() const { return all_threads_ || std::this_thread::get_id() == thread_; }

  void check_on_own_thread(const char* what) const {
    TORCH_CHECK(on_own_thread(), name_, ": ", what,
                " it on the thread that made it (it watches that thread's ops only)");
  }

  void release() {
    if (!observer_) return;
    if (all_threads_) {
      uninstall();
      everywhere_.store(nullptr, std::memory_order_release);
    } else {
      count_thread_local(observer_, -1);
      binding_->observer.store(nullptr, std::memory_order_release);
      if (handle_ && !on_own_thread()) binding_->orphan.store(*std::exchange(handle_, std::nullopt));
      uninstall();
    }
    observer_ = nullptr;
  }

  static inline thread_local std::shared_ptr<thread_binding> this_thread_;
  static inline std::atomic<State*> everywhere_{nullptr};
  static inline std::mutex thread_local_mutex_;
  static inline int thread_local_count_ = 0;
  static inline State* last_thread_local_ = nullptr;
  static inline std::atomic<State*> sole_thread_local_{nullptr};

  const char* name_;
  State* observer_ = nullptr;
  bool all_threads_ = false;
  std::shared_ptr<thread_binding> binding_;  // this observer's thread's (kept when that thread ends)
  std::thread::id thread_;
  std::optional<at::CallbackHandle> handle_;
};

}  // namespace nanguard::detail
