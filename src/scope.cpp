#include "nanguard/scope.h"

#include "detail/scope_handle.h"

#include <torch/nn/modules/container/sequential.h>

namespace nanguard {
namespace {

// Full dotted paths, innermost last; shared so that the tracer can keep the
// path an op ran in without copying it.
std::vector<std::shared_ptr<const std::string>>& scope_stack() {
  thread_local std::vector<std::shared_ptr<const std::string>> stack;
  return stack;
}

}  // namespace

scope::scope(const std::string& name) {
  auto& stack = scope_stack();
  stack.push_back(std::make_shared<const std::string>(stack.empty() || stack.back()->empty() ? name
                                                                                          : *stack.back() + "." + name));
}

namespace {

std::string child_name(const torch::nn::Module& parent, const torch::nn::Module& child) {
  for (const auto& c : parent.named_children())
    if (c.value().get() == &child) return c.key();
  TORCH_CHECK(false, "nanguard::scope: the module is not a child of ", parent.name(),
              "; register it with register_module or pass its name as a string");
}

}  // namespace

scope::scope(const torch::nn::Module& parent, const torch::nn::Module& child)
    : scope(child_name(parent, child)) {}

scope::~scope() { scope_stack().pop_back(); }

const std::string& current_scope() {
  static const std::string none;
  const auto& stack = scope_stack();
  return stack.empty() ? none : *stack.back();
}

namespace detail {

std::shared_ptr<const std::string> current_scope_handle() {
  const auto& stack = scope_stack();
  return stack.empty() ? nullptr : stack.back();
}

}  // namespace detail

at::Tensor forward_scoped(torch::nn::SequentialImpl& sequential, const at::Tensor& input) {
  const auto children = sequential.named_children();
  TORCH_CHECK(children.size() == sequential.size(), "nanguard::forward_scoped: the Sequential has ",
              sequential.size(), " entries but ", children.size(), " named children");
  at::Tensor x = input;
  size_t i = 0;
  for (auto& child : sequential) {
    scope s(children[i++].key());
    x = child.forward(x);
  }
  return x;
}

std::string dotted_module_path(const std::vector<std::string>& hierarchy) {
  std::string path;
  for (size_t i = 0; i < hierarchy.size(); ++i) {
    const std::string& entry = hierarchy[i];
    const std::string name = entry.substr(0, entry.find('('));
    if (i == 0 && name == "TOP") continue;  // the scripted model itself
    // SELF: a method of the module the frame above runs in (conv's _conv_forward).
    if (name.empty() || name == "SELF") continue;
    if (!path.empty()) path += '.';
    path += name;
  }
  return path;
}

}  // namespace nanguard
