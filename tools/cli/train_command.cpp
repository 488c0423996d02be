// `nanguard train --model M.pt --data D.csv --target COL --task classify|regress`:
// trains a TorchScript model on a CSV file under the guard, so anyone can
// diagnose a model without writing C++. Each batch goes through the data
// firewall (off, drop, repair); each step through nanguard::guard, whose
// replay (or a tracer on every step, --trace always) names the op that made
// a NaN/Inf. Writes DIR/events.jsonl, DIR/summary.json, DIR/report.html and
// DIR/bundles/ (policy abort), into a DIR locked for the run and cleared of a
// previous run's outputs first (run_dir.h). Exit code 0 when the run
// finished (finite or recovered), 3 when it stopped on a non-finite value
// (--policy abort) or ended non-finite (the optimizer took none of its last
// steps/10, 1 to 10).
#include "commands.h"
#include "data_common.h"
#include "progress.h"
#include "run_dir.h"
#include "script_model.h"
#include "temp_file.h"
#include "validators.h"

#include <nanguard/census.h>
#include <nanguard/csv.h>
#include <nanguard/events.h>
#include <nanguard/firewall.h>
#include <nanguard/guard.h>
#include <nanguard/report.h>
#include <nanguard/schedule.h>
#include <nanguard/tracer.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <set>

namespace nanguard::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct train_args {
  std::string model;
  std::string data;
  std::string target;
  std::string task;
  int64_t steps = 100;
  int64_t batch = 32;
  double lr = 1e-3;
  std::string optimizer = "adamw";
  double clip = 0.0;
  int64_t warmup = 0;
  std::string policy = "skip";
  std::string firewall = "off";
  std::string trace = "on-failure";
  uint64_t seed = 0;
  std::string out = "nanguard-train";
  std::string device = "cpu";
};

// The CSV file in memory, each row with the file line it came from.
struct table {
  std::vector<std::string> columns;
  at::Tensor data;             // [rows, columns] float64
  std::vector<int64_t> lines;  // 1-based file line of each row
};

table read_table(const std::string& path) {
  auto in = open_csv(path);
  table t;
  t.columns = in->columns();
  std::vector<double> values;
  as_input_error([&] {
    while (in->read_rows(values, 1) == 1) t.lines.push_back(in->line());
  });
  const int64_t rows = int64_t(t.lines.size()), cols = int64_t(t.columns.size());
  t.data = at::from_blob(values.data(), {rows, cols}, at::kDouble).clone();
  return t;
}

// One batch ready for the guard, with the file lines of its rows.
struct batch {
  at::Tensor x, y;
  std::vector<int64_t> lines;
};

// CSV lines of the rows of `b` holding a NaN/Inf in the features or the target.
std::vector<int64_t> nonfinite_lines(const batch& b) {
  const at::Tensor bad = at::logical_not(at::isfinite(b.x)).any(1) | at::logical_not(at::isfinite(b.y.to(at::kDouble)));
  std::vector<int64_t> out;
  const at::Tensor flags = bad.contiguous();
  const bool* p = flags.data_ptr<bool>();
  for (int64_t i = 0; i < flags.numel(); ++i)
    if (p[i]) out.push_back(b.lines[size_t(i)]);
  return out;
}

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// The JSON of the first non-finite step: the finding's essentials.
json first_json(const step_event& e, const std::vector<int64_t>& rows) {
  json j;
  j["step"] = e.step;
  if (e.findings.empty()) {
    for (const char* k : {"direction", "op", "module", "role", "cause", "evidence", "remedy", "confidence"})
      j[k] = nullptr;
  } else {
    const finding& f = e.findings.front();
    j["direction"] = to_string(f.direction);
    j["op"] = f.op;
    j["module"] = f.module;
    j["role"] = to_string(f.role);
    if (f.direction == direction::backward) {
      j["node"] = f.node;
      j["forward_op"] = f.forward_op;
    }
    if (!f.culprit.empty()) j["culprit"] = f.culprit;
    j["index"] = f.index;
    j["value"] = std::isnan(f.value)   ? json("nan")
                 : std::isinf(f.value) ? json(f.value > 0 ? "inf" : "-inf")
                                       : json(f.value);
    j["cause"] = to_string(f.diagnosis.cause);
    j["evidence"] = f.diagnosis.evidence;
    j["remedy"] = f.diagnosis.remedy;
    j["confidence"] = to_string(f.diagnosis.confidence);
  }
  // The CSV lines of the step's rows holding a NaN/Inf: the data's share,
  // whatever the role (the tracer names a value that flowed through a
  // composite op such as mse_loss as that op's product).
  if (!rows.empty()) j["rows"] = rows;
  j["verdict"] = e.verdict;
  std::vector<std::string> params;
  for (const auto& p : e.nonfinite_params) params.push_back(p.name);
  j["parameters"] = params;
  return j;
}

// What an abort's bundle says of the run and the batch (`nanguard replay`
// reads the task, and names the CSV lines of a NaN in the data).
bundle_tag_list bundle_tags(const train_args& a, const batch& b) {
  std::string lines;
  for (int64_t l : b.lines) lines += (lines.empty() ? "" : ",") + std::to_string(l);
  return {{"task", a.task}, {"model", a.model}, {"data", a.data}, {"target", a.target}, {"csv_lines", lines}};
}

std::string describe(const finding& f) {
  std::string s = fmt::format("step {} {} {}", f.step, to_string(f.direction), f.op);
  if (f.direction == direction::backward && !f.node.empty())
    s += fmt::format(" (in {}{})", f.node, f.forward_op.empty() ? "" : ", the backward of " + f.forward_op);
  s += fmt::format(" in {}: {}", f.module.empty() ? "(top level)" : f.module, to_string(f.role));
  if (!f.culprit.empty()) s += fmt::format(" ({})", f.culprit);
  return s;
}

void validate(const train_args& a) {
  if (a.device == "cuda" && !at::hasCUDA())
    throw usage_error("--device cuda: no CUDA device found (torch sees none); train with --device cpu");
  if (a.steps < 1) throw usage_error(fmt::format("--steps must be at least 1, got {}", a.steps));
  if (a.batch < 1) throw usage_error(fmt::format("--batch must be at least 1, got {}", a.batch));
  if (!(a.lr > 0) || !std::isfinite(a.lr))
    throw usage_error(fmt::format("--lr must be a finite number > 0, got {}; e.g. 1e-3", a.lr));
  if (!(a.clip >= 0) || !std::isfinite(a.clip))
    throw usage_error(fmt::format("--clip must be a finite number >= 0 (0: no clipping), got {}", a.clip));
  if (a.warmup < 0 || a.warmup >= a.steps)
    throw usage_error(fmt::format("--warmup must be in [0, --steps) = [0, {}), got {}", a.steps, a.warmup));
}

int run_train(const train_args& a) {
  validate(a);
  torch::jit::Module model = load_script_model(a.model);
  const table t = read_table(a.data);
  const int64_t target = find_column(t.columns, a.target, a.data);
  std::vector<int64_t> feature_columns;
  std::vector<std::string> feature_names;
  for (int64_t j = 0; j < int64_t(t.columns.size()); ++j)
    if (j != target) {
      feature_columns.push_back(j);
      feature_names.push_back(t.columns[size_t(j)]);
    }
  if (feature_columns.empty())
    throw usage_error(fmt::format("'{}' has no feature columns besides the target '{}'", a.data, a.target));
  const int64_t n = t.data.size(0), features = int64_t(feature_columns.size());
  if (n == 0) throw usage_error(fmt::format("'{}' has no data rows", a.data));
  // The firewall sees the features and then the target (a label column:
  // never repaired, its row dropped when not finite).
  std::vector<int64_t> order = feature_columns;
  order.push_back(target);
  const at::Tensor data = t.data.index_select(1, at::tensor(order, at::kLong));
  const at::Tensor target_values = data.select(1, features);

  // Labels must be class indices; data rows with a non-finite target are
  // the firewall's to drop, but without one they cannot be classified.
  const at::Tensor target_finite = at::isfinite(target_values);
  if (a.task == "classify") {
    if (a.firewall == "off" && !target_finite.all().item<bool>()) {
      const int64_t row = at::logical_not(target_finite).nonzero()[0][0].item<int64_t>();
      throw usage_error(fmt::format("the target '{}' is not finite on line {} of '{}'; --task classify needs "
                                    "integer labels (or pass --firewall drop to drop such rows)",
                                    a.target, t.lines[size_t(row)], a.data));
    }
    const at::Tensor ok = target_values.index({target_finite});
    if (ok.numel() > 0 && !at::equal(ok.round(), ok))
      throw usage_error(fmt::format("--task classify needs integer class labels in the target '{}' of '{}'; "
                                    "use --task regress for a continuous target", a.target, a.data));
  }
  if (a.firewall == "drop" && !at::isfinite(data).all(1).any().item<bool>())
    throw usage_error(fmt::format("every row of '{}' holds a NaN/Inf: --firewall drop would leave no data; "
                                  "try --firewall repair", a.data));

  // The model must fit the features: try it on one batch before training
  // (with autograd on: its output must depend on trainable parameters).
  per_op_autograd per_op;
  const int64_t b = std::min(a.batch, n);
  {
    model.eval();  // the probe must not move batch-norm statistics
    const at::Tensor probe = data.slice(0, 0, b).slice(1, 0, features).nan_to_num(0.0).to(at::kFloat);
    at::Tensor out;
    try {
      out = forward_tensor(model, probe);
    } catch (const usage_error&) {
      throw;
    } catch (const std::exception& e) {
      for (const auto& p : model.named_parameters())
        if (p.value.dim() == 2 && p.value.size(1) != features)
          throw usage_error(fmt::format(
              "the model expects {} input features (its first weight '{}' is {}) but '{}' has {} feature "
              "columns besides the target '{}' ({}); make the CSV columns match the model",
              p.value.size(1), p.name, c10::str(p.value.sizes()), a.data, features, a.target,
              fmt::join(feature_names, ", ")));
        else if (p.value.dim() == 2) break;
      throw usage_error(fmt::format("the model cannot run on a [{}, {}] batch of '{}': {}", b, features, a.data,
                                    one_line_error(e.what())));
    }
    if (a.task == "classify") {
      if (out.dim() != 2 || out.size(0) != b)
        throw usage_error(fmt::format("--task classify needs [rows, classes] logits; the model returned shape {}",
                                      c10::str(out.sizes())));
      const at::Tensor ok = target_values.index({target_finite});
      if (ok.numel() > 0 && (ok.min().item<double>() < 0 || ok.max().item<double>() >= double(out.size(1))))
        throw usage_error(fmt::format("--task classify: the model returns {} classes, so the labels in '{}' must "
                                      "be in [0, {}), but they span [{}, {}]", out.size(1), a.target, out.size(1),
                                      ok.min().item<double>(), ok.max().item<double>()));
    } else if (out.numel() != b) {
      throw usage_error(fmt::format("--task regress needs one output per row; the model returned shape {} for {} rows",
                                    c10::str(out.sizes()), b));
    }
    require_trainable(out);
  }

  model.train();
  const at::Device device(a.device);
  model.to(device);
  const run_directory out_dir(a.out, {"events.jsonl", "summary.json", "report.html", "bundles"},
                              {{"--model", a.model}, {"--data", a.data}});
  const std::string events_path = out_dir / "events.jsonl";
  const std::string bundle_dir = out_dir / "bundles";

  // The guard trains the script module's own tensors through the mirror.
  auto params = mirror_parameters(model);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (a.optimizer == "sgd")
    optimizer = std::make_unique<torch::optim::SGD>(params->parameters(), torch::optim::SGDOptions(a.lr));
  else
    optimizer = std::make_unique<torch::optim::AdamW>(params->parameters(), torch::optim::AdamWOptions(a.lr));
  guard_options options;
  options.policy(a.policy == "backoff"    ? policy::backoff
                 : a.policy == "rollback" ? policy::rollback
                 : a.policy == "abort"    ? policy::abort
                                          : policy::skip)
      .max_norm(a.clip)
      .replay(a.trace == "on-failure")
      .snapshot_every(std::clamp<int64_t>(a.steps / 10, 1, 100))
      .event_log(events_path)
      .bundle_dir(bundle_dir);
  if (a.trace == "always") options.trace_every_step(true).tracer(tracer_options());
  if (a.warmup > 0)
    options.schedule(schedule_options(a.lr).warmup_steps(a.warmup).total_steps(a.steps).min_lr(a.lr));
  guard g = as_input_error([&] { return guard(*params, *optimizer, options); });  // a log it cannot open: exit 2

  std::optional<firewall> fw;
  if (a.firewall != "off") {
    std::vector<std::string> names = feature_names;
    names.push_back(a.target);
    fw.emplace(firewall_options()
                   .nonfinite(a.firewall == "drop" ? nonfinite_policy::drop : nonfinite_policy::impute_median)
                   .label_columns({features})
                   .column_names(names));
    fw->fit(data);
  }

  // Batches: a fresh permutation of the rows every epoch, from --seed.
  std::mt19937_64 shuffle_rng(a.seed);
  std::vector<int64_t> perm(static_cast<size_t>(n));
  size_t cursor = perm.size();
  std::set<int64_t> dropped_lines, repaired_lines;
  const auto next_batch = [&]() -> batch {
    for (;;) {
      std::vector<int64_t> rows;
      while (int64_t(rows.size()) < b) {
        if (cursor == perm.size()) {
          std::iota(perm.begin(), perm.end(), int64_t(0));
          std::shuffle(perm.begin(), perm.end(), shuffle_rng);
          cursor = 0;
        }
        rows.push_back(perm[cursor++]);
      }
      at::Tensor m = data.index_select(0, at::tensor(rows, at::kLong));
      batch out;
      for (int64_t r : rows) out.lines.push_back(t.lines[size_t(r)]);
      if (fw) {
        firewall_result res = fw->apply(m);
        std::vector<int64_t> kept;
        std::set<int64_t> dropped(res.report.dropped_rows.begin(), res.report.dropped_rows.end());
        for (int64_t i : res.report.dropped_rows) dropped_lines.insert(out.lines[size_t(i)]);
        for (int64_t i : res.report.changed_rows) repaired_lines.insert(out.lines[size_t(i)]);
        for (int64_t i = 0; i < int64_t(out.lines.size()); ++i)
          if (!dropped.count(i)) kept.push_back(out.lines[size_t(i)]);
        out.lines = kept;
        m = res.batch;
      }
      if (m.size(0) == 0) continue;  // every row dropped: draw the next batch
      out.x = m.slice(1, 0, features).to(at::kFloat).contiguous();
      const at::Tensor y = m.select(1, features);
      out.y = a.task == "classify" ? y.to(at::kLong) : y.to(at::kFloat).contiguous();
      return out;
    }
  };

  at::manual_seed(a.seed);  // dropout and any other randomness of the model
  const step_fn fn = [&](const std::vector<at::Tensor>& bt) {
    return task_loss(forward_tensor(model, bt[0]), bt[1], a.task);
  };
  std::optional<step_event> first_bad;  // the first step the guard acted on or the tracer found something in
  bool guard_acted = false;
  std::vector<int64_t> first_rows;
  int64_t steps_run = 0, last_taken_step = 0;
  double last_taken_loss = NAN;  // the loss of the last step the optimizer took
  bool aborted = false;
  std::string bundle_path;
  {
    progress bar(a.steps, "train");
    for (int64_t step = 1; step <= a.steps; ++step) {
      const batch bt = next_batch();
      const std::vector<at::Tensor> tensors = {bt.x.to(device), bt.y.to(device)};
      g.set_bundle_tags(bundle_tags(a, bt));
      step_event e;
      try {
        e = g.step(tensors, fn);
      } catch (const nonfinite_error&) {
        e = g.last_event();  // the abort's, with its bundle
        aborted = true;
        bundle_path = e.bundle;
      } catch (const event_log_error& err) {
        throw usage_error(err.what_without_backtrace());  // a full disk is exit 2, as for the other outputs
      }
      ++steps_run;
      guard_acted |= e.skipped;
      const bool bad = e.skipped || !e.findings.empty();
      if (bad && !first_bad) {
        first_bad = e;
        first_rows = nonfinite_lines(bt);
      }
      if (!e.skipped) {
        last_taken_step = step;
        last_taken_loss = e.loss;
      }
      bar.update(e);
      if (aborted) break;
    }
    bar.finish();
  }

  // ---- summary
  // Ended non-finite: aborted, or the optimizer could take none of the last
  // few steps (a lone skipped batch of bad data at the end is not that).
  const int64_t window = std::clamp<int64_t>(a.steps / 10, 1, 10);
  const bool final_finite = !aborted && steps_run - last_taken_step < window && last_taken_step > 0;
  // Recovered only when the guard acted: a finding on a step that stayed
  // finite (--trace always) is shown, but nothing was recovered from.
  const std::string status = !final_finite ? "nonfinite" : guard_acted ? "recovered" : "finite";
  json s;
  s["status"] = status;
  s["steps"] = steps_run;
  s["final_loss"] = final_finite ? json(last_taken_loss) : json(nullptr);
  s["first_nonfinite"] = first_bad ? first_json(*first_bad, first_rows) : json(nullptr);
  s["data"] = {{"rows", n},
               {"rows_dropped", int64_t(dropped_lines.size())},
               {"rows_repaired", int64_t(repaired_lines.size())},
               {"firewall", a.firewall}};
  s["skipped_steps"] = g.skipped();
  s["rollbacks"] = g.rollbacks();
  s["lr_factor"] = g.lr_factor();
  s["policy"] = a.policy;
  s["trace"] = a.trace;
  s["bundle"] = bundle_path.empty() ? json(nullptr) : json(bundle_path);
  s["events"] = events_path;
  s["model"] = a.model;
  s["data_file"] = a.data;
  s["task"] = a.task;
  const std::string summary_path = out_dir / "summary.json";
  const std::string report_path = out_dir / "report.html";
  write_file_atomically(report_path,
                        render_html_report({{fs::path(a.model).stem().string(), read_events(events_path)}},
                                           fmt::format("nanguard train: {} on {}", a.model, a.data)));
  s["report"] = report_path;
  write_file_atomically(summary_path, s.dump(2) + "\n");

  fmt::print("nanguard train: {}\n", status == "nonfinite" ? "NON-FINITE" : status);
  fmt::print("  steps: {} of {}{}{}; final loss {}\n", steps_run, a.steps,
             g.skipped() ? fmt::format(", {} skipped", g.skipped()) : "",
             g.rollbacks() ? fmt::format(", {} rollbacks (LR x{:.4g})", g.rollbacks(), g.lr_factor()) : "",
             final_finite ? fmt::format("{:.6g}", last_taken_loss) : "not finite");
  if (first_bad) {
    if (first_bad->findings.empty()) {
      fmt::print("  first non-finite: step {} (no op named: {})\n", first_bad->step,
                 a.trace == "off" ? "--trace off" : first_bad->verdict.empty() ? "no replay" : first_bad->verdict);
    } else {
      const finding& f = first_bad->findings.front();
      fmt::print("  first non-finite: {}\n", describe(f));
      fmt::print("  likely cause: {} ({} confidence): {}\n", to_string(f.diagnosis.cause),
                 to_string(f.diagnosis.confidence), f.diagnosis.evidence);
      fmt::print("  remedy: {}\n", f.diagnosis.remedy);
    }
    if (!first_rows.empty())
      fmt::print("  the NaN/Inf came from the data: {} line{} {}\n", a.data, first_rows.size() > 1 ? "s" : "",
                 fmt::join(first_rows, ", "));
  }
  if (fw)
    fmt::print("  data firewall ({}): {} rows dropped, {} rows repaired\n", a.firewall, dropped_lines.size(),
               repaired_lines.size());
  if (!bundle_path.empty()) fmt::print("  repro bundle: {} (nanguard inspect / nanguard replay)\n", bundle_path);
  fmt::print("  wrote {}, {}, {}\n", summary_path, events_path, report_path);
  return status == "nonfinite" ? exit_nonfinite : exit_ok;
}

}  // namespace

command add_train_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "train", "Train a TorchScript model on a CSV file under the guard; name the op of the first NaN/Inf");
  auto a = std::make_shared<train_args>();
  sub->add_option("--model", a->model, "TorchScript model (torch.jit.script(model).save(path)); takes [batch, features]")
      ->required();
  sub->add_option("--data", a->data, "CSV training data with a header row")->required();
  sub->add_option("--target", a->target, "the target column; the others are the features")->required();
  sub->add_option("--task", a->task, "classify ([batch, classes] logits, integer labels) or regress ([batch] outputs)")
      ->required()
      ->check(CLI::IsMember({"classify", "regress"}));
  sub->add_option("--steps", a->steps, "training steps")->capture_default_str();
  sub->add_option("--batch", a->batch, "rows per step")->capture_default_str();
  sub->add_option("--lr", a->lr, "learning rate")->capture_default_str();
  sub->add_option("--optimizer", a->optimizer, "adamw or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->capture_default_str();
  sub->add_option("--clip", a->clip, "clip the global grad norm to this (0: off)")->capture_default_str();
  sub->add_option("--warmup", a->warmup, "steps of linear LR warmup")->capture_default_str();
  sub->add_option("--policy", a->policy, "on a non-finite step: skip, backoff (as skip: fp32 training runs without a loss scaler), "
                  "rollback (restore + halve LR) or abort (bundle, exit 3)")
      ->check(CLI::IsMember({"skip", "backoff", "rollback", "abort"}))
      ->capture_default_str();
  sub->add_option("--firewall", a->firewall, "NaN/Inf in a batch: off, drop the rows, or repair (impute the median)")
      ->check(CLI::IsMember({"off", "drop", "repair"}))
      ->capture_default_str();
  sub->add_option("--trace", a->trace, "op tracer: on-failure (replay a bad step), always (every step) or off")
      ->check(CLI::IsMember({"always", "on-failure", "off"}))
      ->capture_default_str();
  sub->add_option("--seed", a->seed, "seed of the batch order and the model's randomness")
      ->capture_default_str()
      ->check(non_negative_integer());
  sub->add_option("--out", a->out, "output directory: events.jsonl, summary.json, report.html, bundles/")->capture_default_str();
  sub->add_option("--device", a->device, "where the model trains: cpu, or cuda (the current GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->footer(exit_codes("the run finished finite or recovered",
                         "it stopped on a NaN/Inf (--policy abort) or ended non-finite (none of its last steps/10, "
                         "1 to 10, could be taken)") +
              "\n--out is locked while the run lasts: a second run into it exits 2 and names the first.");
  return {sub, [a] { return run_train(*a); }};
}

}  // namespace nanguard::cli
