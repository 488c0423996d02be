// `nanguard census FILE...`: the census of tensors saved with torch.save.
#include "commands.h"

#include <nanguard/census.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iterator>

namespace nanguard::cli {
namespace {

at::Tensor load_tensor(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw usage_error(fmt::format("cannot open '{}': no such file or not readable", path));
  const std::vector<char> bytes{std::istreambuf_iterator<char>(in), {}};
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    // What torch.save writes for tensors that LibTorch's unpickler cannot rebuild.
    const std::string why = e.what_without_backtrace();
    if (why.find("_get_layout") != std::string::npos)
      throw usage_error(fmt::format("'{}' holds a sparse tensor (or another non-strided layout), which LibTorch "
                                    "cannot load; save t.to_dense()", path));
    if (why.find("_rebuild_tensor_v3") != std::string::npos)
      throw usage_error(fmt::format("'{}' holds a tensor of a dtype LibTorch cannot load (float8, uint16, ...); "
                                    "save t.float()", path));
    throw usage_error(fmt::format(
        "'{}' is not a tensor saved with torch.save(tensor, path) (or torch::pickle_save)", path));
  }
  if (!value.isTensor())
    throw usage_error(fmt::format("'{}' holds a {}, not a tensor; save one tensor per file", path,
                                  value.tagKind()));
  return value.toTensor();
}

}  // namespace

command add_census_command(CLI::App& app) {
  auto* sub = app.add_subcommand("census", "One-pass statistics of tensors saved with torch.save");
  auto files = std::make_shared<std::vector<std::string>>();
  sub->add_option("files", *files, "tensor files (torch.save / torch::pickle_save)")
      ->required()
      ->check(CLI::ExistingFile);
  sub->footer(exit_codes("every tensor is finite", "a tensor holds NaN/Inf"));
  return {sub, [files] {
            bool any_bad = false;
            for (const auto& path : *files) {
              const at::Tensor t = load_tensor(path);
              if (!t.is_floating_point() && !t.is_complex()) {
                fmt::print("{}: {} {} tensor: {} data is always finite\n", path, c10::str(t.sizes()),
                           c10::toString(t.scalar_type()), t.scalar_type() == at::kBool ? "bool" : "integer");
                continue;
              }
              // A complex tensor is measured as its real and imaginary parts.
              const tensor_stats s = census(t.is_complex() ? at::view_as_real(t) : t);
              any_bad |= !s.all_finite();
              fmt::print("{}: {} {}\n  {}\n", path, c10::str(t.sizes()), c10::toString(t.scalar_type()),
                         to_string(s));
            }
            return any_bad ? exit_nonfinite : exit_ok;
          }};
}

}  // namespace nanguard::cli
