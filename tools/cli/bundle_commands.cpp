// `nanguard inspect BUNDLE`: what a repro bundle holds, readable.
// `nanguard replay BUNDLE --model M.pt`: re-runs the bundled step (batch,
// parameters, RNG state) of a TorchScript model under the op tracer and
// prints the finding. Exit code 3 when the step is non-finite again, 0 when
// it runs finite ("not reproduced"), 2 for a missing or malformed bundle.
#include "commands.h"
#include "script_model.h"

#include <nanguard/bundle.h>
#include <nanguard/census.h>
#include <nanguard/finding.h>
#include <nanguard/tracer.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/types.h>

#include <cmath>
#include <filesystem>
#include <mutex>

namespace nanguard::cli {
namespace {

struct inspect_args {
  std::string bundle;
};

struct replay_args {
  std::string bundle;
  std::string model;
  std::string task;
};

bundle load_bundle(const std::string& dir) {
  if (!std::filesystem::is_directory(dir))
    throw usage_error(fmt::format("no bundle at '{}': not a directory; pass the directory `nanguard train "
                                  "--policy abort` printed (e.g. nanguard-train/bundles/step-000012)", dir));
  try {
    return read_bundle(dir);
  } catch (const c10::Error& e) {
    throw usage_error(fmt::format("'{}' is not a repro bundle: {}", dir, e.what_without_backtrace()));
  }
}

std::string tag(const bundle& b, const std::string& key) {
  for (const auto& [k, v] : b.tags)
    if (k == key) return v;
  return "";
}

std::string number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", v);
}

std::string tensor_line(const std::string& name, const at::Tensor& t) {
  if (!t.defined()) return fmt::format("  {:<28} (undefined)", name);
  std::string s = fmt::format("  {:<28} {:<7} {:<14}", name, c10::toString(t.scalar_type()), c10::str(t.sizes()));
  if (t.is_floating_point()) s += " " + to_string(census(t));
  return s;
}

int run_inspect(const inspect_args& a) {
  const bundle b = load_bundle(a.bundle);
  fmt::print("repro bundle {}\n", a.bundle);
  fmt::print("  step {}, loss {}, lr {}, loss scale {}, policy {}, verdict {}\n", b.step, number(b.loss),
             number(b.lr), number(b.scale), b.policy.empty() ? "-" : b.policy,
             b.verdict.empty() ? "-" : b.verdict);
  fmt::print("  written by nanguard {}, torch {}\n", b.nanguard_version.empty() ? "?" : b.nanguard_version,
             b.torch_version.empty() ? "?" : b.torch_version);
  for (const auto& [k, v] : b.tags) fmt::print("  {}: {}\n", k, v);
  if (b.finding) {
    fmt::print("finding:\n");
    std::string text = to_text(*b.finding);
    if (!text.empty() && text.back() == '\n') text.pop_back();
    for (size_t pos = 0; pos <= text.size();) {
      const size_t end = text.find('\n', pos);
      fmt::print("  {}\n", text.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
      if (end == std::string::npos) break;
      pos = end + 1;
    }
  } else {
    fmt::print("finding: none (the step was not replayed under the tracer)\n");
  }
  fmt::print("tensors:\n");
  for (size_t i = 0; i < b.batch.size(); ++i) fmt::print("{}\n", tensor_line(fmt::format("batch[{}]", i), b.batch[i]));
  fmt::print("{}\n", tensor_line("rng_state", b.rng_state));
  for (size_t i = 0; i < b.culprit_inputs.size(); ++i)
    fmt::print("{}\n", tensor_line(fmt::format("culprit_inputs[{}]", i), b.culprit_inputs[i]));
  for (const auto& [name, t] : b.parameters) fmt::print("{}\n", tensor_line("parameters: " + name, t));
  return exit_ok;
}

int run_replay(const replay_args& a) {
  const bundle b = load_bundle(a.bundle);
  torch::jit::Module model = load_script_model(a.model);
  const std::string task = a.task.empty() ? tag(b, "task") : a.task;
  if (task.empty())
    throw usage_error(fmt::format("the bundle '{}' does not say its task; pass --task classify or --task regress",
                                  a.bundle));
  if (b.batch.size() < 2 || !b.batch[0].defined() || !b.batch[1].defined())
    throw usage_error(fmt::format("the bundle '{}' holds {} batch tensors; replay needs two (features, target) "
                                  "as `nanguard train` writes them", a.bundle, b.batch.size()));

  // The parameters as they were at the start of the step.
  {
    torch::NoGradGuard no_grad;
    auto named = model.named_parameters();
    for (const auto& [name, value] : b.parameters) {
      bool found = false;
      for (const auto& p : named)
        if (p.name == name) {
          if (!p.value.sizes().equals(value.sizes()))
            throw usage_error(fmt::format("the bundle's parameter '{}' is {} but the model's is {}; replay with "
                                          "the model the bundle was written from", name, c10::str(value.sizes()),
                                          c10::str(p.value.sizes())));
          p.value.detach().copy_(value);
          found = true;
          break;
        }
      if (!found)
        throw usage_error(fmt::format("the bundle's parameter '{}' is not in '{}'; replay with the model the "
                                      "bundle was written from", name, a.model));
    }
  }
  if (b.rng_state.defined() && b.rng_state.numel() > 0) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    try {
      gen.set_state(b.rng_state);
    } catch (const c10::Error& e) {
      throw usage_error(fmt::format("the bundle's rng_state cannot be restored: {}", e.what_without_backtrace()));
    }
  }

  per_op_autograd per_op;
  model.train();
  auto params = mirror_parameters(model);
  const at::Tensor x = b.batch[0], y = b.batch[1];
  bool nonfinite = false;
  double loss_value = NAN;
  std::vector<finding> findings;
  {
    tracer t;
    t.name_parameters(*params);
    t.name_tensor(x, "batch[0]");
    t.name_tensor(y, "batch[1]");
    t.set_step(b.step);
    at::Tensor loss;
    try {
      loss = task_loss(forward_tensor(model, x), y, task);
    } catch (const usage_error&) {
      throw;
    } catch (const std::exception& e) {
      throw usage_error(fmt::format("the model cannot run on the bundle's batch {}: {}", c10::str(x.sizes()),
                                    one_line_error(e.what())));
    }
    {
      tracer_pause pause(t);
      loss_value = loss.item<double>();
    }
    if (std::isfinite(loss_value)) {
      (std::isfinite(b.scale) && b.scale != 1.0 ? loss * b.scale : loss).backward();
      tracer_pause pause(t);
      for (const auto& p : params->parameters())
        if (p.grad().defined() && has_nonfinite(p.grad())) nonfinite = true;
    } else {
      nonfinite = true;
    }
    nonfinite = nonfinite || t.found();
    findings = t.findings();
  }

  fmt::print("replay of step {} from {} with {} (task {})\n", b.step, a.bundle, a.model, task);
  if (!nonfinite) {
    fmt::print("not reproduced: the step ran finite (loss {}, gradients finite)\n", number(loss_value));
    if (b.finding) fmt::print("  the bundle's finding was: {}\n", to_string(*b.finding));
    return exit_ok;
  }
  fmt::print("reproduced: loss {}\n", number(loss_value));
  if (findings.empty()) {
    fmt::print("  the tracer named no op (the NaN/Inf was only in the gradients' sum, or allowed by a rule)\n");
    return exit_nonfinite;
  }
  const finding& f = findings.front();
  fmt::print("{}", to_text(f));
  if (!to_text(f).empty() && to_text(f).back() != '\n') fmt::print("\n");
  if (f.role == role::input && f.culprit.rfind("batch[", 0) == 0) {
    // Name the data rows: the bundle keeps the CSV line of each batch row.
    const std::string lines = tag(b, "csv_lines");
    std::vector<std::string> line_of;
    for (size_t pos = 0; !lines.empty() && pos <= lines.size();) {
      const size_t end = lines.find(',', pos);
      line_of.push_back(lines.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
      if (end == std::string::npos) break;
      pos = end + 1;
    }
    const at::Tensor bad = (at::logical_not(at::isfinite(x)).any(1) |
                            at::logical_not(at::isfinite(y.to(at::kDouble)))).contiguous();
    std::vector<std::string> rows;
    for (int64_t i = 0; i < bad.numel(); ++i)
      if (bad.data_ptr<bool>()[i])
        rows.push_back(size_t(i) < line_of.size() ? fmt::format("line {}", line_of[size_t(i)]) : fmt::format("batch row {}", i));
    if (!rows.empty())
      fmt::print("the NaN/Inf came from the data: {} {}\n", tag(b, "data").empty() ? "rows" : tag(b, "data") + ",",
                 fmt::join(rows, ", "));
  }
  if (b.finding) {
    const bool same = b.finding->op == f.op && b.finding->module == f.module && b.finding->direction == f.direction;
    fmt::print("{} the bundle's finding ({})\n", same ? "matches" : "differs from", to_string(*b.finding));
  }
  return exit_nonfinite;
}

}  // namespace

command add_inspect_command(CLI::App& app) {
  auto* sub = app.add_subcommand("inspect", "Show what a repro bundle holds: step, finding, tensors and their census");
  auto a = std::make_shared<inspect_args>();
  sub->add_option("bundle", a->bundle, "the bundle directory (e.g. nanguard-train/bundles/step-000012)")->required();
  sub->footer(exit_codes("shown"));
  return {sub, [a] { return run_inspect(*a); }};
}

command add_replay_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "replay", "Re-run a bundled step of a TorchScript model under the op tracer and print the finding");
  auto a = std::make_shared<replay_args>();
  sub->add_option("bundle", a->bundle, "the bundle directory written by `nanguard train --policy abort`")->required();
  sub->add_option("--model", a->model, "the TorchScript model the bundle was trained with (or a fixed one)")
      ->required();
  sub->add_option("--task", a->task, "classify or regress (default: the task stored in the bundle)")
      ->check(CLI::IsMember({"classify", "regress"}));
  sub->footer(exit_codes("not reproduced (the step ran finite)", "reproduced a NaN/Inf"));
  return {sub, [a] { return run_replay(*a); }};
}

}  // namespace nanguard::cli
