#include "guard/rank_case.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <unistd.h>

#include <climits>

namespace nanguard::detail {

std::string rank_case::to_bytes() const {
  c10::List<at::Tensor> tensors;
  for (const at::Tensor& t : batch) tensors.push_back(t.defined() ? t.detach().to(at::kCPU) : at::Tensor());
  const c10::IValue fields = c10::ivalue::Tuple::create(
      {c10::IValue(std::string(to_string(fault))), c10::IValue(host), c10::IValue(tensors), c10::IValue(rng)});
  const std::vector<char> bytes = torch::jit::pickle_save(fields);
  return std::string(bytes.begin(), bytes.end());
}

rank_case rank_case::from_bytes(const std::string& bytes) {
  const c10::IValue v = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  TORCH_CHECK(v.isTuple() && v.toTupleRef().elements().size() == 4,
              "nanguard: a rank's case for the cross-rank rerun is malformed (", bytes.size(), " bytes)");
  const auto& f = v.toTupleRef().elements();
  rank_case c;
  c.fault = fault_class_from_string(f[0].toStringRef());
  c.host = f[1].toStringRef();
  for (const c10::IValue& t : f[2].toListRef()) c.batch.push_back(t.isTensor() ? t.toTensor() : at::Tensor());
  c.rng = f[3].isTensor() ? f[3].toTensor() : at::Tensor();
  return c;
}

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string();
}

}  // namespace nanguard::detail
