// `nanguard advise --model M.pt --data D.csv --target COL`: runs a few fp32
// steps of a TorchScript model on CSV data under the precision advisor, says
// what float16 and bfloat16 would do, and checks the advice by running the
// model with every op output rounded to float16 (all modules, then with the
// advised modules kept in fp32) and under bfloat16 CPU autocast.
// Exit code 3 when the model is already non-finite in float32.
#include "commands.h"
#include "data_common.h"
#include "script_model.h"
#include "validators.h"

#include <nanguard/census.h>
#include <nanguard/csv.h>
#include <nanguard/precision.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/script.h>

#include <algorithm>
#include <set>

namespace nanguard::cli {
namespace {

struct advise_args {
  std::string model;
  std::string data;
  std::string target;
  std::string task = "regress";
  int64_t steps = 3;
  int64_t batch = 32;
  bool json = false;
};

// The task's loss (script_model.h), after checking that classification
// labels are integers the model's logits can index.
at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y, const std::string& task) {
  if (task == "classify" && out.dim() == 2 && out.size(0) == y.size(0)) {
    const at::Tensor labels = y.to(at::kLong);
    if (!at::equal(labels.to(at::kFloat), y) || labels.min().item<int64_t>() < 0 ||
        labels.max().item<int64_t>() >= out.size(1))
      throw usage_error(fmt::format("--task classify needs integer class labels in [0, {}) in the target column",
                                    out.size(1)));
  }
  return task_loss(out, y, task);
}

struct verification {
  std::vector<std::string> fp16_producers;
  std::string fp16_first;
  bool fp16_finite = false;
  bool fp16_kept_finite = false;
  bool bf16_finite = false;
  bool confirmed = false;
};

verification verify(torch::jit::Module& m, const at::Tensor& x, const precision_report& r) {
  torch::NoGradGuard no_grad;
  verification v;
  {
    precision_emulator fp16;
    v.fp16_finite = !has_nonfinite(forward_tensor(m, x));
    v.fp16_producers = fp16.producers();
    if (!fp16.first().op.empty())
      v.fp16_first = fmt::format("{} in {}", fp16.first().op, fp16.first().module.empty() ? "(top level)" : fp16.first().module);
  }
  {
    precision_emulator fp16(emulator_options().keep_fp32(r.keep_fp32));
    v.fp16_kept_finite = !has_nonfinite(forward_tensor(m, x));
  }
  {
    cpu_autocast bf16;
    v.bf16_finite = !has_nonfinite(forward_tensor(m, x));
  }
  const std::set<std::string> predicted(r.keep_fp32.begin(), r.keep_fp32.end());
  const std::set<std::string> seen(v.fp16_producers.begin(), v.fp16_producers.end());
  v.confirmed = v.fp16_kept_finite && (r.bf16_safe == v.bf16_finite) &&
                (predicted.empty() ? v.fp16_finite : std::includes(predicted.begin(), predicted.end(), seen.begin(), seen.end()) && !seen.empty());
  return v;
}

std::string list(const std::vector<std::string>& v) {
  std::vector<std::string> named;
  for (const auto& s : v) named.push_back(s.empty() ? "(top level)" : s);
  return named.empty() ? "none" : fmt::format("{}", fmt::join(named, ", "));
}

int run_advise(const advise_args& a) {
  if (a.batch < 1) throw usage_error(fmt::format("--batch must be at least 1, got {}", a.batch));
  torch::jit::Module model = load_script_model(a.model);
  const csv_table table = as_input_error([&] { return read_csv(a.data); });
  const int64_t target = find_column(table.columns, a.target, a.data);
  std::vector<int64_t> feature_columns;
  for (int64_t j = 0; j < int64_t(table.columns.size()); ++j)
    if (j != target) feature_columns.push_back(j);
  if (feature_columns.empty()) throw usage_error(fmt::format("'{}' has no feature columns besides '{}'", a.data, a.target));

  const at::Tensor finite_rows = at::isfinite(table.data).all(1);
  const at::Tensor data = table.data.index({finite_rows});
  const int64_t dropped = table.data.size(0) - data.size(0);
  if (data.size(0) == 0)
    throw usage_error(fmt::format("'{}' has no rows with all values finite (run nanguard scan {})", a.data, a.data));
  const at::Tensor x_all = data.index_select(1, at::tensor(feature_columns, at::kLong)).to(at::kFloat);
  const at::Tensor y_all = data.select(1, target).to(at::kFloat);
  const int64_t n = x_all.size(0);
  const int64_t b = std::min(a.batch, n);

  std::vector<std::pair<at::Tensor, at::Tensor>> batches;  // made before the advisor: not the model's ops
  for (int64_t step = 0; step < a.steps; ++step) {
    const at::Tensor idx = at::arange(step * b, (step + 1) * b, at::kLong).remainder(n);
    batches.emplace_back(x_all.index_select(0, idx), y_all.index_select(0, idx));
  }

  per_op_autograd per_op;
  model.train();
  precision_advisor advisor;
  advisor.name_parameters(model);
  for (const auto& [x, y] : batches) {
    const at::Tensor loss = loss_of(forward_tensor(model, x), y, a.task);
    loss.backward();
    advisor.end_step();
    for (auto p : model.parameters())
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
  }
  const precision_report report = advisor.report();
  advisor.pause();  // the verification runs are not measured
  const verification v = verify(model, x_all.slice(0, 0, b), report);

  if (a.json) {
    nlohmann::json j = nlohmann::json::parse(to_json(report));
    j["model"] = a.model;
    j["data"] = a.data;
    j["rows"] = n;
    j["rows_dropped"] = dropped;
    j["verification"] = {{"fp16_nonfinite_modules", v.fp16_producers},
                         {"fp16_first", v.fp16_first},
                         {"fp16_finite", v.fp16_finite},
                         {"fp16_with_keep_fp32_finite", v.fp16_kept_finite},
                         {"bf16_autocast_finite", v.bf16_finite},
                         {"confirmed", v.confirmed}};
    fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}: {} steps of {} rows from {} ({} rows{}), task {}\n", a.model, a.steps, b, a.data, n,
               dropped ? fmt::format(", {} with missing or non-finite values dropped", dropped) : "", a.task);
    fmt::print("{}", to_text(report));
    fmt::print("verification on one batch:\n");
    fmt::print("  emulated fp16 (every op output rounded): {}; modules that went non-finite: {}{}\n",
               v.fp16_finite ? "finite" : "NON-FINITE", list(v.fp16_producers),
               v.fp16_first.empty() ? "" : fmt::format(" (first: {})", v.fp16_first));
    fmt::print("  emulated fp16 keeping {} in fp32: {}\n", list(report.keep_fp32),
               v.fp16_kept_finite ? "finite" : "NON-FINITE");
    fmt::print("  bf16 CPU autocast: {}\n", v.bf16_finite ? "finite" : "NON-FINITE");
    fmt::print("  advice {}\n", v.confirmed ? "confirmed" : "NOT confirmed: the emulation disagrees (see above)");
  }
  return report.fp32_nonfinite ? exit_nonfinite : exit_ok;
}

}  // namespace

command add_advise_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "advise", "Will a TorchScript model survive fp16/bf16? Measures a few fp32 steps on CSV data and advises");
  auto a = std::make_shared<advise_args>();
  sub->add_option("--model", a->model, "TorchScript model (torch.jit.script(model).save(path))")->required();
  sub->add_option("--data", a->data, "CSV training data with a header row")->required();
  sub->add_option("--target", a->target, "the target column; the others are the features")->required();
  sub->add_option("--task", a->task, "classify (cross entropy, integer labels) or regress (MSE)")
      ->check(CLI::IsMember({"classify", "regress"}))
      ->capture_default_str();
  sub->add_option("--steps", a->steps, "forward+backward steps to measure (parameters are not updated)")
      ->capture_default_str()
      ->check(integer_in<int64_t>(1, max_steps));
  sub->add_option("--batch", a->batch, "rows per step")->capture_default_str();
  sub->add_flag("--json", a->json, "print the report as JSON");
  sub->footer(exit_codes("advice given", "the fp32 steps themselves went non-finite (fix that first)"));
  return {sub, [a] { return run_advise(*a); }};
}

}  // namespace nanguard::cli
