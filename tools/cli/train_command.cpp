// `nanguard train --model M.pt --data D.csv --target COL --task classify|regress`:
// trains a TorchScript model on a CSV file under the guard, so anyone can
// diagnose a model without writing C++. Each batch goes through the data
// firewall (off, drop, repair); each step through nanguard::guard, whose
// replay (or a tracer on every step, --trace always) names the op that made
// a NaN/Inf. Writes DIR/events.jsonl, DIR/summary.json, DIR/report.html and
// DIR/bundles/ (policy abort), into a DIR locked for the run and cleared of a
// previous run's outputs first (run_dir.h). Its status is run_status's
// (run_summary.h), as `nanguard report` shows it. Exit code 0 when the run
// ended finite (finite, recovered or unrecovered: it ended taking steps at a
// finite loss), 3 when it stopped on a non-finite value (--policy abort) or
// ended non-finite (the optimizer took none of its last steps/10, 1 to 10).
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
#include <nanguard/remedy_check.h>
#include <nanguard/report.h>
#include <nanguard/run_summary.h>
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
  std::string policy = "auto";
  std::string firewall = "off";
  std::string trace = "on-failure";
  bool no_verify_remedies = false;
  bool auto_fix = false;
  uint64_t seed = 0;
  std::string out = "nanguard-train";
  std::string device = "cpu";
  bool quiet = false;
  std::string inject;  // a planted fault (fault_spec_from_string's text), "" none
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
    // The remedies the guard checked on replays of the step, as the finding's JSON has them.
    j["remedy_checks"] = json::parse(to_json(f)).at("remedy_checks");
  }
  // The CSV lines of the step's rows holding a NaN/Inf: the data's share,
  // whatever the role (the tracer names a value that flowed through a
  // composite op such as mse_loss as that op's product).
  if (!rows.empty()) j["rows"] = rows;
  j["verdict"] = to_string(e.verdict);
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
  if (a.batch < 1) throw usage_error(fmt::format("--batch must be at least 1, got {}", a.batch));
  if (!(a.lr > 0) || !std::isfinite(a.lr))
    throw usage_error(fmt::format("--lr must be a finite number > 0, got {}; e.g. 1e-3", a.lr));
  if (!(a.clip >= 0) || !std::isfinite(a.clip))
    throw usage_error(fmt::format("--clip must be a finite number >= 0 (0: no clipping), got {}", a.clip));
  if (a.warmup < 0 || a.warmup >= a.steps)
    throw usage_error(fmt::format("--warmup must be in [0, --steps) = [0, {}), got {}", a.steps, a.warmup));
}

// The training rows, their columns in the order the firewall sees them: the
// features, then the target (a label column: never repaired, its row
// dropped when not finite).
struct training_data {
  at::Tensor values;                       // [rows, features + 1] float64
  std::vector<std::string> feature_names;  // the CSV's columns but the target, in order
  std::vector<int64_t> lines;              // 1-based file line of each row

  int64_t rows() const { return values.size(0); }
  int64_t features() const { return int64_t(feature_names.size()); }
  at::Tensor target() const { return values.select(1, features()); }
  at::Tensor finite_targets() const { return target().index({at::isfinite(target())}); }
};

// Reads --data; a usage_error when it has no --target column, no other
// column or no rows.
training_data read_training_data(const train_args& a) {
  table t = read_table(a.data);
  const int64_t target = find_column(t.columns, a.target, a.data);
  training_data d;
  std::vector<int64_t> order;
  for (int64_t j = 0; j < int64_t(t.columns.size()); ++j)
    if (j != target) {
      order.push_back(j);
      d.feature_names.push_back(t.columns[size_t(j)]);
    }
  if (order.empty())
    throw usage_error(fmt::format("'{}' has no feature columns besides the target '{}'", a.data, a.target));
  if (t.data.size(0) == 0) throw usage_error(fmt::format("'{}' has no data rows", a.data));
  order.push_back(target);
  d.values = t.data.index_select(1, at::tensor(order, at::kLong));
  d.lines = std::move(t.lines);
  return d;
}

// Labels must be class indices; data rows with a non-finite target are the
// firewall's to drop, but without one they cannot be classified. And
// --firewall drop must leave some rows.
void check_targets(const train_args& a, const training_data& d) {
  if (a.task == "classify") {
    const at::Tensor finite = at::isfinite(d.target());
    if (a.firewall == "off" && !finite.all().item<bool>()) {
      const int64_t row = at::logical_not(finite).nonzero()[0][0].item<int64_t>();
      throw usage_error(fmt::format("the target '{}' is not finite on line {} of '{}'; --task classify needs "
                                    "integer labels (or pass --firewall drop to drop such rows)",
                                    a.target, d.lines[size_t(row)], a.data));
    }
    const at::Tensor ok = d.finite_targets();
    if (ok.numel() > 0 && !at::equal(ok.round(), ok))
      throw usage_error(fmt::format("--task classify needs integer class labels in the target '{}' of '{}'; "
                                    "use --task regress for a continuous target", a.target, a.data));
  }
  if (a.firewall != "off") {
    // Neither policy saves such a column: repair has no median, drop no row.
    const at::Tensor any_finite = at::isfinite(d.values).any(0);
    std::vector<std::string> never_finite;
    for (int64_t j = 0; j < d.features(); ++j)
      if (!any_finite[j].item<bool>()) never_finite.push_back("'" + d.feature_names[size_t(j)] + "'");
    if (!never_finite.empty())
      throw usage_error(fmt::format("no value of column {} of '{}' is finite: --firewall {} cannot train on it ({}); "
                                    "remove the column from the data", fmt::join(never_finite, ", "), a.data,
                                    a.firewall, a.firewall == "repair" ? "no median to impute" : "no row left"));
  }
  if (a.firewall == "drop" && !at::isfinite(d.values).all(1).any().item<bool>())
    throw usage_error(fmt::format("every row of '{}' holds a NaN/Inf: --firewall drop would leave no data; "
                                  "try --firewall repair", a.data));
}

// Why the model cannot run on a [rows, features] batch: its first weight's
// width when that is not the number of features, else TorchScript's error `e`.
usage_error probe_failure(const torch::jit::Module& model, const train_args& a, const training_data& d, int64_t rows,
                          const std::exception& e) {
  for (const auto& p : model.named_parameters()) {
    if (p.value.dim() != 2) continue;
    if (p.value.size(1) != d.features())
      return usage_error(fmt::format(
          "the model expects {} input features (its first weight '{}' is {}) but '{}' has {} feature "
          "columns besides the target '{}' ({}); make the CSV columns match the model",
          p.value.size(1), p.name, c10::str(p.value.sizes()), a.data, d.features(), a.target,
          fmt::join(d.feature_names, ", ")));
    break;
  }
  return usage_error(fmt::format("the model cannot run on a [{}, {}] batch of '{}': {}", rows, d.features(), a.data,
                                 one_line_error(e.what())));
}

// A usage_error unless `out`, the model's output on `rows` rows, fits the
// task: [rows, classes] logits with a class for every label, or one output
// per row.
void check_output_fits_task(const train_args& a, const training_data& d, const at::Tensor& out, int64_t rows) {
  if (a.task != "classify") {
    if (out.numel() != rows)
      throw usage_error(fmt::format("--task regress needs one output per row; the model returned shape {} for {} rows",
                                    c10::str(out.sizes()), rows));
    return;
  }
  if (out.dim() != 2 || out.size(0) != rows)
    throw usage_error(fmt::format("--task classify needs [rows, classes] logits; the model returned shape {}",
                                  c10::str(out.sizes())));
  const at::Tensor ok = d.finite_targets();
  if (ok.numel() > 0 && (ok.min().item<double>() < 0 || ok.max().item<double>() >= double(out.size(1))))
    throw usage_error(fmt::format("--task classify: the model returns {} classes, so the labels in '{}' must "
                                  "be in [0, {}), but they span [{}, {}]", out.size(1), a.target, out.size(1),
                                  ok.min().item<double>(), ok.max().item<double>()));
}

// The model must fit the features: tries it on the first `rows` rows before
// training (with autograd on: its output must depend on trainable parameters).
void probe_model(torch::jit::Module& model, const train_args& a, const training_data& d, int64_t rows) {
  model.eval();  // the probe must not move batch-norm statistics
  const at::Tensor probe = d.values.slice(0, 0, rows).slice(1, 0, d.features()).nan_to_num(0.0).to(at::kFloat);
  at::Tensor out;
  try {
    out = forward_tensor(model, probe);
  } catch (const usage_error&) {
    throw;
  } catch (const std::exception& e) {
    throw probe_failure(model, a, d, rows, e);
  }
  check_output_fits_task(a, d, out, rows);
  require_trainable(out);
}

// The paths of a run's outputs in its directory.
struct run_outputs {
  explicit run_outputs(const run_directory& dir)
      : events(dir / "events.jsonl"), bundles(dir / "bundles"), summary(dir / "summary.json"),
        report(dir / "report.html") {}
  std::string events, bundles, summary, report;
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const train_args& a, torch::nn::Module& params) {
  if (a.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(params.parameters(), torch::optim::SGDOptions(a.lr));
  return std::make_unique<torch::optim::AdamW>(params.parameters(), torch::optim::AdamWOptions(a.lr));
}

// The guard of the command line's policy, clipping, tracing and warmup,
// writing its event log and bundles into the run's directory.
guard_options make_guard_options(const train_args& a, const run_outputs& out) {
  guard_options options;
  options.policy(policy_from_string(a.policy))
      .max_norm(a.clip)
      .replay(a.trace == "on-failure")
      .verify_remedies(!a.no_verify_remedies)
      .auto_fix(a.auto_fix)
      .snapshot_every(std::clamp<int64_t>(a.steps / 10, 1, 100))
      .event_log(out.events)
      .bundle_dir(out.bundles)
      .front_end(front_end::cli)
      .data_file(a.data)
      .verbose(false);  // train() prints the guard's warnings between its progress lines
  if (a.trace == "always") options.trace_every_step(true);
  if (a.warmup > 0)
    options.schedule(schedule_options(a.lr).warmup_steps(a.warmup).total_steps(a.steps).min_lr(a.lr));
  return options;
}

// The batches of a run: a fresh permutation of the rows every epoch, from
// --seed, each batch through the data firewall (--firewall drop or repair,
// fitted on all the rows), which counts the CSV lines it dropped and repaired.
class batch_source {
 public:
  batch_source(const train_args& a, const training_data& d)
      : data_(d),
        rows_per_batch_(std::min(a.batch, d.rows())),
        classify_(a.task == "classify"),
        shuffle_rng_(a.seed),
        perm_(size_t(d.rows())),
        cursor_(perm_.size()) {
    if (a.firewall == "off") return;
    std::vector<std::string> names = d.feature_names;
    names.push_back(a.target);
    firewall_.emplace(firewall_options()
                          .nonfinite(a.firewall == "drop" ? nonfinite_policy::drop : nonfinite_policy::impute_median)
                          .label_columns({d.features()})
                          .column_names(names));
    firewall_->fit(d.values);
  }

  // The next batch that the firewall left rows in.
  batch next() {
    for (;;) {
      const std::vector<int64_t> rows = draw_rows();
      at::Tensor m = data_.values.index_select(0, at::tensor(rows, at::kLong));
      std::vector<int64_t> lines;
      for (int64_t r : rows) lines.push_back(data_.lines[size_t(r)]);
      if (firewall_) m = screen(m, lines);
      if (m.size(0) > 0) return to_batch(m, std::move(lines));  // else every row dropped: draw the next batch
    }
  }

  int64_t data_rows() const { return data_.rows(); }
  int64_t dropped_lines() const { return int64_t(dropped_lines_.size()); }
  int64_t repaired_lines() const { return int64_t(repaired_lines_.size()); }

 private:
  std::vector<int64_t> draw_rows() {
    std::vector<int64_t> rows;
    while (int64_t(rows.size()) < rows_per_batch_) {
      if (cursor_ == perm_.size()) {
        std::iota(perm_.begin(), perm_.end(), int64_t(0));
        std::shuffle(perm_.begin(), perm_.end(), shuffle_rng_);
        cursor_ = 0;
      }
      rows.push_back(perm_[cursor_++]);
    }
    return rows;
  }

  // The rows of `m` the firewall keeps, repaired; `lines` keeps theirs.
  at::Tensor screen(const at::Tensor& m, std::vector<int64_t>& lines) {
    const firewall_result res = firewall_->apply(m);
    const std::set<int64_t> dropped(res.report.dropped_rows.begin(), res.report.dropped_rows.end());
    for (int64_t i : res.report.dropped_rows) dropped_lines_.insert(lines[size_t(i)]);
    for (int64_t i : res.report.changed_rows) repaired_lines_.insert(lines[size_t(i)]);
    std::vector<int64_t> kept;
    for (int64_t i = 0; i < int64_t(lines.size()); ++i)
      if (!dropped.count(i)) kept.push_back(lines[size_t(i)]);
    lines = std::move(kept);
    return res.batch;
  }

  batch to_batch(const at::Tensor& m, std::vector<int64_t> lines) const {
    batch out;
    out.x = m.slice(1, 0, data_.features()).to(at::kFloat).contiguous();
    const at::Tensor y = m.select(1, data_.features());
    out.y = classify_ ? y.to(at::kLong) : y.to(at::kFloat).contiguous();
    out.lines = std::move(lines);
    return out;
  }

  const training_data& data_;
  const int64_t rows_per_batch_;
  const bool classify_;
  std::optional<firewall> firewall_;  // none under --firewall off
  std::mt19937_64 shuffle_rng_;
  std::vector<int64_t> perm_;
  size_t cursor_;
  std::set<int64_t> dropped_lines_, repaired_lines_;
};

// What the training loop saw.
struct train_outcome {
  int64_t steps_run = 0;
  bool aborted = false;
  std::string bundle_path;              // the abort's bundle
  std::optional<step_event> first_bad;  // the first step the guard acted on or the tracer found something in
  std::vector<int64_t> first_rows;      // the CSV lines of its rows holding a NaN/Inf

  // Counts the step of event `e`, run on `bt`.
  void record(const step_event& e, const batch& bt) {
    ++steps_run;
    if ((e.skipped || !e.findings.empty()) && !first_bad) {
      first_bad = e;
      first_rows = nonfinite_lines(bt);
    }
  }
};

// One step through the guard, and whether it aborted the run (policy abort:
// the step's event is then the guard's last, with its bundle).
std::pair<step_event, bool> guarded_step(guard& g, const std::vector<at::Tensor>& tensors, const step_fn& fn) {
  try {
    return {g.step(tensors, fn), false};
  } catch (const nonfinite_error&) {
    return {g.last_event(), true};
  }
}

// Trains `model` for --steps steps (fewer when the guard aborts), showing progress.
train_outcome train(const train_args& a, torch::jit::Module& model, guard& g, batch_source& batches) {
  const at::Device device(a.device);
  at::manual_seed(a.seed);  // dropout and any other randomness of the model
  const step_fn fn = [&](const std::vector<at::Tensor>& bt) {
    return task_loss(forward_tensor(model, bt[0]), bt[1], a.task);
  };
  g.set_batch_names({"features", a.target});  // findings name the target column, not batch[1]
  train_outcome o;
  progress bar(a.steps, "train", 0, a.quiet ? nullptr : stderr);
  for (int64_t step = 1; step <= a.steps && !o.aborted; ++step) {
    const batch bt = batches.next();
    g.set_bundle_tags(bundle_tags(a, bt));
    const auto [e, aborted] = guarded_step(g, {bt.x.to(device), bt.y.to(device)}, fn);
    o.record(e, bt);
    bar.note(g.narrator().last_warning());
    if (aborted) {
      o.aborted = true;
      o.bundle_path = e.bundle;
    }
    bar.update(e);
  }
  bar.finish();
  return o;
}

// How the run ended, by the rule `nanguard report` shows (run_status): "finite",
// "recovered" (below its first loss, not on its initial weights),
// "unrecovered" or "nonfinite", from the step events the guard's narrator saw.
std::string status_of(const guard& g) { return run_status(g.narrator().summary()); }

// Whether a run of `status` ended taking steps at a finite loss (recovered
// or not): it exits 0 and has a final loss.
bool ended_finite(const std::string& status) { return status != "nonfinite" && status != "empty"; }

// DIR/summary.json's content.
json summary_json(const train_args& a, const train_outcome& o, const guard& g, const batch_source& batches,
                  const run_outputs& out) {
  const std::string status = status_of(g);
  json s;
  s["status"] = status;
  s["steps"] = o.steps_run;
  s["final_loss"] = ended_finite(status) ? json(g.narrator().summary().final_loss) : json(nullptr);
  s["first_nonfinite"] = o.first_bad ? first_json(*o.first_bad, o.first_rows) : json(nullptr);
  s["data"] = {{"rows", batches.data_rows()},
               {"rows_dropped", batches.dropped_lines()},
               {"rows_repaired", batches.repaired_lines()},
               {"firewall", a.firewall}};
  s["skipped_steps"] = g.skipped();
  s["rollbacks"] = g.rollbacks();
  s["lr_factor"] = g.lr_factor();
  s["policy"] = a.policy;
  s["trace"] = a.trace;
  s["auto_fix"] = g.narrator().summary().auto_fix.empty() ? json(nullptr) : json(g.narrator().summary().auto_fix);
  s["bundle"] = o.bundle_path.empty() ? json(nullptr) : json(o.bundle_path);
  s["events"] = out.events;
  s["model"] = a.model;
  s["data_file"] = a.data;
  s["task"] = a.task;
  s["report"] = out.report;
  return s;
}

// Writes DIR/report.html from the event log, then DIR/summary.json.
void write_outputs(const train_args& a, const json& summary, const run_outputs& out) {
  write_file_atomically(out.report,
                        render_html_report({{fs::path(a.model).stem().string(), read_events(out.events)}},
                                           fmt::format("nanguard train: {} on {}", a.model, a.data)));
  write_file_atomically(out.summary, summary.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

// The console's lines on the first non-finite step: the op, cause and remedy,
// and the CSV lines of its NaN/Inf.
void print_first_nonfinite(const train_args& a, const train_outcome& o) {
  const step_event& e = *o.first_bad;
  if (is_runaway(e)) {
    fmt::print("  first bad step: step {}: {} (finite: the guard acted before a NaN/Inf)\n", e.step, e.reason);
  } else if (e.findings.empty()) {
    fmt::print("  first non-finite: step {} (no op named: {})\n", e.step,
               a.trace == "off" ? "--trace off" : e.verdict == verdict::none ? "no replay" : to_string(e.verdict));
  } else {
    const finding& f = e.findings.front();
    fmt::print("  first non-finite: {}\n", describe(f));
    fmt::print("  likely cause: {} ({} confidence): {}\n", to_string(f.diagnosis.cause),
               to_string(f.diagnosis.confidence), f.diagnosis.evidence);
    fmt::print("  remedy: {}\n", f.diagnosis.remedy);
    for (const remedy_check& c : f.remedy_checks) fmt::print("  verified: {}\n", to_string(c));
  }
  if (!o.first_rows.empty())
    fmt::print("  the NaN/Inf came from the data: {} line{} {}\n", a.data, o.first_rows.size() > 1 ? "s" : "",
               fmt::join(o.first_rows, ", "));
}

// Why a run that ended finite after bad steps is not recovered (run_status).
std::string why_unrecovered(const run_summary& s) {
  if (s.ended_on_snapshot == s.initial_step)
    return fmt::format("it ended on its initial weights (rolled back to before step {})", s.initial_step + 1);
  return fmt::format("the loss ended at {:.6g} (step {}), not below its first, {:.6g} (step {})", s.final_loss,
                     s.final_step, s.first_loss, s.first_step);
}

// The console's account of the run.
void print_summary(const train_args& a, const train_outcome& o, const guard& g, const batch_source& batches,
                   const run_outputs& out) {
  const std::string status = status_of(g);
  const run_summary& s = g.narrator().summary();
  fmt::print("nanguard train: {}\n", status == "nonfinite" ? "NON-FINITE" : status);
  fmt::print("  steps: {} of {}{}{}; final loss {}\n", o.steps_run, a.steps,
             g.skipped() ? fmt::format(", {} skipped", g.skipped()) : "",
             g.rollbacks() ? fmt::format(", {} rollbacks (LR x{:.4g})", g.rollbacks(), g.lr_factor()) : "",
             ended_finite(status) ? fmt::format("{:.6g}", s.final_loss) : "not finite");
  if (status == "unrecovered") fmt::print("  not recovered: {}\n", why_unrecovered(s));
  if (s.transient_faults > 0)
    fmt::print("  transient faults: {} (a run of the step from the same state computed something else; the step "
               "ran again and was taken: docs/hardware-or-software.md)\n",
               s.transient_faults);
  if (o.first_bad) print_first_nonfinite(a, o);
  if (!s.auto_fix.empty())
    fmt::print("  auto_fix: kept {} from step {}: make it a change to the model\n", s.auto_fix, s.auto_fix_since);
  if (a.firewall != "off")
    fmt::print("  data firewall ({}): {} rows dropped, {} rows repaired\n", a.firewall, batches.dropped_lines(),
               batches.repaired_lines());
  if (!o.bundle_path.empty()) fmt::print("  repro bundle: {} (nanguard inspect / nanguard replay)\n", o.bundle_path);
  fmt::print("  wrote {}, {}, {}\n", out.summary, out.events, out.report);
}

int run_train(const train_args& a) {
  validate(a);
  torch::jit::Module model = load_script_model(a.model);
  const training_data d = read_training_data(a);
  check_targets(a, d);
  per_op_autograd per_op;
  probe_model(model, a, d, std::min(a.batch, d.rows()));
  model.train();
  model.to(at::Device(a.device));
  const run_directory dir(a.out, {"events.jsonl", "summary.json", "report.html", "bundles"},
                          {{"--model", a.model}, {"--data", a.data}});
  const run_outputs out(dir);
  // The guard trains the script module's own tensors through the mirror.
  const auto params = mirror_parameters(model);
  const auto optimizer = make_optimizer(a, *params);
  // An event log the guard cannot open is exit 2.
  guard g = as_input_error([&] { return guard(*params, *optimizer, make_guard_options(a, out)); });
  if (!a.inject.empty()) as_input_error([&] { g.inject(fault_spec_from_string(a.inject)); });
  batch_source batches(a, d);
  const train_outcome o = train(a, model, g, batches);
  write_outputs(a, summary_json(a, o, g, batches, out), out);
  print_summary(a, o, g, batches, out);
  return ended_finite(status_of(g)) ? exit_ok : exit_nonfinite;
}

// The names --policy takes: the guard's policies.
std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (policy p : all_policies) names.emplace_back(to_string(p));
  return names;
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
  sub->add_option("--steps", a->steps, "training steps")->capture_default_str()->check(integer_in<int64_t>(1, max_steps));
  sub->add_option("--batch", a->batch, "rows per step")->capture_default_str();
  sub->add_option("--lr", a->lr, "learning rate")->capture_default_str();
  sub->add_option("--optimizer", a->optimizer, "adamw or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->capture_default_str();
  sub->add_option("--clip", a->clip, "clip the global grad norm to this (0: off)")->capture_default_str();
  sub->add_option("--warmup", a->warmup, "steps of linear LR warmup")->capture_default_str();
  sub->add_option("--policy", a->policy, "on a non-finite step: auto (by the diagnosed cause: skip bad data, roll back a divergence), skip, "
                  "backoff (as skip: fp32 training runs without a loss scaler), rollback (restore + halve LR) or "
                  "abort (bundle, exit 3); any policy aborts after 20 bad steps in a row or half the last 100")
      ->check(CLI::IsMember(policy_names()))
      ->capture_default_str();
  sub->add_option("--firewall", a->firewall, "NaN/Inf in a batch: off, drop the rows, or repair (impute the median)")
      ->check(CLI::IsMember({"off", "drop", "repair"}))
      ->capture_default_str();
  sub->add_option("--trace", a->trace, "op tracer: on-failure (replay a bad step), always (every step) or off")
      ->check(CLI::IsMember({"always", "on-failure", "off"}))
      ->capture_default_str();
  auto* no_verify = sub->add_flag("--no-verify-remedies", a->no_verify_remedies,
                                  "do not replay a bad step with its remedy applied (the finding's `verified:` "
                                  "lines: 1 to 4 replays per bad step, an LR cut up to 21 steps)");
  sub->add_flag("--auto-fix", a->auto_fix,
                "keep the first verified op rewrite (an eps on a zero denominator, a clamp, a safe softmax, an op "
                "in float32) in force for the rest of the run; the warnings and summary.json say so. It changes "
                "the model's math: make the remedy a change to the model")
      ->excludes(no_verify);
  sub->add_option("--seed", a->seed, "seed of the batch order and the model's randomness")
      ->capture_default_str()
      ->check(non_negative_integer());
  sub->add_option("--out", a->out, "output directory: events.jsonl, summary.json, report.html, bundles/")->capture_default_str();
  sub->add_option("--device", a->device, "where the model trains: cpu, or cuda (the current GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_flag("--quiet", a->quiet, "no progress and no warning line per bad step on stderr (the summary stays)");
  sub->add_option("--inject", a->inject,
                  "plant a fault to test what the guard finds, e.g. 'op=aten::addmm,step=5,kind=bit_flip,bit=30,"
                  "mode=persistent' (docs/hardware-or-software.md; NANGUARD_INJECT does the same)");
  sub->footer(exit_codes("the run ended finite (summary.json's status finite, recovered or unrecovered)",
                         "it stopped on a NaN/Inf (--policy abort) or ended non-finite (none of its last steps/10, "
                         "1 to 10, could be taken)") +
              "\n--out is locked while the run lasts: a second run into it exits 2 and names the first.");
  return {sub, [a] { return run_train(*a); }};
}

}  // namespace nanguard::cli
