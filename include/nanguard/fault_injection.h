// fault_injection.h — a planted fault, to test what finds and classifies
// faults: a NaN, an Inf, a flipped bit or a scaled value written into the
// output of one call of an ATen op, at a chosen step and rank, in the
// forward or the backward, once (transient: a particle strike) or every
// time from that step on (persistent: a faulty unit on that rank).
//
//   g.inject(nanguard::fault_spec().op("aten::addmm").step(5).kind(nanguard::fault_kind::bit_flip).bit(30));
//   // or, without a change to the program: NANGUARD_INJECT="op=aten::addmm,step=5,kind=bit_flip,bit=30"
//
// The fault is written where the op's output lives, below autograd (no
// version bump, as a hardware fault would), by a global RecordFunction end
// callback that runs before any observer's (the tracer sees the corrupted
// value, as it would a real one). While no fault is armed nothing is
// installed and nothing is paid.
#pragma once

#include <nanguard/finding.h>

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>

namespace nanguard {

/// What the fault writes into the output element.
enum class fault_kind {
  nan,       ///< NaN
  pos_inf,   ///< +Inf
  neg_inf,   ///< -Inf
  bit_flip,  ///< the element with bit `bit` flipped (float32: 31 sign, 23-30 exponent, 0-22 mantissa)
  scale,     ///< the element times `factor`
};
const char* to_string(fault_kind k);
fault_kind fault_kind_from_string(const std::string& name);

/// How often the fault fires.
enum class fault_mode {
  transient,   ///< once: the first matching call at `step` (a replay of the step runs clean)
  persistent,  ///< every matching call from `step` on, on that rank (a replay reproduces it)
};
const char* to_string(fault_mode m);
fault_mode fault_mode_from_string(const std::string& name);

/// Where and what to inject.
struct fault_spec {
  /// The ATen op whose output is corrupted, e.g. "aten::addmm" (any overload).
  TORCH_ARG(std::string, op);
  /// The guard's step (its number) at which it fires (persistent: from which).
  TORCH_ARG(int64_t, step) = 1;
  /// The rank it fires on (-1: every rank; one process is rank 0).
  TORCH_ARG(int64_t, rank) = -1;
  /// Forward: the op as the model's code calls it; backward: as the autograd
  /// engine runs it for a node.
  TORCH_ARG(nanguard::direction, direction) = direction::forward;
  /// Which call of `op` in that direction, counted from 0 in each run of
  /// the step (the step, and each replay of it).
  TORCH_ARG(int64_t, occurrence) = 0;
  TORCH_ARG(fault_kind, kind) = fault_kind::nan;
  /// bit_flip: the bit of the element, 0 (lowest) to its width - 1.
  TORCH_ARG(int64_t, bit) = 30;
  /// scale: what the element is multiplied by.
  TORCH_ARG(double, factor) = 1e6;
  /// The flat index of the element in the op's first floating-point output.
  TORCH_ARG(int64_t, element) = 0;
  TORCH_ARG(fault_mode, mode) = fault_mode::transient;
};

/// "op=aten::addmm,step=5,rank=1,direction=backward,occurrence=0,kind=bit_flip,bit=30,element=0,mode=persistent";
/// the keys are fault_spec's fields, any order, op required.
/// Throws c10::Error naming a field that is unknown, missing or malformed.
fault_spec fault_spec_from_string(const std::string& text);
/// The spec as fault_spec_from_string reads it.
std::string to_string(const fault_spec& s);

/// Arms `spec` while it lives (one at a time in a process). The guard
/// (guard::inject) owns one and tells it the step and the rank; alone, it
/// fires at any step once set_step() says which.
class fault_injector {
 public:
  /// Throws c10::Error when `spec`'s op is not an ATen operator, a value is
  /// out of range (step, occurrence, element, bit), or another is armed.
  explicit fault_injector(fault_spec spec, int64_t rank = 0);
  ~fault_injector();
  fault_injector(const fault_injector&) = delete;
  fault_injector& operator=(const fault_injector&) = delete;

  const fault_spec& spec() const;
  /// The step running now (its number): the guard calls it as a step begins.
  void set_step(int64_t step);
  /// Starts counting the op's calls again: a run of the step begins (the
  /// step itself, or a replay of it).
  void rewind();
  /// How many times it fired so far.
  int64_t fired() const;
  /// "nan written into output 0 [3, 1] of aten::addmm (forward, call 0) at step 5": what it did last ("" none).
  std::string last_fired() const;

  struct state;

 private:
  std::unique_ptr<state> state_;
};

}  // namespace nanguard
