// `nanguard inspect BUNDLE`: what a repro bundle holds, readable (its
// finding, or why it has none, and the guard's note).
// `nanguard replay BUNDLE --model M.pt`: re-runs the bundled step (batch,
// parameters, RNG states) of a TorchScript model through the guard's replay
// (guard::replay: its tracer, its verdict) and prints the finding. Exit code 3 when the step is non-finite again, 0 when
// it runs finite ("not reproduced"), 2 for a missing or malformed bundle.
#include "commands.h"
#include "script_model.h"

#include <nanguard/bundle.h>
#include <nanguard/census.h>
#include <nanguard/finding.h>
#include <nanguard/guard.h>

#include "detail/printable.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

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

// Why a bundle holds no finding, by the verdict of the step's replay.
const char* why_no_finding(verdict v) {
  switch (v) {
    case verdict::none: return "the step was not replayed under the tracer";
    case verdict::reproduced: return "the replay made the NaN/Inf again, and the tracer named no op";
    case verdict::not_reproduced: return "the replay under the tracer ran finite";
    case verdict::replay_failed: return "the replay failed: the note says why";
    case verdict::compiled_only:
      return "only the compiled code made the NaN/Inf: the eager replay under the tracer ran finite; the note "
             "names the compiler's stage";
  }
  return "";
}

int run_inspect(const inspect_args& a) {
  const bundle b = load_bundle(a.bundle);
  fmt::print("repro bundle {}\n", a.bundle);
  fmt::print("  step {}, loss {}, lr {}, loss scale {}, policy {}, verdict {}\n", b.step, number(b.loss),
             number(b.lr), number(b.scale), b.policy ? to_string(*b.policy) : "-",
             b.verdict == verdict::none ? "-" : to_string(b.verdict));
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
    fmt::print("finding: none ({})\n", why_no_finding(b.verdict));
  }
  if (!b.note.empty()) fmt::print("note: {}\n", detail::printable(b.note));
  fmt::print("tensors:\n");
  for (size_t i = 0; i < b.batch.size(); ++i) fmt::print("{}\n", tensor_line(fmt::format("batch[{}]", i), b.batch[i]));
  fmt::print("{}\n", tensor_line("rng_state", b.rng_state));
  for (size_t i = 0; i < b.culprit_inputs.size(); ++i)
    fmt::print("{}\n", tensor_line(fmt::format("culprit_inputs[{}]", i), b.culprit_inputs[i]));
  for (const auto& [name, t] : b.parameters) fmt::print("{}\n", tensor_line("parameters: " + name, t));
  return exit_ok;
}

// The guard that replays a bundle's step of `params` (the model's mirror):
// the bundle's loss scale, and an optimizer that never steps.
struct replay_guard {
  replay_guard(torch::nn::Module& params, const bundle& b)
      : optimizer(params.parameters(), torch::optim::SGDOptions(0.0)), g(params, optimizer, options_of(b)) {}

  static guard_options options_of(const bundle& b) {
    const bool scaled = std::isfinite(b.scale) && b.scale > 0 && b.scale != 1.0;
    return guard_options().scaler(loss_scaler_options()
                                      .enabled(scaled)
                                      .init_scale(scaled ? b.scale : 1.0)
                                      .min_scale(std::min(1.0, scaled ? b.scale : 1.0))
                                      .max_scale(std::max(loss_scaler_options().max_scale(), scaled ? b.scale : 1.0)));
  }

  torch::optim::SGD optimizer;
  guard g;
};

// The rows of the bundle's batch that hold a NaN/Inf, by CSV line when the
// bundle keeps them (its "csv_lines" tag).
std::vector<std::string> bad_rows(const bundle& b) {
  const std::string lines = tag(b, "csv_lines");
  std::vector<std::string> line_of;
  for (size_t pos = 0; !lines.empty() && pos <= lines.size();) {
    const size_t end = lines.find(',', pos);
    line_of.push_back(lines.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  // A row: an index along the first dimension of every tensor of the batch
  // that has as many (an image batch's [n, c, h, w], a target's [n]).
  const int64_t n = b.batch[0].dim() > 0 ? b.batch[0].size(0) : 0;
  at::Tensor bad = at::zeros({n}, at::kBool);
  for (const at::Tensor& t : b.batch)
    if (t.is_floating_point() && t.dim() > 0 && t.size(0) == n)
      bad |= at::logical_not(at::isfinite(t.reshape({n, -1}))).any(1);
  std::vector<std::string> rows;
  for (int64_t i = 0; i < bad.numel(); ++i)
    if (bad.data_ptr<bool>()[i])
      rows.push_back(size_t(i) < line_of.size() ? fmt::format("line {}", line_of[size_t(i)]) : fmt::format("batch row {}", i));
  return rows;
}

// What the replay found: the first finding, the data rows it came from, and
// whether it is the bundle's.
void print_reproduced(const bundle& b, const step_event& e) {
  if (e.findings.empty()) {
    fmt::print("  the tracer named no op (the NaN/Inf was only in the gradients' sum, or allowed by a rule)\n");
    return;
  }
  const finding& f = e.findings.front();
  const std::string text = to_text(f);
  fmt::print("{}{}", text, !text.empty() && text.back() != '\n' ? "\n" : "");
  if (f.role == role::input && f.culprit.rfind("batch[", 0) == 0) {
    const std::vector<std::string> rows = bad_rows(b);
    if (!rows.empty())
      fmt::print("the NaN/Inf came from the data: {} {}\n", tag(b, "data").empty() ? "rows" : tag(b, "data") + ",",
                 fmt::join(rows, ", "));
  }
  if (b.finding) {
    const bool same = b.finding->op == f.op && b.finding->module == f.module && b.finding->direction == f.direction;
    fmt::print("{} the bundle's finding ({})\n", same ? "matches" : "differs from", to_string(*b.finding));
  }
}

// Runs the bundled step again through the guard's replay (the bundle's
// parameters, RNG states and loss scale; the replay's tracer).
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

  const per_op_autograd per_op;
  model.train();
  const auto params = mirror_parameters(model);
  replay_guard r(*params, b);
  at::Tensor loss;  // the replay's
  const step_fn loss_fn = [&](const std::vector<at::Tensor>& batch) {
    loss = task_loss(forward_tensor(model, batch[0]), batch[1], task);
    return loss;
  };
  step_event e;
  try {
    e = r.g.replay(b, loss_fn);
  } catch (const c10::Error& error) {
    throw usage_error(fmt::format("cannot replay '{}' with '{}': {}", a.bundle, a.model,
                                  error.what_without_backtrace()));
  }
  if (e.verdict == verdict::replay_failed)
    throw usage_error(fmt::format("the model cannot run on the bundle's batch {}: {}", c10::str(b.batch[0].sizes()),
                                  one_line_error(e.note)));

  const double loss_value = loss.defined() ? loss.item<double>() : NAN;
  fmt::print("replay of step {} from {} with {} (task {})\n", b.step, a.bundle, a.model, task);
  if (e.verdict == verdict::not_reproduced) {
    fmt::print("not reproduced: the step ran finite (loss {}, gradients finite)\n", number(loss_value));
    if (b.finding) fmt::print("  the bundle's finding was: {}\n", to_string(*b.finding));
    return exit_ok;
  }
  fmt::print("reproduced: loss {}\n", number(loss_value));
  print_reproduced(b, e);
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
