#include "cuda_record.h"

#include "nanguard/spelling.h"

#include "census_cuda.h"
#include "census_paths.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

namespace nanguard::detail {
namespace {

namespace cu = detail::cuda;

cu::element_type element_type_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return cu::element_type::f32;
    case at::kDouble: return cu::element_type::f64;
    case at::kHalf: return cu::element_type::f16;
    case at::kBFloat16: return cu::element_type::bf16;
    default:
      TORCH_CHECK_TYPE(false, "nanguard: the CUDA census reads float32, float64, float16 or bfloat16 but got ",
                       x.scalar_type(), " with shape ", x.sizes(), "; convert with ",
                       spelled("x.to(at::kFloat)", "x.float()"));
  }
}

at::Tensor zeroed_bytes(int64_t n, c10::Device device) {
  return at::zeros({n}, at::TensorOptions().dtype(at::kByte).device(device));
}

// A struct the kernel wrote, read from bytes copied to the host.
template <typename T>
T read_as(const at::Tensor& host_bytes, int64_t i = 0) {
  T out;
  std::memcpy(&out, static_cast<const uint8_t*>(host_bytes.data_ptr()) + i * sizeof(T), sizeof(T));
  return out;
}

double from_ordered_bits(uint64_t b) {
  b = (b >> 63) ? b & ~(uint64_t(1) << 63) : ~b;
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}

double value_of_class(uint64_t cls) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  return cls == cu::is_nan ? std::numeric_limits<double>::quiet_NaN() : cls == cu::is_pos_inf ? inf : -inf;
}

tensor_stats to_stats(const cu::device_tensor_stats& d, int64_t numel) {
  tensor_stats s;
  s.numel = numel;
  s.nan = int64_t(d.nan);
  s.pos_inf = int64_t(d.pos_inf);
  s.neg_inf = int64_t(d.neg_inf);
  s.finite = int64_t(d.finite);
  s.zeros = int64_t(d.zeros);
  s.subnormal = int64_t(d.subnormal);
  s.fp16_overflow = int64_t(d.fp16_overflow);
  s.fp16_underflow = int64_t(d.fp16_underflow);
  s.bf16_overflow = int64_t(d.bf16_overflow);
  if (d.first_bad_inverted) {
    const uint64_t key = ~d.first_bad_inverted;
    s.first_nonfinite_index = int64_t(key >> 2);
    s.first_nonfinite_value = value_of_class(key & 3);
  }
  if (s.finite > 0) {
    const double n = double(s.finite);
    s.min = from_ordered_bits(~d.min_inverted);
    s.max = from_ordered_bits(d.max_ordered);
    s.mean = d.sum / n;
    // One pass gives sums, not Chan's merged deviations: the variance as
    // E[x^2] - mean^2 in double, clamped at 0 against rounding.
    s.std = std::sqrt(std::max(0.0, d.sum_of_squares / n - s.mean * s.mean));
    s.l2_norm = std::sqrt(d.sum_of_squares);
    s.absmax = std::max(std::fabs(s.min), std::fabs(s.max));
  }
  return s;
}

}  // namespace

cuda_record::cuda_record(c10::Device device, bool stats)
    : device_(device), gather_stats_(stats), verdict_(zeroed_bytes(sizeof(cu::device_verdict), device)) {}

void cuda_record::add(at::TensorList xs, c10::ArrayRef<int64_t> ordinals) {
  const c10::cuda::CUDAGuard on_device(device_);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device_.index());
  if (std::find(streams_.begin(), streams_.end(), c10::Stream(stream)) == streams_.end()) streams_.push_back(stream);
  auto* stats = gather_stats_
      ? static_cast<cu::device_tensor_stats*>(
            stats_blocks_.emplace_back(zeroed_bytes(xs.size() * sizeof(cu::device_tensor_stats), device_)).data_ptr())
      : nullptr;
  // Contiguous copies of views and negative views: freed when this returns,
  // to this stream, whose later work runs after the kernel.
  std::vector<at::Tensor> contiguous;
  contiguous.reserve(xs.size());
  cu::census_launch launch;
  const auto enqueue = [&] {
    if (const char* error = cu::launch_census(launch, stream.stream()))
      TORCH_CHECK(false, "nanguard: the CUDA census kernel did not launch on ", device_, ": ", error);
    launch.count = 0;
  };
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& c = contiguous.emplace_back(logical_values(xs[i]));
    TORCH_CHECK(c.numel() < cu::kMaxElements, "nanguard: a tensor of ", c.numel(), " elements is over the CUDA "
                "census's limit of 2^42; check it in slices (x.flatten().split(1 << 40))");
    const int64_t chunks = cu::chunks_of(c.numel(), c.element_size());
    if (launch.count == cu::census_launch::capacity ||
        (launch.count > 0 && launch.chunk_begin[launch.count] + chunks > INT_MAX))
      enqueue();
    if (launch.count == 0) {
      launch.chunk_begin[0] = 0;
      launch.verdict = static_cast<cu::device_verdict*>(verdict_.data_ptr());
      launch.stats = stats ? stats + i : nullptr;
    }
    const int k = launch.count++;
    launch.data[k] = c.data_ptr();
    launch.numel[k] = c.numel();
    launch.ordinal[k] = uint32_t(ordinals[i]);
    launch.type[k] = element_type_of(c);
    launch.chunk_begin[k + 1] = launch.chunk_begin[k] + int(chunks);
    numel_.push_back(c.numel());
  }
  if (launch.count > 0) enqueue();
}

void cuda_record::wait() {
  for (const c10::Stream& s : streams_) s.synchronize();
  streams_.clear();
}

cuda_verdict cuda_record::verdict() {
  wait();
  const auto v = read_as<cu::device_verdict>(verdict_.cpu());
  cuda_verdict out;
  out.nan = int64_t(v.nan);
  out.pos_inf = int64_t(v.pos_inf);
  out.neg_inf = int64_t(v.neg_inf);
  if (v.first_bad_inverted) {
    const uint64_t key = ~v.first_bad_inverted;
    out.first_ordinal = int64_t(key >> (cu::kIndexBits + 2));
    out.first_index = int64_t((key >> 2) & (uint64_t(cu::kMaxElements) - 1));
    out.first_value = value_of_class(key & 3);
  }
  return out;
}

std::vector<tensor_stats> cuda_record::stats() {
  TORCH_CHECK(gather_stats_, "nanguard::nonfinite_record::stats: the record gathers no statistics; make it "
              "with nanguard::record_options().stats(true)");
  wait();
  std::vector<tensor_stats> out;
  if (stats_blocks_.empty()) return out;
  const at::Tensor host = (stats_blocks_.size() == 1 ? stats_blocks_[0] : at::cat(stats_blocks_)).cpu();
  for (size_t i = 0; i < numel_.size(); ++i)
    out.push_back(to_stats(read_as<cu::device_tensor_stats>(host, int64_t(i)), numel_[i]));
  return out;
}

void cuda_record::clear() {
  const c10::cuda::CUDAGuard on_device(device_);
  verdict_.zero_();
  stats_blocks_.clear();
  numel_.clear();
  streams_ = {c10::cuda::getCurrentCUDAStream(device_.index())};  // where the zeroing runs
}

}  // namespace nanguard::detail
