// scope.h — module attribution for the ops nanguard traces.
//
// The tracer names the module an op ran in. It knows it from, in order:
// the TorchScript interpreter's module hierarchy (scripted models), the
// parameters an op reads (see tracer::name_parameters), and the stack of
// `scope` guards the user code opened:
//
//   auto forward = [](const at::Tensor& x) {
//     NANGUARD_SCOPE("encoder.norm");
//     return (x - x.mean(-1, true)) / x.std(-1, true, true);
//   };
//
// Scopes nest: a scope "attn" opened inside "encoder.0" names "encoder.0.attn".
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace torch::nn {
class Module;
class SequentialImpl;
}  // namespace torch::nn

namespace nanguard {

/// Names the module of the ops run on this thread while it lives.
class scope {
 public:
  /// Opens `name` (a dotted path) inside the current scope.
  explicit scope(const std::string& name);
  /// Opens the name `parent` registered `child` under: for the children of a
  /// ModuleList ("0", "1", ...), a ModuleDict (its keys) or any module.
  ///
  ///   for (size_t i = 0; i < layers->size(); ++i) {
  ///     nanguard::scope s(*layers, *layers[i]);
  ///     x = layers[i]->as<Block>()->forward(x);
  ///   }
  scope(const torch::nn::Module& parent, const torch::nn::Module& child);
  ~scope();
  scope(const scope&) = delete;
  scope& operator=(const scope&) = delete;
};

/// The dotted path of the innermost open scope on this thread ("" if none).
const std::string& current_scope();

/// Runs a Sequential child by child, each under a scope named after it
/// ("0", "1", ... or the names it was built with), so findings name the
/// child that went wrong.
///
/// REQUIRES: every child takes and returns one tensor.
at::Tensor forward_scoped(torch::nn::SequentialImpl& sequential, const at::Tensor& input);

/// The dotted module path from a TorchScript module hierarchy, e.g.
/// {"TOP(M)::forward", "encoder(Enc)::forward", "norm(Norm)::forward"} →
/// "encoder.norm"; exposed for tests.
std::string dotted_module_path(const std::vector<std::string>& hierarchy);

}  // namespace nanguard

#define NANGUARD_CONCAT_INNER(a, b) a##b
#define NANGUARD_CONCAT(a, b) NANGUARD_CONCAT_INNER(a, b)
/// Opens a `nanguard::scope` until the end of the enclosing block.
#define NANGUARD_SCOPE(name) ::nanguard::scope NANGUARD_CONCAT(nanguard_scope_, __LINE__)(name)
