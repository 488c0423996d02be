// fpe.h — stop at the instruction that makes a NaN or Inf in custom C++ code.
//
// `fpe_trap` unmasks the FE_INVALID (0/0, inf-inf, sqrt(-1)), FE_DIVBYZERO
// and FE_OVERFLOW exceptions on the calling thread: the faulting instruction
// raises SIGFPE instead of quietly writing NaN/Inf. nanguard's handler prints
// what happened, the instruction's address, the backtrace and the active
// nanguard scope (and guard_op name), then lets the process die:
//
//   {
//     nanguard::fpe_trap trap;          // this thread only; restored at scope exit
//     NANGUARD_SCOPE("data.normalise");
//     nanguard::fpe_trap::note_scope(); // copy the scope for the handler
//     normalise(rows);                  // 1.0 / 0.0 in here: SIGFPE, report, exit
//   }
//   // nanguard: SIGFPE: floating-point divide by zero (FE_DIVBYZERO) at 0x55d0c1a2b3c4
//   // nanguard:   in scope 'data.normalise'
//   // nanguard:   backtrace: ...
//
// or turns the fault into an exception:
//
//   try {
//     nanguard::fpe_trap::run([&] { normalise(rows); });
//   } catch (const nanguard::fpe_error& e) {
//     std::cerr << e.what();           // what, where (address, symbol), scope, backtrace
//   }
//
// `guard_op(name, fn, args...)` checks a custom op's tensor arguments and
// results with the census and throws nonfinite_error naming the op.
//
// NOTE: the traps are per thread: work ATen hands to its OpenMP/intra-op
// threads is not trapped. ATen kernels run on the calling thread are, and
// some compute NaN/Inf on purpose (masked lanes, log(0) = -inf): trap your own
// code, not whole training steps. x86-64 and glibc (feenableexcept) only.
// NOTE (fpe_trap::run): the fault is turned into an exception with
// siglongjmp out of the signal handler. Destructors of the objects inside
// `fn` between the fault and `run` do not run (memory is leaked, a mutex
// locked there stays locked), and the state `fn` was changing is left half
// done: use it to report and stop cleanly, not to carry on computing.
#pragma once

#include <nanguard/finding.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <cfenv>
#include <csetjmp>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace nanguard {

/// Which floating-point exceptions an `fpe_trap` turns into SIGFPE.
struct fpe_options {
  TORCH_ARG(bool, invalid) = true;      ///< FE_INVALID: 0/0, inf - inf, sqrt(-1) → NaN
  TORCH_ARG(bool, divbyzero) = true;    ///< FE_DIVBYZERO: x / 0 → ±Inf
  TORCH_ARG(bool, overflow) = true;     ///< FE_OVERFLOW: a finite result too large → ±Inf
  /// Print the report to stderr when the fault is turned into an fpe_error too
  /// (the fatal path always prints).
  TORCH_ARG(bool, print) = false;
};

/// What the SIGFPE handler saw.
struct fpe_fault {
  int code = 0;                 ///< siginfo si_code (FPE_FLTDIV, FPE_FLTINV, FPE_FLTOVF, FPE_INTDIV, ...)
  std::string what;             ///< e.g. "floating-point divide by zero (FE_DIVBYZERO)"
  uintptr_t address = 0;        ///< the faulting instruction (si_addr)
  std::string symbol;           ///< the function holding it, when dladdr knows it
  std::string scope;            ///< nanguard scope (and op) noted when the trap was armed
  std::vector<std::string> backtrace;  ///< frames, innermost first
};

/// Thrown by `fpe_trap::run` when the code it ran raised a trapped exception.
/// A c10::Error, as every error nanguard throws (what_without_backtrace()
/// is the report without LibTorch's backtrace of the throw; Python sees a
/// ValueError).
class fpe_error : public c10::Error {
 public:
  /// Makes the error from the handler's record.
  explicit fpe_error(fpe_fault fault);
  /// What the handler saw.
  const fpe_fault& fault() const { return fault_; }

 private:
  fpe_fault fault_;
};

/// Unmasks floating-point exceptions on this thread while it lives and
/// installs nanguard's SIGFPE handler (process-wide, restored when the last
/// trap goes). The previous exception mask of the thread is restored on
/// destruction and pending exception flags are cleared.
///
///   { nanguard::fpe_trap trap; my_kernel(x); }   // a 0/0 in my_kernel stops the process, with a report
class fpe_trap {
 public:
  /// Arms the trap and notes the current nanguard scope for the handler.
  /// Throws c10::Error where feenableexcept is not available.
  explicit fpe_trap(fpe_options options = {});
  ~fpe_trap();
  fpe_trap(const fpe_trap&) = delete;
  fpe_trap& operator=(const fpe_trap&) = delete;

  /// Copies `current_scope()` into this thread's fixed buffer that the
  /// signal handler prints (it cannot read a std::string safely).
  static void note_scope();
  /// Notes an explicit location (e.g. an op name) for the handler.
  static void note_scope(const std::string& where);

  /// Runs `fn` with a trap armed; a trapped exception becomes an `fpe_error`
  /// (see the NOTE at the top of fpe.h for what is skipped).
  ///
  ///   double r = nanguard::fpe_trap::run([&] { return ratio(numerator, denominator); });
  template <typename F>
  static auto run(F&& fn, fpe_options options = {}) -> decltype(fn()) {
    sigjmp_buf here;
    sigjmp_buf* const outer = jump_target();
    fpe_trap trap(options);
    if (sigsetjmp(here, /*savemask=*/1) != 0) {
      jump_target() = outer;
      trap.rearm_after_fault();
      throw fpe_error(take_fault());
    }
    jump_target() = &here;
    struct restore {
      sigjmp_buf* outer;
      ~restore() { jump_target() = outer; }
    } restore_target{outer};
    return fn();
  }

 private:
  /// The jump target of the innermost run() on this thread.
  static sigjmp_buf*& jump_target();
  /// The fault the handler recorded on this thread before jumping.
  static fpe_fault take_fault();
  void rearm_after_fault();
  fenv_t previous_env_;  // the thread's floating-point environment before the trap
  bool print_;
  bool previous_print_;
};

/// Throws nonfinite_error (role input) naming op `op`, the module (current
/// scope) and the first argument in `inputs` that holds a NaN or Inf, with
/// its element index and value; returns when every one is finite. guard_op's
/// check before the op runs.
void check_op_inputs(const std::string& op, const std::vector<at::Tensor>& inputs);
/// Throws nonfinite_error (role producer) naming op `op` and the first of its
/// `outputs` that holds a NaN or Inf; returns when every one is finite.
/// guard_op's check after the op ran on `inputs` (already checked finite).
void check_op_outputs(const std::string& op, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& outputs);

/// Appends the tensors that `value` holds to `out`: a tensor, a vector of
/// them, or a pair or tuple of those; any other type holds none.
template <typename T>
void append_tensors(std::vector<at::Tensor>&, const T&) {}
inline void append_tensors(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
inline void append_tensors(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& ts) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename A, typename B>
void append_tensors(std::vector<at::Tensor>& out, const std::pair<A, B>& p);
template <typename... T>
void append_tensors(std::vector<at::Tensor>& out, const std::tuple<T...>& t) {
  std::apply([&](const auto&... e) { (append_tensors(out, e), ...); }, t);
}
template <typename A, typename B>
void append_tensors(std::vector<at::Tensor>& out, const std::pair<A, B>& p) {
  append_tensors(out, p.first);
  append_tensors(out, p.second);
}

/// Runs a custom op `fn(args...)` and checks its tensor arguments before and
/// its tensor results after with the census; throws nonfinite_error whose
/// finding names the op (`finding.op == name`), the module (current scope),
/// the role (input: an argument was already bad; producer: the op made it),
/// the element index and value. Results may be a tensor, a vector, a tuple
/// or a pair of them; other types pass unchecked. While `fn` runs, `name`
/// is also what an fpe_trap's report names.
///
///   at::Tensor y = nanguard::guard_op("my_ops::safe_log", [](const at::Tensor& x) {
///     return my_log_kernel(x);
///   }, x);
template <typename F, typename... Args>
auto guard_op(const std::string& name, F&& fn, Args&&... args) -> decltype(fn(std::forward<Args>(args)...)) {
  std::vector<at::Tensor> inputs;
  (append_tensors(inputs, args), ...);
  check_op_inputs(name, inputs);
  fpe_trap::note_scope(name);
  struct renote {
    ~renote() { fpe_trap::note_scope(); }
  } renote_scope;
  auto result = fn(std::forward<Args>(args)...);
  std::vector<at::Tensor> outputs;
  append_tensors(outputs, result);
  check_op_outputs(name, inputs, outputs);
  return result;
}

}  // namespace nanguard
