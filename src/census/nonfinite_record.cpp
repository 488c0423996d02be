#include "nanguard/nonfinite_record.h"

#include "nanguard/spelling.h"

#ifdef NANGUARD_WITH_CUDA
#include "cuda_record.h"
#endif

#include <ATen/ATen.h>

#include <map>

namespace nanguard {
namespace {

// Counts and first bad element of a census, at record position `ordinal`.
void add_to_verdict(record_verdict& v, const tensor_stats& s, int64_t ordinal) {
  v.nan += s.nan;
  v.pos_inf += s.pos_inf;
  v.neg_inf += s.neg_inf;
  if (v.first_tensor < 0 && s.first_nonfinite_index >= 0) {
    v.first_tensor = ordinal;
    v.first_index = s.first_nonfinite_index;
    v.first_value = s.first_nonfinite_value;
  }
}

void check_addable(const at::Tensor& x) {
  TORCH_CHECK(x.defined(), "nanguard::nonfinite_record::add: the tensor is undefined; pass a tensor that holds data");
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
                   "nanguard::nonfinite_record::add: expected a float32, float64, float16 or bfloat16 tensor but "
                   "got ", t, " with shape ", x.sizes(), "; integer and bool tensors hold no NaN or Inf, and a complex one is "
                   "checked as ", spelled("at::view_as_real(x)", "torch.view_as_real(x)"));
}

}  // namespace

struct nonfinite_record::state {
  record_options options;
  int64_t size = 0;
  // Tensors checked at once (CPU, and devices without nanguard's kernels):
  // their verdict so far, and their statistics by position.
  record_verdict checked;
  std::map<int64_t, tensor_stats> checked_stats;
#ifdef NANGUARD_WITH_CUDA
  std::map<c10::DeviceIndex, detail::cuda_record> cuda;  // parts by CUDA device
  std::map<c10::DeviceIndex, std::vector<int64_t>> cuda_ordinals;  // positions of each part's tensors
#endif

  // The census, or for a verdict alone a scan and a census only on a hit.
  void check_now(const at::Tensor& x, int64_t ordinal) {
    if (options.stats() || has_nonfinite(x)) {
      const tensor_stats s = census(x);
      add_to_verdict(checked, s, ordinal);
      if (options.stats()) checked_stats.emplace(ordinal, s);
    }
  }
};

nonfinite_record::nonfinite_record(record_options options) : state_(std::make_unique<state>()) {
  state_->options = options;
}
nonfinite_record::~nonfinite_record() = default;
nonfinite_record::nonfinite_record(nonfinite_record&&) noexcept = default;
nonfinite_record& nonfinite_record::operator=(nonfinite_record&&) noexcept = default;

int64_t nonfinite_record::add(const at::Tensor& x) { return add(at::TensorList(&x, 1)); }

int64_t nonfinite_record::add(at::TensorList xs) {
  state& st = *state_;
  const int64_t first = st.size;
  TORCH_CHECK(first + int64_t(xs.size()) <= (int64_t(1) << 20), "nanguard::nonfinite_record::add: a record holds "
              "at most 2^20 tensors between clear()s and got ", first + int64_t(xs.size()), "; read it and "
              "clear() it more often, or use one record per list");
  for (const at::Tensor& x : xs) check_addable(x);
#ifdef NANGUARD_WITH_CUDA
  // CUDA tensors grouped by device, one enqueue each; the rest checked now.
  struct batch {
    std::vector<at::Tensor> tensors;
    std::vector<int64_t> ordinals;
  };
  std::map<c10::DeviceIndex, batch> on_gpu;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].is_cuda()) continue;
    batch& b = on_gpu[xs[i].device().index()];
    b.tensors.push_back(xs[i]);
    b.ordinals.push_back(first + int64_t(i));
  }
  for (auto& [device, b] : on_gpu) {
    st.cuda.try_emplace(device, c10::Device(at::kCUDA, device), st.options.stats()).first->second.add(b.tensors,
                                                                                                      b.ordinals);
    auto& ordinals = st.cuda_ordinals[device];
    ordinals.insert(ordinals.end(), b.ordinals.begin(), b.ordinals.end());
  }
#endif
  for (size_t i = 0; i < xs.size(); ++i) {
#ifdef NANGUARD_WITH_CUDA
    if (xs[i].is_cuda()) continue;
#endif
    st.check_now(xs[i], first + int64_t(i));
  }
  st.size += int64_t(xs.size());
  return first;
}

int64_t nonfinite_record::size() const { return state_->size; }

record_verdict nonfinite_record::verdict() {
  state& st = *state_;
  record_verdict v = st.checked;
  v.tensors = st.size;
#ifdef NANGUARD_WITH_CUDA
  for (auto& [device, part] : st.cuda) {
    const detail::cuda_verdict d = part.verdict();
    v.nan += d.nan;
    v.pos_inf += d.pos_inf;
    v.neg_inf += d.neg_inf;
    if (d.first_ordinal >= 0 && (v.first_tensor < 0 || d.first_ordinal < v.first_tensor)) {
      v.first_tensor = d.first_ordinal;
      v.first_index = d.first_index;
      v.first_value = d.first_value;
    }
  }
#endif
  return v;
}

std::vector<tensor_stats> nonfinite_record::stats() {
  state& st = *state_;
  TORCH_CHECK(st.options.stats(), "nanguard::nonfinite_record::stats: the record gathers no statistics; make it "
              "with nanguard::record_options().stats(true)");
  std::vector<tensor_stats> out(st.size);
  for (const auto& [ordinal, s] : st.checked_stats) out[ordinal] = s;
#ifdef NANGUARD_WITH_CUDA
  for (auto& [device, part] : st.cuda) {
    const std::vector<tensor_stats> part_stats = part.stats();
    const std::vector<int64_t>& ordinals = st.cuda_ordinals[device];
    for (size_t i = 0; i < part_stats.size(); ++i) out[ordinals[i]] = part_stats[i];
  }
#endif
  return out;
}

void nonfinite_record::clear() {
  state& st = *state_;
  st.size = 0;
  st.checked = {};
  st.checked_stats.clear();
#ifdef NANGUARD_WITH_CUDA
  for (auto& [device, part] : st.cuda) part.clear();
  st.cuda_ordinals.clear();
#endif
}

std::vector<tensor_stats> census_many(at::TensorList xs) {
  nonfinite_record record(record_options().stats(true));
  record.add(xs);
  return record.stats();
}

record_verdict check_many(at::TensorList xs) {
  nonfinite_record record;
  record.add(xs);
  return record.verdict();
}

}  // namespace nanguard
