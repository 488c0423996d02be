// census.h — one-pass statistics of a floating-point tensor.
//
// The census is what every other part of nanguard looks at a tensor with: the
// tracer, the sentinel, the precision advisor and the data firewall. It reads
// each element once, vectorised and in parallel, and is cheap enough to run
// on every op output (see bench/census_bench.cpp for the figures).
//
//   at::Tensor g = model->weight.grad();
//   if (nanguard::has_nonfinite(g)) {
//     nanguard::tensor_stats s = nanguard::census(g);
//     std::cerr << s << "\n";  // nan=3 +inf=0 -inf=0 ... first bad [17] = nan
//   }
#pragma once

#include <nanguard/tensor_stats.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <iosfwd>
#include <limits>
#include <string>
#include <vector>

namespace nanguard {

/// Gathers `tensor_stats` of `x` in one vectorised, parallel pass.
///
/// REQUIRES: `x` is float32, float64, float16 or bfloat16; it may be any
/// view (strided, expanded, zero-stride) and empty. Tensors not on the CPU
/// are measured with ATen ops on their device.
/// Throws c10::Error for integer, bool or complex tensors, and for undefined,
/// sparse or meta tensors (no values to read), with what to pass instead.
///
///   auto s = nanguard::census(logits);
///   if (s.fp16_overflow) { /* keep this layer in fp32 */ }
tensor_stats census(const at::Tensor& x);

/// True when `x` holds a NaN or an Inf. Stops at the first one it finds.
///
/// Cheaper than `census`: use it as the fast check, then take a census of
/// the tensors it flags. Integer and bool tensors are always finite (false);
/// a complex tensor is checked through its real and imaginary parts; an
/// undefined, sparse or meta tensor throws.
bool has_nonfinite(const at::Tensor& x);

/// The census of a tensor made of `parts` (the shards of a sharded tensor),
/// from the census of each part: counts summed, min/max/absmax over the
/// parts, mean and std pooled over their finite elements, the L2 norm of
/// their norms (summed scaled where their squares pass float64's range, as
/// census does), and the first non-finite element the one with the smallest
/// index.
///
/// REQUIRES: each part's first_nonfinite_index is already an index into the
/// whole tensor (a shard's own index plus where the shard starts).
///
///   auto whole = nanguard::merge_census({nanguard::census(x0), nanguard::census(x1)});
tensor_stats merge_census(const std::vector<tensor_stats>& parts);

/// One line, e.g. `n=1024 nan=1 +inf=0 -inf=0 zero=3 min=-2.1 max=3.3 ...`.
std::string to_string(const tensor_stats& s);

/// Writes `to_string(s)`.
std::ostream& operator<<(std::ostream& os, const tensor_stats& s);

}  // namespace nanguard
