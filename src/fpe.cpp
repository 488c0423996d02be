// The floating-point exception trap: unmasked FE_* exceptions, a SIGFPE
// handler that reports with async-signal-safe calls only (write, backtrace
// into a preallocated array, backtrace_symbols_fd, sigaction), and guard_op's
// census checks.
#include "nanguard/fpe.h"

#include "nanguard/census.h"
#include "nanguard/scope.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <fenv.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

namespace nanguard {

namespace {

constexpr size_t kScopeBytes = 256;
constexpr int kMaxFrames = 64;

// Everything the handler touches is plain thread-local data, written outside
// the handler: no std::string, no allocation inside it.
thread_local char noted_scope[kScopeBytes];
thread_local sigjmp_buf* innermost_jump_target = nullptr;  // of fpe_trap::run
thread_local int armed_depth = 0;
thread_local bool print_on_jump = false;
thread_local void* fault_frames[kMaxFrames];
thread_local int fault_frame_count = 0;
thread_local int fault_code = 0;
thread_local uintptr_t fault_address = 0;

std::mutex install_mutex;
int installed_traps = 0;  // traps alive in the process (all threads)
struct sigaction previous_action;

void put(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return;
    }
    s += w;
    n -= size_t(w);
  }
}

void put_hex(uintptr_t v) {
  char buf[2 + 2 * sizeof(uintptr_t) + 1];
  char* p = buf + sizeof(buf) - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v & 0xf];
    v >>= 4;
  } while (v != 0);
  *--p = 'x';
  *--p = '0';
  put(p);
}

const char* describe(int code) {
  switch (code) {
    case FPE_INTDIV: return "integer divide by zero";
    case FPE_INTOVF: return "integer overflow";
    case FPE_FLTDIV: return "floating-point divide by zero (FE_DIVBYZERO)";
    case FPE_FLTOVF: return "floating-point overflow (FE_OVERFLOW)";
    case FPE_FLTUND: return "floating-point underflow (FE_UNDERFLOW)";
    case FPE_FLTRES: return "inexact floating-point result (FE_INEXACT)";
    case FPE_FLTINV: return "invalid floating-point operation (FE_INVALID: 0/0, inf - inf, sqrt of a negative)";
    case FPE_FLTSUB: return "subscript out of range";
    default: return "floating-point exception";
  }
}

void report(bool fatal) {
  put("nanguard: SIGFPE: ");
  put(describe(fault_code));
  put(" at ");
  put_hex(fault_address);
  put("\nnanguard:   in ");
  if (noted_scope[0]) {
    put("scope '");
    put(noted_scope);
    put("'\n");
  } else {
    put("no nanguard scope (NANGUARD_SCOPE + fpe_trap::note_scope() name one)\n");
  }
  put("nanguard:   backtrace (innermost first):\n");
  backtrace_symbols_fd(fault_frames, fault_frame_count, STDERR_FILENO);
  if (fatal)
    put("nanguard: stopping the process (nanguard::fpe_trap); run the code in nanguard::fpe_trap::run(fn) "
        "to get a nanguard::fpe_error instead\n");
}

void on_sigfpe(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  if (armed_depth == 0) {  // not ours: hand it to whoever handled SIGFPE before
    if ((previous_action.sa_flags & SA_SIGINFO) && previous_action.sa_sigaction) {
      previous_action.sa_sigaction(sig, info, context);
      errno = saved_errno;
      return;
    }
    if (previous_action.sa_handler != SIG_DFL && previous_action.sa_handler != SIG_IGN) {
      previous_action.sa_handler(sig);
      errno = saved_errno;
      return;
    }
  }
  fault_code = info->si_code;
  fault_address = reinterpret_cast<uintptr_t>(info->si_addr);
  fault_frame_count = backtrace(fault_frames, kMaxFrames);  // preloaded when armed: no allocation
  if (innermost_jump_target) {
    if (print_on_jump) report(false);
    siglongjmp(*innermost_jump_target, 1);
  }
  report(true);
  // Die of SIGFPE: with the default action back, the faulting instruction
  // runs again on return and kills the process (a raised signal needs raise).
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGFPE, &dfl, nullptr);
  if (info->si_code <= 0) raise(SIGFPE);
  errno = saved_errno;
}

void install_handler() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed_traps++ > 0) return;
  void* warm[2];
  backtrace(warm, 2);  // loads libgcc's unwinder now, not inside the handler
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigfpe;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGFPE, &sa, &previous_action);
}

void uninstall_handler() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (--installed_traps > 0) return;
  sigaction(SIGFPE, &previous_action, nullptr);
}

void copy_scope(const std::string& s) {
  const size_t n = std::min(s.size(), kScopeBytes - 1);
  std::memcpy(noted_scope, s.data(), n);
  noted_scope[n] = '\0';
}

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

std::string message_of(const fpe_fault& f) {
  std::string s = fmt::format("nanguard: SIGFPE: {} at {:#x}", f.what, f.address);
  if (!f.symbol.empty()) s += " in " + f.symbol;
  s += f.scope.empty() ? std::string(" (no nanguard scope noted)") : fmt::format(", scope '{}'", f.scope);
  if (!f.backtrace.empty()) {
    s += "\nbacktrace (innermost first):";
    for (const auto& frame : f.backtrace) s += "\n  " + frame;
  }
  return s;
}

}  // namespace

fpe_error::fpe_error(fpe_fault fault)
    : c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message_of(fault)), fault_(std::move(fault)) {}

sigjmp_buf*& fpe_trap::jump_target() { return innermost_jump_target; }

fpe_fault fpe_trap::take_fault() {
  fpe_fault f;
  f.code = fault_code;
  f.what = describe(fault_code);
  f.address = fault_address;
  f.scope = noted_scope;
  Dl_info info;
  if (fault_address && dladdr(reinterpret_cast<void*>(fault_address), &info) && info.dli_sname)
    f.symbol = fmt::format("{}+{:#x}", demangle(info.dli_sname),
                           fault_address - reinterpret_cast<uintptr_t>(info.dli_saddr));
  if (char** names = backtrace_symbols(fault_frames, fault_frame_count)) {
    for (int i = 0; i < fault_frame_count; ++i) f.backtrace.emplace_back(names[i]);
    std::free(names);
  }
  return f;
}

fpe_trap::fpe_trap(fpe_options options) : print_(options.print()), previous_print_(print_on_jump) {
  const int wanted = (options.invalid() ? FE_INVALID : 0) | (options.divbyzero() ? FE_DIVBYZERO : 0) |
                     (options.overflow() ? FE_OVERFLOW : 0);
  TORCH_CHECK(fegetenv(&previous_env_) == 0, "nanguard::fpe_trap: fegetenv failed on this platform");
  install_handler();
  ++armed_depth;
  print_on_jump = print_;
  note_scope();
  // A flag left set by earlier code must not fire the moment it is unmasked.
  feclearexcept(FE_ALL_EXCEPT);
  if (wanted != 0 && feenableexcept(wanted) == -1) {
    --armed_depth;
    print_on_jump = previous_print_;
    uninstall_handler();
    fesetenv(&previous_env_);
    TORCH_CHECK(false, "nanguard::fpe_trap: feenableexcept(", wanted,
                ") failed: this platform cannot trap floating-point exceptions");
  }
}

fpe_trap::~fpe_trap() {
  // Masks, flags and the rest of the environment (rounding, FTZ/DAZ) as
  // they were when the trap was armed.
  fesetenv(&previous_env_);
  --armed_depth;
  print_on_jump = previous_print_;
  uninstall_handler();
  if (armed_depth == 0) noted_scope[0] = '\0';
}

void fpe_trap::rearm_after_fault() {
  // The kernel runs a signal handler with a fresh FP environment and
  // siglongjmp does not restore the interrupted one: go back to the one from
  // before the trap (the destructor does it again as the error unwinds).
  fesetenv(&previous_env_);
  feclearexcept(FE_ALL_EXCEPT);
}

void fpe_trap::note_scope() { copy_scope(current_scope()); }

void fpe_trap::note_scope(const std::string& where) {
  const std::string& open = current_scope();
  copy_scope(open.empty() ? where : where + " in " + open);
}

// ============================================================== guard_op

namespace {

tensor_record record_of(const at::Tensor& t, std::string name) {
  return {std::move(name), c10::toString(t.scalar_type()), t.sizes().vec(), census(t)};
}

bool checked(const at::Tensor& t) { return t.defined() && t.is_floating_point(); }

finding base_finding(const std::string& op, const std::vector<at::Tensor>& inputs) {
  finding f;
  f.op = op;
  f.module = current_scope();
  for (size_t i = 0; i < inputs.size(); ++i)
    if (checked(inputs[i])) f.inputs.push_back(record_of(inputs[i], "input " + std::to_string(i)));
  return f;
}

}  // namespace

void check_op_inputs(const std::string& op, const std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!checked(inputs[i]) || !has_nonfinite(inputs[i])) continue;
    finding f = base_finding(op, inputs);
    f.role = role::input;
    f.culprit = "input " + std::to_string(i);
    const tensor_stats s = census(inputs[i]);
    f.index = s.first_nonfinite_index;  // of the culprit input: the op has not run
    f.value = s.first_nonfinite_value;
    throw nonfinite_error(std::move(f));
  }
}

void check_op_outputs(const std::string& op, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& outputs) {
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (!checked(outputs[k]) || !has_nonfinite(outputs[k])) continue;
    finding f = base_finding(op, inputs);
    f.role = role::producer;  // the inputs were checked finite before the op ran
    for (size_t j = 0; j < outputs.size(); ++j)
      if (checked(outputs[j])) f.outputs.push_back(record_of(outputs[j], "output " + std::to_string(j)));
    const tensor_stats s = census(outputs[k]);
    f.output = int(k);
    f.index = s.first_nonfinite_index;
    f.value = s.first_nonfinite_value;
    throw nonfinite_error(std::move(f));
  }
}

}  // namespace nanguard
