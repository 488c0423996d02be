// op_patch.h — one op of the model rewritten while a patch is in scope: how
// a remedy (remedy_check.h) is applied inside a replay of the failing step,
// and, with auto_fix, for the rest of the run. The model's code is not
// touched: the rewrite sits in the dispatcher, in front of autograd, so
// autograd records the remedy's ops (a clamp, a masked_fill, a cast) and the
// backward follows the rewritten forward.
//
//   op_patch patch(op_rewrite::denominator_eps("aten::div", 1e-5));
//   {
//     op_patch::scope on;            // this thread, and the backward it runs
//     loss = fn(batch); loss.backward();
//   }
//   if (patch.calls_rewritten() == 0) { /* the step never ran aten::div on a zero */ }
//
// NOTE: the rewrite runs as a fallback on the DeferredInit dispatch key, the
// key PyTorch keeps for an out-of-tree library (torchdistX's deferred init,
// which cannot run beside a patch). It is registered the first time a patch
// is made; while no scope is open, no op reaches it and nothing is paid.
// Eager ops only: a compiled graph's fused kernels are not dispatched per op
// (a replay runs a compiled model eagerly; see training_host).
#pragma once

#include "nanguard/remedy_check.h"

#include <c10/core/ScalarType.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace c10::impl {
class IncludeDispatchKeyGuard;
}  // namespace c10::impl

namespace nanguard::detail {

/// How an op is rewritten: the remedy, the op it targets and its constants.
struct op_rewrite {
  remedy_kind kind = remedy_kind::none;
  std::string op;  ///< the targeted ATen op, e.g. "aten::div" (any overload)
  double low = 0;   ///< clamp_input: the lowest value the input keeps (-inf: none)
  double high = 0;  ///< clamp_input: the highest (+inf: none)
  double eps = 0;   ///< denominator_eps: what replaces an exact zero
  /// float32: the low-precision dtype the op ran in (float16 or bfloat16).
  at::ScalarType dtype = at::kHalf;

  /// Runs `op` with its first input clamped to [low, high].
  static op_rewrite clamp_input(std::string op, double low, double high);
  /// Runs `op` (a division or a reciprocal) with `eps` in place of its denominator's zeros.
  static op_rewrite denominator_eps(std::string op, double eps);
  /// Runs `op` (a softmax) with 0 for a row that has no finite entry.
  static op_rewrite safe_softmax(std::string op);
  /// Runs `op` in float32 (autocast off, its `dtype` inputs cast up), and
  /// every op that then mixes float32 with `dtype` in float32.
  static op_rewrite float32(std::string op, at::ScalarType dtype);

  /// What the rewrite does, for a check and a warning:
  /// "eps 1e-05 on the zero denominators of aten::div".
  std::string description() const;
};

/// While it lives, the op of `rewrite` is rewritten wherever a scope is open.
/// One patch at a time: making a second throws c10::Error.
class op_patch {
 public:
  /// `count_changes`: whether calls_rewritten() counts only the calls the
  /// rewrite changed, which reads each input's values on the host (a sync
  /// per call on a GPU: for a replay, not for a patch kept over a run).
  explicit op_patch(op_rewrite rewrite, bool count_changes = true);
  ~op_patch();
  op_patch(const op_patch&) = delete;
  op_patch& operator=(const op_patch&) = delete;

  /// The rewrite.
  const op_rewrite& rewrite() const { return rewrite_; }
  /// How many calls the rewrite changed so far (a clamp of a tensor already
  /// in range, or a division without a zero, changes nothing and is not counted).
  int64_t calls_rewritten() const { return rewritten_.load(); }

  /// Opens the patch on this thread (and in the autograd work it starts)
  /// while it lives. Nests.
  class scope {
   public:
    scope();
    ~scope();
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    std::unique_ptr<c10::impl::IncludeDispatchKeyGuard> include_;
  };

  /// Counts one rewritten call (the dispatcher fallback's).
  void count_rewrite() { ++rewritten_; }
  /// Whether the rewrite looks at the values first (see the constructor).
  bool counts_changes() const { return count_changes_; }

 private:
  op_rewrite rewrite_;
  bool count_changes_;
  std::atomic<int64_t> rewritten_{0};
};

}  // namespace nanguard::detail
