#include "script_model.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/script.h>

#include <filesystem>

namespace nanguard::cli {
namespace {

void mirror_into(const torch::jit::Module& m, torch::nn::Module& out) {
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    out.register_parameter(p.name, p.value, p.value.requires_grad());
  for (const auto& b : m.named_buffers(/*recurse=*/false)) out.register_buffer(b.name, b.value);
  for (const auto& c : m.named_children()) {
    auto child = std::make_shared<torch::nn::Module>(c.value.type()->name() ? c.value.type()->name()->name() : c.name);
    mirror_into(c.value, *child);
    out.register_module(c.name, child);
  }
}

}  // namespace

torch::jit::Module load_script_model(const std::string& path) {
  if (std::filesystem::is_directory(path))
    throw usage_error(fmt::format("'{}' is a directory, not a TorchScript model; pass the file that "
                                  "torch.jit.script(model).save(path) wrote", path));
  if (!std::filesystem::exists(path)) throw usage_error(fmt::format("cannot open model '{}': no such file", path));
  if (!std::filesystem::is_regular_file(path))
    throw usage_error(fmt::format("'{}' is not a regular file (a pipe or a device?): a TorchScript model is a zip "
                                  "archive read by seeking; save it to a file and pass that path", path));
  try {
    return torch::jit::load(path);
  } catch (const c10::Error&) {
    throw usage_error(fmt::format(
        "'{}' is not a TorchScript model; save one from Python with torch.jit.script(model).save(path)", path));
  }
}

std::shared_ptr<torch::nn::Module> mirror_parameters(const torch::jit::Module& m) {
  auto root = std::make_shared<torch::nn::Module>("script_model");
  mirror_into(m, *root);
  return root;
}

at::Tensor forward_tensor(torch::jit::Module& m, const at::Tensor& x) {
  c10::IValue out = m.forward({x});
  if (out.isTuple()) out = out.toTupleRef().elements().at(0);
  if (!out.isTensor())
    throw usage_error(fmt::format("the model returned a {}, not a tensor (or a tuple starting with one)",
                                  out.tagKind()));
  return out.toTensor();
}

namespace {

// `t` as `dtype`, without a no-op `to` call when it already is: the tracer
// would see that aten::to return its non-finite input and report it there.
at::Tensor as(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

}  // namespace

void require_trainable(const at::Tensor& out) {
  const char* const how = "the loss must be a floating-point tensor that depends on the model's trainable parameters";
  if (!out.is_floating_point())
    throw usage_error(fmt::format("the model returns {} values, but {}: return float outputs (logits or values, not "
                                  "class indices)", c10::toString(out.scalar_type()), how));
  if (!out.requires_grad())
    throw usage_error(fmt::format("the model's output depends on no trainable parameter (it has none, or they are "
                                  "frozen or detached), but {}", how));
}

at::Tensor task_loss(const at::Tensor& out, const at::Tensor& y, const std::string& task) {
  require_trainable(out);
  const int64_t b = y.size(0);
  if (task == "regress") {
    if (out.numel() != b)
      throw usage_error(fmt::format("--task regress needs one output per row; the model returned shape {} for {} rows",
                                    c10::str(out.sizes()), b));
    return at::mse_loss(as(out.reshape({b}), at::kFloat), as(y, at::kFloat));
  }
  if (out.dim() != 2 || out.size(0) != b)
    throw usage_error(fmt::format("--task classify needs [rows, classes] logits; the model returned shape {}",
                                  c10::str(out.sizes())));
  return at::cross_entropy_loss(as(out, at::kFloat), as(y, at::kLong));
}

std::string one_line_error(const std::string& what) {
  const std::string marker = "RuntimeError: ";
  size_t begin = what.rfind(marker);
  begin = begin == std::string::npos ? 0 : begin + marker.size();
  while (begin < what.size() && (what[begin] == '\n' || what[begin] == ' ')) ++begin;
  const size_t end = what.find('\n', begin);
  return what.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

per_op_autograd::per_op_autograd() { torch::jit::setGraphExecutorOptimize(false); }
per_op_autograd::~per_op_autograd() { torch::jit::setGraphExecutorOptimize(true); }

}  // namespace nanguard::cli
