// cuda_record.h — the part of a nonfinite_record on one CUDA device, and
// how census() and has_nonfinite() read one CUDA tensor (census.cpp).
//
// Holds the device memory the census kernel (census_cuda.cu) writes: one
// verdict for the device and, with statistics, one slot per tensor. Built
// only with the CUDA kernels (NANGUARD_WITH_CUDA).
#pragma once

#include <nanguard/tensor_stats.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace nanguard::detail {

/// The verdict of one device's part: counts and the first bad element.
struct cuda_verdict {
  int64_t nan = 0, pos_inf = 0, neg_inf = 0;
  int64_t first_ordinal = -1;  ///< record position of the first tensor with a NaN/Inf; -1 if none
  int64_t first_index = -1;    ///< its element
  double first_value = 0;      ///< NaN, +Inf or -Inf
};

/// Census kernels enqueued on one CUDA device, read once.
class cuda_record {
 public:
  /// A part on `device` (a CUDA device), gathering statistics when `stats`.
  cuda_record(c10::Device device, bool stats);

  /// Enqueues `xs` (floating, on this device) on the device's current
  /// stream; `ordinals` are their positions in the record.
  void add(at::TensorList xs, c10::ArrayRef<int64_t> ordinals);
  /// Waits for the streams used, then reads the verdict.
  cuda_verdict verdict();
  /// Waits for the streams used, then reads the census of each tensor added, in order.
  std::vector<tensor_stats> stats();
  /// Forgets the tensors added (zeroes the verdict on the device's stream).
  void clear();

 private:
  void wait();

  c10::Device device_;
  bool gather_stats_;
  at::Tensor verdict_;                   // the bytes of a device_verdict
  std::vector<at::Tensor> stats_blocks_;  // device_tensor_stats, a block per add
  std::vector<int64_t> numel_;            // of each tensor added
  std::vector<c10::Stream> streams_;      // enqueued on since the last wait
};

}  // namespace nanguard::detail
