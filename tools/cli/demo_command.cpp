// `nanguard demo [--scenario NAME] [--out DIR] [--list]`: the classic ways
// training goes NaN (demo_scenarios.h). Each scenario trains twice: first
// with the bug, watched by the op tracer, which names the op, module,
// direction, step and role where the first NaN/Inf was born, and replays
// the failing step with the remedy applied, which must keep it finite
// (verified remedies); then with the remedy under nanguard::guard, which
// must train to a finite, falling loss.
// DIR (locked while the demo runs) gets every run's event log, the repro
// bundles and report.html.
// Exit 0 when every scenario shows both, 1 otherwise: the demo is a test too.
#include "commands.h"
#include "demo_scenarios.h"
#include "progress.h"
#include "run_dir.h"
#include "temp_file.h"

#include <nanguard/bundle.h>
#include <nanguard/events.h>
#include <nanguard/guard.h>
#include <nanguard/report.h>
#include <nanguard/schedule.h>
#include <nanguard/tracer.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>

#include <unistd.h>

namespace nanguard::cli {
namespace {

namespace fs = std::filesystem;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct demo_args {
  std::string out = "nanguard-demo";
  std::string scenario;
  std::string device = "cpu";
  bool list = false;
};

// What one run did, read back from its event log.
struct run_result {
  std::string name;               // "zero-std/unguarded"
  std::string log;                // its events.jsonl
  std::vector<step_event> events;
  std::optional<finding> first;   // the first NaN/Inf the tracer named
  std::string bundle;             // a repro bundle's directory, if one was written
  int64_t rows_dropped = 0, values_clipped = 0, values_repaired = 0;

  double first_loss() const { return events.empty() ? kNaN : events.front().loss; }
  double last_loss() const { return events.empty() ? kNaN : events.back().loss; }
  int64_t skipped() const {
    return std::count_if(events.begin(), events.end(), [](const step_event& e) { return e.skipped; });
  }
  int64_t rollbacks() const {
    return std::count_if(events.begin(), events.end(), [](const step_event& e) { return e.action == action::rollback; });
  }
  // The run ended on a finite step whose loss is below the first one.
  bool finite_and_falling() const {
    if (events.empty()) return false;
    const step_event& last = events.back();
    return !last.skipped && std::isfinite(last.loss) && std::isfinite(last.grad_norm) &&
           std::isfinite(first_loss()) && last.loss < first_loss();
  }
};

std::string show(double v) {
  if (std::isnan(v)) return "nan";
  return fmt::format("{:.4g}", v);
}

// A progress line for a run on a terminal; none otherwise (the demo prints
// its own lines about each run).
std::unique_ptr<progress> progress_on_tty(int64_t steps, const std::string& name) {
  if (!isatty(fileno(stderr))) return nullptr;
  return std::make_unique<progress>(steps, "    " + name);
}

// The guard of a scenario's unguarded run: no remedy, policy abort, and the
// setup's static loss scale (as fixed-scale fp16 training has). A traced
// loop is a tracer on every step, as over a plain loop, and no bundle; the
// other mode replays the bad step and writes the bundle.
guard_options unguarded_options(unguarded_mode mode, double loss_scale) {
  guard_options o = guard_options().policy(policy::abort);
  if (loss_scale != 1)
    o.scaler(loss_scaler_options().init_scale(loss_scale).growth_interval(std::numeric_limits<int64_t>::max()));
  if (mode == unguarded_mode::traced_loop) o.trace_every_step(true).bundle_dir("");
  return o;
}

// A run under nanguard::guard with the setup's options (the remedy, or
// policy abort and no remedy); a firewall, if any, cleans every batch first,
// on the CPU, before the batch goes to `device`.
run_result run_guarded(demo_setup s, const std::string& name, const fs::path& dir, const at::Device& device) {
  fs::create_directories(dir);
  s.model->to(device);
  run_result r;
  r.name = name;
  r.log = (dir / "events.jsonl").string();
  guard_options options = s.options;
  options.event_log(r.log).truncate_event_log(true);
  if (!options.bundle_dir().empty()) options.bundle_dir((dir / "bundles").string());
  {
    guard g(*s.model, *s.optimizer, options);
    const auto bar = progress_on_tty(s.steps, name);
    for (int64_t step = 1; step <= s.steps; ++step) {
      std::vector<at::Tensor> batch = s.batch(step);
      if (s.data_firewall) {
        firewall_result clean = s.data_firewall->apply(batch[0]);
        const firewall_report& rep = clean.report;
        r.rows_dropped += int64_t(rep.dropped_rows.size());
        r.values_clipped += rep.clipped();
        r.values_repaired += rep.repaired();
        if (!rep.dropped_rows.empty()) {
          std::vector<int64_t> keep;
          for (int64_t i = 0; i < rep.rows_in; ++i)
            if (!std::binary_search(rep.dropped_rows.begin(), rep.dropped_rows.end(), i)) keep.push_back(i);
          const at::Tensor index = at::tensor(keep, at::kLong);
          for (size_t i = 1; i < batch.size(); ++i) batch[i] = batch[i].index_select(0, index);
        }
        batch[0] = clean.batch;
      }
      for (at::Tensor& t : batch) t = t.to(device);
      try {
        const step_event e = g.step(batch, s.loss);
        if (bar) bar->update(e);
      } catch (const nonfinite_error& e) {  // policy abort: the bundle is written
        r.first = e.finding();
        break;
      }
    }
    if (bar) bar->finish();
  }
  r.events = read_events(r.log);
  for (const step_event& e : r.events)
    if (!e.bundle.empty()) r.bundle = e.bundle;
  return r;
}

// Prints `text` with every line indented.
void print_indented(const std::string& text, const char* indent) {
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    const size_t stop = end == std::string::npos ? text.size() : end;
    fmt::print("{}{}\n", indent, text.substr(begin, stop - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
}

// One line about a remedy run: steps, skips, rollbacks, scale, LR, data, loss.
void print_remedy_run(const run_result& r) {
  if (r.events.empty()) {
    fmt::print("    no step ran\n");
    return;
  }
  const step_event &first = r.events.front(), &last = r.events.back();
  std::string line = fmt::format("{} steps, {} skipped", r.events.size(), r.skipped());
  if (r.rollbacks() > 0) line += fmt::format(", {} rollback{}", r.rollbacks(), r.rollbacks() == 1 ? "" : "s");
  if (first.scale != last.scale || first.scale != 1)
    line += fmt::format(", loss scale {:.6g} -> {:.6g}", first.scale, last.scale);
  double peak_lr = 0;
  for (const step_event& e : r.events) peak_lr = std::max(peak_lr, e.lr);
  if (first.lr != last.lr) line += fmt::format(", lr {} -> peak {} -> {}", show(first.lr), show(peak_lr), show(last.lr));
  fmt::print("    {}\n", line);
  if (r.rows_dropped + r.values_clipped + r.values_repaired > 0)
    fmt::print("    firewall: {} rows dropped (NaN/Inf), {} outlier values clipped, {} values repaired\n",
               r.rows_dropped, r.values_clipped, r.values_repaired);
  fmt::print("    loss {} -> {}: {}\n", show(r.first_loss()), show(r.last_loss()),
             r.finite_and_falling() ? "finite, falling" : "NOT finite and falling");
}

// The outcome of one scenario, for the summary.
struct scenario_result {
  const demo_scenario* scenario;
  run_result unguarded;
  std::vector<run_result> remedies;  // the remedy, then the extra one if any
  bool ok() const {
    if (!unguarded.first || unguarded.first->diagnosis.cause != scenario->expected) return false;
    if (!verified_remedy(unguarded.first->remedy_checks)) return false;
    for (const run_result& r : remedies)
      if (!r.finite_and_falling()) return false;
    return true;
  }
};

scenario_result run_scenario(const demo_scenario& s, const fs::path& out, size_t index, size_t count,
                             const at::Device& device) {
  const fs::path dir = out / s.name;
  scenario_result result{&s, {}, {}};
  fmt::print("\n[{}/{}] {}: {}\n", index, count, s.name, s.title);

  demo_setup setup = s.make(false);
  setup.options = unguarded_options(s.mode, setup.loss_scale);
  fmt::print("  unguarded (no remedy; nanguard::guard with policy abort {}):\n",
             s.mode == unguarded_mode::traced_loop ? "and a tracer on every step"
                                                   : "replays the bad step under the tracer");
  result.unguarded = run_guarded(std::move(setup), s.name + "/unguarded", dir / "unguarded", device);
  const run_result& u = result.unguarded;
  if (u.first) {
    fmt::print("    went non-finite at step {} of the run; the tracer's first finding and its diagnosis:\n",
               u.first->step);
    print_indented(to_text(*u.first), "    | ");
  } else {
    fmt::print("    NO NaN/Inf in {} steps (the scenario did not reproduce its failure)\n", u.events.size());
  }
  if (!u.bundle.empty()) fmt::print("    repro bundle: {}\n", u.bundle);

  fmt::print("  remedy run: {}\n", s.remedy);
  result.remedies.push_back(run_guarded(s.make(true), s.name + "/remedy", dir / "remedy", device));
  print_remedy_run(result.remedies.back());
  if (!s.extra_name.empty()) {
    fmt::print("  {}: {}\n", s.extra_name, s.extra_remedy);
    result.remedies.push_back(
        run_guarded(s.make_extra(), s.name + "/" + s.extra_name, dir / s.extra_name, device));
    print_remedy_run(result.remedies.back());
  }
  fmt::print("  events: {}/{{unguarded,remedy{}}}/events.jsonl\n", dir.string(),
             s.extra_name.empty() ? "" : "," + s.extra_name);
  return result;
}

void print_summary(const std::vector<scenario_result>& results) {
  fmt::print("\nsummary\n");
  const auto row = [](const std::string& a, const std::string& b, const std::string& c, const std::string& d,
                      const std::string& e, const std::string& f, const std::string& g, const std::string& h,
                      const std::string& i, const std::string& j, const std::string& k) {
    fmt::print("  {:<17} {:<16} {:<8} {:<9} {:>4}  {:<10} {:<21} {:<18} {:<16} {:>10}  {}\n", a, b, c, d, e, f, g, h,
               i, j, k);
  };
  row("scenario", "first NaN/Inf op", "module", "direction", "step", "role", "cause", "remedy", "verified on step",
      "final loss", "status");
  for (const scenario_result& r : results) {
    const auto& f = r.unguarded.first;
    std::string status = "ok";
    if (!f) status = "FAILED: no NaN/Inf without the remedy";
    else if (f->diagnosis.cause != r.scenario->expected)
      status = fmt::format("FAILED: diagnosed {}, expected {}", to_string(f->diagnosis.cause),
                           to_string(r.scenario->expected));
    // The remedy replayed on the failing step: whether it kept it finite.
    std::string verified = "-";
    if (f && !f->remedy_checks.empty()) {
      const remedy_check* v = verified_remedy(f->remedy_checks);
      verified = to_string(v ? v->result : f->remedy_checks.front().result);
      if (!v) status = "FAILED: its remedy did not keep the failing step finite";
    }
    for (const run_result& m : r.remedies)
      if (!m.finite_and_falling()) status = "FAILED: " + m.name + " not finite and falling";
    row(r.scenario->name, f ? f->op : "-", f ? (f->module.empty() ? "?" : f->module) : "-",
        f ? to_string(f->direction) : "-", f ? std::to_string(f->step) : "-", f ? to_string(f->role) : "-",
        f ? to_string(f->diagnosis.cause) : "-", r.scenario->remedy_short, verified,
        show(r.remedies.front().last_loss()), status);
  }
}

int run_demo(const demo_args& a) {
  if (a.device == "cuda" && !at::hasCUDA())
    throw usage_error("--device cuda: no CUDA device found (torch sees none); run the demo with --device cpu");
  const auto start = std::chrono::steady_clock::now();
  const std::vector<demo_scenario> all = demo_scenarios();
  if (a.list) {
    for (const demo_scenario& s : all) fmt::print("{:<17} {}\n", s.name, s.title);
    return exit_ok;
  }
  std::vector<const demo_scenario*> chosen;
  for (const demo_scenario& s : all)
    if (a.scenario.empty() || s.name == a.scenario) chosen.push_back(&s);
  if (chosen.empty()) {
    std::vector<std::string> names;
    for (const demo_scenario& s : all) names.push_back(s.name);
    throw usage_error(fmt::format("no scenario '{}'; choose one of: {}", a.scenario, fmt::join(names, ", ")));
  }
  // Every scenario's folder is the demo's: a run of one leaves none of another run's.
  std::vector<std::string> outputs = {"report.html"};
  for (const demo_scenario& s : all) outputs.push_back(s.name);
  const run_directory out_dir(a.out, outputs, {});
  const fs::path out(a.out);

  fmt::print("nanguard demo: {} scenario{}, each trained without and with its remedy; output in {}/{}\n",
             chosen.size(), chosen.size() == 1 ? "" : "s", out.string(), a.device == "cpu" ? "" : " (on " + a.device + ")");
  const at::Device device(a.device);
  std::vector<scenario_result> results;
  for (size_t i = 0; i < chosen.size(); ++i)
    results.push_back(run_scenario(*chosen[i], out, i + 1, chosen.size(), device));
  print_summary(results);

  std::vector<report_run> runs;
  for (const scenario_result& r : results) {
    runs.push_back({r.unguarded.name, r.unguarded.events});
    for (const run_result& m : r.remedies) runs.push_back({m.name, m.events});
  }
  const std::string report = out_dir / "report.html";
  write_file_atomically(report, render_html_report(runs, "nanguard demo"));

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool ok = std::all_of(results.begin(), results.end(), [](const scenario_result& r) { return r.ok(); });
  fmt::print("\nreport: {}\n{} in {:.1f} s ({} threads)\n", report,
             ok ? "every remedy trained to a finite, falling loss" : "FAILED: see the summary", seconds,
             at::get_num_threads());
  return ok ? exit_ok : exit_failure;
}

}  // namespace

command add_demo_command(CLI::App& app) {
  auto args = std::make_shared<demo_args>();
  auto* sub = app.add_subcommand(
      "demo", "Train through the classic NaN/Inf failures: where each is born, and the remedy that fixes it");
  sub->add_option("--out", args->out, "Directory for the event logs, bundles and report.html (locked while the "
                                      "demo runs; its scenario folders are replaced)")
      ->capture_default_str();
  sub->add_option("--scenario", args->scenario, "Run only this scenario (see --list)");
  sub->add_option("--device", args->device, "where the scenarios train: cpu, or cuda (the current GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_flag("--list", args->list, "List the scenarios and exit");
  sub->footer(exit_codes("every scenario went non-finite without its remedy and trained with it") +
              "\nA scenario that does not is the internal error 1: the demo tests nanguard too.");
  return {sub, [args] { return run_demo(*args); }};
}

}  // namespace nanguard::cli
