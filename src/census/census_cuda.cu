// census_cuda.cu — the census of many CUDA tensors in one launch.
//
// A multi-tensor apply in the manner of PyTorch's multi_tensor_apply: the
// launch carries a small table of tensors, each thread block finds its
// tensor and 32 KiB chunk in it, reads the chunk once (16-byte loads where
// aligned) and adds what it found to the record with a few atomics. With no
// non-finite value and no statistics asked, a block does no atomic at all.
#include "census_cuda.h"
#include "nanguard/float_formats.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>

namespace nanguard::detail::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLoads = kChunkBytes / (kThreads * 16);  // 16-byte loads per thread
static_assert(kLoads * kThreads * 16 == kChunkBytes, "a chunk is whole loads of every thread");

// Each element type: its storage bits, the exponent mask that marks NaN and
// Inf, its value as float or double, and its smallest normal magnitude.
template <element_type E>
struct element;
template <>
struct element<element_type::f32> {
  using bits = uint32_t;
  static constexpr bits exponent = 0x7F800000u;
  static __device__ double value(bits b) { return __uint_as_float(b); }
  static constexpr double smallest_normal = FLT_MIN;
};
template <>
struct element<element_type::f64> {
  using bits = unsigned long long;
  static constexpr bits exponent = 0x7FF0000000000000ull;
  static __device__ double value(bits b) { return __longlong_as_double(static_cast<long long>(b)); }
  static constexpr double smallest_normal = DBL_MIN;
};
template <>
struct element<element_type::f16> {
  using bits = uint16_t;
  static constexpr bits exponent = 0x7C00;
  static __device__ double value(bits b) { return __half2float(__ushort_as_half(b)); }
  static constexpr double smallest_normal = fp16_min_normal;
};
template <>
struct element<element_type::bf16> {
  using bits = uint16_t;
  static constexpr bits exponent = 0x7F80;
  static __device__ double value(bits b) { return __uint_as_float(uint32_t(b) << 16); }
  static constexpr double smallest_normal = FLT_MIN;  // float32's exponent range
};

// A double as an integer with the same order (negatives reversed).
__device__ unsigned long long ordered_bits(double x) {
  const auto b = static_cast<unsigned long long>(__double_as_longlong(x));
  return (b >> 63) ? ~b : b | (1ull << 63);
}

// What one thread, then one warp, then one block found. Counts fit 32 bits:
// a block reads at most 16384 elements. Trivial, so that it may live in
// shared memory; `none()` is the empty tally.
struct tally {
  unsigned nan, pos_inf, neg_inf;
  unsigned long long first_bad;  // index << 2 | class; all ones: none
  unsigned finite, zeros, subnormal, fp16_overflow, fp16_underflow, bf16_overflow;
  double sum, sum_of_squares, min, max;

  static __device__ tally none() {
    tally t{};
    t.first_bad = ~0ull;
    t.min = __builtin_huge_val();
    t.max = -__builtin_huge_val();
    return t;
  }

  __device__ unsigned nonfinite() const { return nan + pos_inf + neg_inf; }

  __device__ void merge(const tally& o) {
    nan += o.nan;
    pos_inf += o.pos_inf;
    neg_inf += o.neg_inf;
    first_bad = o.first_bad < first_bad ? o.first_bad : first_bad;
    finite += o.finite;
    zeros += o.zeros;
    subnormal += o.subnormal;
    fp16_overflow += o.fp16_overflow;
    fp16_underflow += o.fp16_underflow;
    bf16_overflow += o.bf16_overflow;
    sum += o.sum;
    sum_of_squares += o.sum_of_squares;
    min = fmin(min, o.min);
    max = fmax(max, o.max);
  }

  // The tally of the lane `offset` above (warp reduction).
  __device__ tally from_lane_below(unsigned offset) const {
    constexpr unsigned all = 0xFFFFFFFFu;
    tally o;  // every field set below
    o.nan = __shfl_down_sync(all, nan, offset);
    o.pos_inf = __shfl_down_sync(all, pos_inf, offset);
    o.neg_inf = __shfl_down_sync(all, neg_inf, offset);
    o.first_bad = __shfl_down_sync(all, first_bad, offset);
    o.finite = __shfl_down_sync(all, finite, offset);
    o.zeros = __shfl_down_sync(all, zeros, offset);
    o.subnormal = __shfl_down_sync(all, subnormal, offset);
    o.fp16_overflow = __shfl_down_sync(all, fp16_overflow, offset);
    o.fp16_underflow = __shfl_down_sync(all, fp16_underflow, offset);
    o.bf16_overflow = __shfl_down_sync(all, bf16_overflow, offset);
    o.sum = __shfl_down_sync(all, sum, offset);
    o.sum_of_squares = __shfl_down_sync(all, sum_of_squares, offset);
    o.min = __shfl_down_sync(all, min, offset);
    o.max = __shfl_down_sync(all, max, offset);
    return o;
  }
};

template <element_type E, bool Stats>
__device__ __forceinline__ void visit(tally& t, typename element<E>::bits b, int64_t index) {
  using el = element<E>;
  if ((b & el::exponent) == el::exponent) {  // NaN or Inf: rare
    const double v = el::value(b);
    const uint64_t cls = isnan(v) ? is_nan : v > 0 ? is_pos_inf : is_neg_inf;
    t.nan += cls == is_nan;
    t.pos_inf += cls == is_pos_inf;
    t.neg_inf += cls == is_neg_inf;
    const unsigned long long key = (static_cast<unsigned long long>(index) << 2) | cls;
    t.first_bad = key < t.first_bad ? key : t.first_bad;
  } else if constexpr (Stats) {
    const double v = el::value(b), a = fabs(v);
    t.finite += 1;
    t.zeros += a == 0;
    t.subnormal += a != 0 && a < el::smallest_normal;
    t.fp16_underflow += a != 0 && a < fp16_min_normal;
    t.fp16_overflow += inf_in_fp16(a);
    t.bf16_overflow += inf_in_bf16(a);
    t.sum += v;
    t.sum_of_squares += v * v;
    t.min = fmin(t.min, v);
    t.max = fmax(t.max, v);
  }
}

// One chunk of one tensor: whole chunks of aligned tensors in 16-byte loads,
// all issued before any is looked at; the last chunk and unaligned tensors
// element by element (coalesced all the same).
template <element_type E, bool Stats>
__device__ void census_chunk(const void* data, int64_t numel, int64_t chunk, tally& t) {
  using bits = typename element<E>::bits;
  constexpr int per_load = 16 / sizeof(bits);
  constexpr int64_t per_chunk = kChunkBytes / sizeof(bits);
  const bits* x = static_cast<const bits*>(data);
  const int64_t begin = chunk * per_chunk;
  const int64_t end = numel - begin < per_chunk ? numel : begin + per_chunk;
  if (end - begin == per_chunk && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(x + begin);
    uint4 loaded[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) loaded[k] = __ldg(v + k * kThreads + threadIdx.x);
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      bits e[per_load];
      memcpy(e, &loaded[k], 16);
      const int64_t first = begin + (int64_t(k) * kThreads + threadIdx.x) * per_load;
#pragma unroll
      for (int j = 0; j < per_load; ++j) visit<E, Stats>(t, e[j], first + j);
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) visit<E, Stats>(t, x[i], i);
  }
}

// The block's tally in thread 0: warps by shuffles, then warp 0 over the
// warps' tallies in shared memory.
__device__ tally block_tally(tally t) {
  __shared__ tally warps[kThreads / 32];
  for (unsigned offset = 16; offset > 0; offset /= 2) t.merge(t.from_lane_below(offset));
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = t;
  __syncthreads();
  if (threadIdx.x == 0)
    for (unsigned w = 1; w < kThreads / 32; ++w) t.merge(warps[w]);
  return t;
}

__device__ void add_count(unsigned long long* to, unsigned n) {
  if (n) atomicAdd(to, static_cast<unsigned long long>(n));
}

template <bool Stats>
__global__ void __launch_bounds__(kThreads) census_kernel(const census_launch launch) {
  int i = 0;
  while (int(blockIdx.x) >= launch.chunk_begin[i + 1]) ++i;
  const int64_t chunk = blockIdx.x - launch.chunk_begin[i];
  tally t = tally::none();
  switch (launch.type[i]) {
    case element_type::f32: census_chunk<element_type::f32, Stats>(launch.data[i], launch.numel[i], chunk, t); break;
    case element_type::f64: census_chunk<element_type::f64, Stats>(launch.data[i], launch.numel[i], chunk, t); break;
    case element_type::f16: census_chunk<element_type::f16, Stats>(launch.data[i], launch.numel[i], chunk, t); break;
    case element_type::bf16: census_chunk<element_type::bf16, Stats>(launch.data[i], launch.numel[i], chunk, t); break;
  }
  // The common case, every element finite and no statistics: no atomics.
  if (!Stats && !__syncthreads_or(t.nonfinite() != 0)) return;
  t = block_tally(t);
  if (threadIdx.x != 0) return;
  if (t.nonfinite()) {
    device_verdict* v = launch.verdict;
    add_count(&v->nan, t.nan);
    add_count(&v->pos_inf, t.pos_inf);
    add_count(&v->neg_inf, t.neg_inf);
    const unsigned long long key = (static_cast<unsigned long long>(launch.ordinal[i]) << (kIndexBits + 2)) | t.first_bad;
    atomicMax(&v->first_bad_inverted, ~key);
  }
  if constexpr (Stats) {
    device_tensor_stats* s = launch.stats + i;
    add_count(&s->nan, t.nan);
    add_count(&s->pos_inf, t.pos_inf);
    add_count(&s->neg_inf, t.neg_inf);
    if (t.nonfinite()) atomicMax(&s->first_bad_inverted, ~t.first_bad);
    if (t.finite == 0) return;
    add_count(&s->finite, t.finite);
    add_count(&s->zeros, t.zeros);
    add_count(&s->subnormal, t.subnormal);
    add_count(&s->fp16_overflow, t.fp16_overflow);
    add_count(&s->fp16_underflow, t.fp16_underflow);
    add_count(&s->bf16_overflow, t.bf16_overflow);
    atomicAdd(&s->sum, t.sum);
    atomicAdd(&s->sum_of_squares, t.sum_of_squares);
    atomicMax(&s->min_inverted, ~ordered_bits(t.min));
    atomicMax(&s->max_ordered, ordered_bits(t.max));
  }
}

}  // namespace

const char* launch_census(const census_launch& launch, CUstream_st* stream) {
  const int blocks = launch.chunk_begin[launch.count];
  if (blocks == 0) return nullptr;
  if (launch.stats)
    census_kernel<true><<<blocks, kThreads, 0, stream>>>(launch);
  else
    census_kernel<false><<<blocks, kThreads, 0, stream>>>(launch);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace nanguard::detail::cuda
