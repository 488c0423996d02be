// census_cuda.h — the CUDA census kernel's interface, shared by nvcc and g++.
//
// Free of LibTorch and of CUDA's headers: raw pointers, sizes and a stream.
// One launch checks up to `census_launch::capacity` tensors; each 32 KiB
// chunk of a tensor is one thread block. Results go to device memory only:
// a `device_verdict` for the whole record (the first non-finite element in
// the order tensors were added) and, where statistics are asked for, one
// `device_tensor_stats` per tensor. Everything is accumulated with atomics
// into zeroed memory, so launches into one record can follow each other on a
// stream with no host sync; the host reads the record once.
#pragma once

#include <cstdint>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace nanguard::detail::cuda {

/// Element types the kernel reads.
enum class element_type : uint8_t { f32, f64, f16, bf16 };

/// Bytes of a tensor one thread block reads: 256 threads x 8 loads x 16 B.
constexpr int64_t kChunkBytes = 32 * 1024;

/// Thread blocks (chunks) for `numel` elements of `element_bytes` each.
constexpr int64_t chunks_of(int64_t numel, int64_t element_bytes) {
  return (numel * element_bytes + kChunkBytes - 1) / kChunkBytes;
}

/// Where a non-finite element lies, packed so that the smaller key is the
/// earlier element: tensor ordinal (20 bits), flat index (42), class (2:
/// NaN, +Inf, -Inf). Stored bitwise inverted and merged with atomicMax, so
/// that zeroed memory means "none".
constexpr int kOrdinalBits = 20;
constexpr int kIndexBits = 42;
constexpr int64_t kMaxOrdinals = int64_t(1) << kOrdinalBits;
constexpr int64_t kMaxElements = int64_t(1) << kIndexBits;
enum nonfinite_class : uint64_t { is_nan = 0, is_pos_inf = 1, is_neg_inf = 2 };

/// What the record knows about all tensors: counts and the first bad element.
struct device_verdict {
  unsigned long long nan;
  unsigned long long pos_inf;
  unsigned long long neg_inf;
  unsigned long long first_bad_inverted;  ///< ~(ordinal << 44 | index << 2 | class); 0: none
};

/// Census of one tensor, in the same pass. Min and max are doubles in an
/// order-preserving integer encoding (`ordered_bits`): min inverted so that
/// both merge with atomicMax into zeroed memory.
struct device_tensor_stats {
  unsigned long long nan, pos_inf, neg_inf, finite, zeros, subnormal;
  unsigned long long fp16_overflow, fp16_underflow, bf16_overflow;
  unsigned long long min_inverted;        ///< ~ordered_bits(min) over finite values
  unsigned long long max_ordered;         ///< ordered_bits(max) over finite values
  unsigned long long first_bad_inverted;  ///< ~(index << 2 | class); 0: none
  double sum;                             ///< over finite values
  double sum_of_squares;                  ///< over finite values
};

/// The tensors of one launch. Passed by value as the kernel's argument
/// (about 1.6 KiB, under the 4 KiB every architecture takes).
struct census_launch {
  static constexpr int capacity = 64;
  int count = 0;                       ///< tensors in this launch
  const void* data[capacity];          ///< contiguous elements
  int64_t numel[capacity];
  uint32_t ordinal[capacity];          ///< position in the record, for the verdict's key
  element_type type[capacity];
  int chunk_begin[capacity + 1];       ///< first block of each tensor; chunk_begin[count]: blocks
  device_verdict* verdict = nullptr;   ///< the record's verdict on this device
  device_tensor_stats* stats = nullptr;  ///< one per tensor of this launch, or null: verdict only
};

/// Enqueues the census of `launch` on `stream`. Returns null, or CUDA's
/// message when the launch failed.
const char* launch_census(const census_launch& launch, CUstream_st* stream);

}  // namespace nanguard::detail::cuda
