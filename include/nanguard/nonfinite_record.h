// nonfinite_record.h — checks of many tensors, enqueued on their devices, read once.
//
// `has_nonfinite` and `census` answer at once: on a GPU each answer is a
// host sync. A `nonfinite_record` takes tensors as they come (parameters'
// gradients, op outputs), enqueues their check on the tensor's device, and
// is read once, when a verdict is needed. On CUDA (built with the CUDA
// kernels: cmake/cuda.cmake) the tensors of one `add` are checked many per
// kernel launch, in one pass with no temporary, into device memory; the
// first read waits for the streams used. On the CPU each tensor is checked
// when added (the CPU census is already one pass).
//
//   nanguard::nonfinite_record record;
//   for (const auto& p : model->parameters()) record.add(p.grad());   // no sync
//   const nanguard::record_verdict v = record.verdict();              // one sync
//   if (!v.all_finite())
//     std::cerr << "parameter " << v.first_tensor << " [" << v.first_index << "] = " << v.first_value;
#pragma once

#include <nanguard/census.h>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace nanguard {

/// Options of a `nonfinite_record`.
struct record_options {
  /// Also gather each tensor's full `tensor_stats` (min, max, zeros, finite
  /// count, sum of squares for norms, ...) in the same pass: `stats()`.
  TORCH_ARG(bool, stats) = false;
};

/// What a record found over all its tensors.
struct record_verdict {
  int64_t tensors = 0;  ///< tensors added
  int64_t nan = 0;      ///< NaN elements, all tensors together
  int64_t pos_inf = 0;  ///< +Inf elements
  int64_t neg_inf = 0;  ///< -Inf elements
  /// Position (in the order added, from 0) of the first tensor holding a NaN or Inf; -1 if none.
  int64_t first_tensor = -1;
  /// Flat (row-major, logical) index of the first non-finite element of that tensor; -1 if none.
  int64_t first_index = -1;
  /// Its value: NaN, +Inf or -Inf; 0 if none.
  double first_value = 0;

  /// NaN and infinite elements.
  int64_t nonfinite() const { return nan + pos_inf + neg_inf; }
  /// True when every element of every tensor is finite.
  bool all_finite() const { return nonfinite() == 0; }
};

/// Non-finite checks (and, optionally, censuses) of many tensors on any
/// devices, enqueued without host syncs and read once.
///
/// REQUIRES: tensors are float32, float64, float16 or bfloat16 (as `census`);
/// a CUDA tensor stays alive, or is freed only to its own stream, until the
/// record is read (the caching allocator's usual rule).
/// NOTE: not thread-safe: one thread adds and reads. At most 2^20 tensors
/// between `clear()`s, each under 2^42 elements.
class nonfinite_record {
 public:
  /// An empty record.
  explicit nonfinite_record(record_options options = {});
  ~nonfinite_record();
  nonfinite_record(nonfinite_record&&) noexcept;
  nonfinite_record& operator=(nonfinite_record&&) noexcept;

  /// Enqueues the check of `x` on its device's current stream; returns its position.
  int64_t add(const at::Tensor& x);
  /// Enqueues `xs` in order (on CUDA, up to 64 per kernel launch); returns
  /// the position of the first.
  int64_t add(at::TensorList xs);
  /// Tensors added since construction or `clear()`.
  int64_t size() const;

  /// Waits for the checks and reads the verdict: one copy per device.
  record_verdict verdict();
  /// The census of each tensor added, in order (one copy per device).
  /// REQUIRES: the record was made with `record_options().stats(true)`.
  std::vector<tensor_stats> stats();
  /// Forgets every tensor added; the device memory is reused.
  void clear();

 private:
  struct state;
  std::unique_ptr<state> state_;
};

/// The census of every tensor of `xs`, in one pass per tensor and, on CUDA,
/// many tensors per launch with one host sync for all.
///
///   auto s = nanguard::census_many(grads);  // s[i].l2_norm: per-parameter norms
std::vector<tensor_stats> census_many(at::TensorList xs);

/// Whether any tensor of `xs` holds a NaN or Inf, and the first one that
/// does, with one host sync for all on CUDA.
///
///   if (auto v = nanguard::check_many(grads); !v.all_finite()) skip_step(v.first_tensor);
record_verdict check_many(at::TensorList xs);

}  // namespace nanguard
