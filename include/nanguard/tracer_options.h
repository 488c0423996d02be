// tracer_options.h — what a `tracer` (tracer.h) is told: its options and the
// non-finite values it allows; and what it reports of its own cost.
//
//   nanguard::tracer t(nanguard::tracer_options()
//                          .max_findings(3)
//                          .allow({nanguard::allow_rule().op("aten::masked_fill*")}));
//   // ... a step ...
//   for (const nanguard::tracer_op_scans& s : t.cost().scans_by_op) std::cout << s.op << ' ' << s.bytes << '\n';
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nanguard {

/// Non-finite values an op may produce on purpose (e.g. a -inf attention mask).
struct allow_rule {
  /// Glob on the op name ("aten::masked_fill*"); empty matches every op.
  TORCH_ARG(std::string, op);
  /// Glob on the module path ("*.self_attn"); empty matches every module.
  TORCH_ARG(std::string, module);
  TORCH_ARG(bool, nan) = false;      ///< NaN is allowed
  TORCH_ARG(bool, pos_inf) = false;  ///< +Inf is allowed
  TORCH_ARG(bool, neg_inf) = true;   ///< -Inf is allowed
};

/// Options of a `tracer`.
struct tracer_options {
  /// Stop checking after this many findings (1: stop at the first).
  TORCH_ARG(int64_t, max_findings) = 1;
  /// throw_if_found() throws nonfinite_error when there is a finding.
  TORCH_ARG(bool, throw_on_finding) = false;
  /// Observe every thread (true) or only the one that made the tracer.
  TORCH_ARG(bool, all_threads) = false;
  /// Record the C++ backtrace of each finding (slow; findings only).
  TORCH_ARG(bool, capture_backtrace) = false;
  /// Intentional non-finite values. The default allows -inf from masked_fill.
  TORCH_ARG(std::vector<allow_rule>, allow) = {allow_rule().op("aten::masked_fill*")};
  /// Also check the ops a kernel runs inside itself, to name the one that
  /// made a NaN or Inf (aten::sum inside aten::mean, aten::copy_ inside
  /// aten::_to_copy). Off, the kernel's outputs are checked and the kernel
  /// is named, for two thirds of the cost per op. Off in the guard's replay
  /// too, so that every front end names the op the user's code called.
  TORCH_ARG(bool, inside_kernels) = false;
  /// Record the call stack of every forward op that makes an autograd node
  /// (a microsecond or two each, cheap references to Python's code objects),
  /// so that a finding in its backward names the user's line that ran the
  /// forward op (finding::source); a forward finding's line is read when it
  /// is made, whatever this says. The guard's replay turns it on.
  TORCH_ARG(bool, record_sources) = false;
  /// Measure what the tracer costs (`tracer::cost()`): two clock reads per
  /// op, and a locked count per tensor it reads.
  TORCH_ARG(bool, measure_cost) = false;
  /// Keep each finding's op inputs as the op started (finding::input_values):
  /// what a repro bundle needs to run the op alone. Copies the inputs of every
  /// in-place op before it overwrites them; the guard's replay turns it on.
  TORCH_ARG(bool, keep_inputs) = false;
  /// Know an op's output finite from its inputs' ranges without reading it
  /// (range_rules.h: sound for correct arithmetic; most outputs go unread
  /// then). A faulty device breaks that soundness: the guard's replay, which
  /// must name the op whose output a bad unit corrupted, reads every output.
  TORCH_ARG(bool, range_rules) = true;
  /// Check CPU tensors on the deferred path too, as tensors on a GPU always
  /// are: an op's outputs are not read when it ends (a host sync per op on a
  /// GPU) but enqueued on a `nonfinite_record`, read once when findings are
  /// asked for (`found()`, `findings()`, `throw_if_found()`), at
  /// `set_step()`, or when `deferred_bytes` are held; the findings are the
  /// eager path's. For tests: on the CPU the eager path is faster.
  TORCH_ARG(bool, deferred) = false;
  /// The deferred path keeps each checked op's inputs and outputs alive until
  /// its record is read; it is read once the outputs held reach this many
  /// bytes (a host sync), between two outermost ops.
  TORCH_ARG(int64_t, deferred_bytes) = int64_t(1) << 30;
};

/// The tensors a tracer read for one op, measured with `measure_cost(true)`.
struct tracer_op_scans {
  /// `aten::add_`; `aten::add_ (old values)` for what an in-place op
  /// overwrites, `aten::mm (parameter)` for a parameter read at first use.
  std::string op;
  int64_t scans = 0;  ///< tensors read
  int64_t bytes = 0;  ///< bytes read
};

/// What a tracer has cost so far, measured with `measure_cost(true)`.
struct tracer_cost {
  int64_t ops = 0;            ///< recorded ops its callbacks ran for
  int64_t scans = 0;          ///< tensors it scanned (outputs, in-place inputs)
  int64_t scanned_bytes = 0;  ///< bytes those scans read
  double seconds = 0;         ///< time inside its callbacks
  double scan_seconds = 0;    ///< the part of `seconds` spent reading tensors
  /// The scans by op, most bytes first: the ops whose outputs no range
  /// rule bounded.
  std::vector<tracer_op_scans> scans_by_op;
};

}  // namespace nanguard
