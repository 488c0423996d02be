// events.h — the guard's JSONL event log: one line per step, flushed as it
// is written, so a crash loses nothing already logged.
//
//   nanguard::event_log log("train.jsonl");
//   nanguard::step_event e;
//   e.step = 7; e.loss = 0.31; e.grad_norm = 1.2; e.action = nanguard::action::step;
//   log.write(e);
//   for (auto& ev : nanguard::read_events("train.jsonl")) std::cout << nanguard::to_string(ev.action) << "\n";
#pragma once

#include <nanguard/finding.h>
#include <nanguard/forecast.h>
#include <nanguard/sentinel.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace nanguard {

/// What the guard did with a step (the event log's "action").
enum class action {
  step,      ///< "step": a finite step, the optimizer stepped
  skip,      ///< "skip": policy skip acted on a bad step
  backoff,   ///< "backoff": policy backoff acted
  rollback,  ///< "rollback": policy rollback acted
  abort,     ///< "abort": policy abort acted (or max_bad_steps)
  data,      ///< "data": not a training step but a data firewall's check
};
/// Every action, in declaration order.
inline constexpr action all_actions[] = {action::step,     action::skip,  action::backoff,
                                         action::rollback, action::abort, action::data};
/// Its name in the event log: "step", "skip", "backoff", "rollback", "abort", "data".
const char* to_string(action a);
/// The action whose to_string is `name`. Throws c10::Error listing the valid names.
action action_from_string(const std::string& name);

/// What the replay of a bad step concluded (the event log's "verdict").
enum class verdict {
  none,            ///< "": no replay (a finite step, or replay off)
  reproduced,      ///< "reproduced": the replay made the NaN/Inf again
  not_reproduced,  ///< "not reproduced": the replay ran finite (non-deterministic, hardware)
  replay_failed,   ///< "replay failed": the replay could not run (the note says why)
  compiled_only,   ///< "compiled only": only the compiled code makes it, the eager code runs finite
};
/// Every verdict, in declaration order.
inline constexpr verdict all_verdicts[] = {verdict::none, verdict::reproduced, verdict::not_reproduced,
                                           verdict::replay_failed, verdict::compiled_only};
/// Its name in the event log: "", "reproduced", "not reproduced", "replay failed", "compiled only".
const char* to_string(verdict v);
/// The verdict whose to_string is `name`. Throws c10::Error listing the valid names.
verdict verdict_from_string(const std::string& name);

/// Hardware or software: what kind of failure a bad (or suspect) step was,
/// from its replays (docs/hardware-or-software.md; the event log's "fault").
enum class fault_class {
  none,        ///< "": a healthy step, or not told (the replay failed, or none ran)
  data,        ///< "data": the replay reproduced it, and the batch brought the NaN/Inf
  model,       ///< "model": the replay reproduced it in the model's own numerics
  compiler,    ///< "compiler": only the compiled code makes it, the eager code runs finite
  transient,   ///< "transient": a run of the same step from the same state computed something else
  persistent,  ///< "persistent": it reproduces on its rank, not on another given the same batch and state
};
/// Every fault class, in declaration order.
inline constexpr fault_class all_fault_classes[] = {fault_class::none,     fault_class::data,
                                                    fault_class::model,    fault_class::compiler,
                                                    fault_class::transient, fault_class::persistent};
/// Its name in the event log: "", "data", "model", "compiler", "transient", "persistent".
const char* to_string(fault_class c);
/// The fault class whose to_string is `name`. Throws c10::Error listing the valid names.
fault_class fault_class_from_string(const std::string& name);

/// One parameter whose gradient held NaN/Inf.
struct bad_parameter {
  std::string name;      ///< parameter name
  int64_t nonfinite = 0; ///< NaN and Inf elements in its gradient
};

/// What the data firewall found and did in one batch (or sample): the body of
/// a data event (step_event::action "data"), written by Python's
/// nanguard.data wrappers. Rows are samples; nan ... outliers count values.
struct data_counts {
  std::string source;    ///< the writer, e.g. "firewall_collate" or "FirewallDataset"
  /// The number of the firewall's check (a batch, or a sample) in its source,
  /// from 1: the data events' own axis, apart from the training steps.
  int64_t check = 0;
  int64_t checked = 0;   ///< rows checked (since the process's previous event)
  int64_t dropped = 0;   ///< rows dropped
  int64_t changed = 0;   ///< rows kept with a value repaired or clipped
  int64_t repaired = 0;  ///< non-finite values replaced
  int64_t clipped = 0;   ///< outliers clamped to the fitted bounds
  int64_t nan = 0;       ///< NaN values found
  int64_t pos_inf = 0;   ///< +Inf values found
  int64_t neg_inf = 0;   ///< -Inf values found
  int64_t outliers = 0;  ///< finite values outside the fitted bounds
  int64_t raised = 0;    ///< checks refused under a "raise" policy (the error went to the caller)
  /// The rows dropped, and those kept with a value repaired or clipped, as
  /// `row_index` says.
  std::vector<int64_t> dropped_rows, changed_rows;
  /// What dropped_rows and changed_rows index: "dataset" (FirewallDataset:
  /// the samples' indices), "stream" (FirewallIterableDataset: positions in
  /// the stream the process iterates, a DataLoader worker its shard) or
  /// "batch" (firewall_collate: rows of the checked batch).
  std::string row_index = "batch";
};

/// Everything the guard knows about one step.
///
/// A data event (action "data") is not a training step: `data` holds the
/// counts and the check's number (data_counts::check), `step` stays 0 and
/// the other fields keep their defaults; its JSON holds "action" and "data"
/// only. (A log written before holds "step", read as the check's number.)
/// Readers that plot steps (report, TensorBoard) set it apart.
struct step_event {
  int64_t step = 0;             ///< the guard's step counter (1-based)
  double loss = 0;              ///< the loss (unscaled); NaN/Inf when bad
  double grad_norm = 0;         ///< global grad norm before clipping (unscaled)
  double clip_coef = 1;         ///< factor the gradients were clipped by
  double scale = 1;             ///< loss scale used for this step
  double lr = 0;                ///< learning rate of the first param group
  bool skipped = false;         ///< true when the optimizer did not step
  nanguard::action action = action::step;  ///< what the guard did with it
  /// What made a bad step bad: "non-finite loss", "non-finite gradient",
  /// "non-finite on rank(s) 1", "non-finite averaged gradients" or
  /// "gradient checksum differs on rank(s) 3" ("" on a healthy step).
  std::string reason;
  std::vector<spike> spikes;    ///< loss / grad-norm spikes
  std::vector<bad_parameter> nonfinite_params;  ///< parameters with bad gradients
  /// The largest per-parameter grad norms (unscaled, before clipping), largest
  /// first; guard_options::log_top_norms of them.
  std::vector<std::pair<std::string, double>> top_norms;
  int64_t rank = -1;            ///< distributed: this process's rank (-1: single process)
  std::vector<int64_t> nonfinite_ranks;  ///< distributed: the ranks that saw a non-finite value
  nanguard::verdict verdict = verdict::none;  ///< the replay's conclusion (none: no replay)
  /// Hardware or software, from the replays: a transient fault's step was
  /// run again and taken (action "step", skipped false, the note says so).
  nanguard::fault_class fault = fault_class::none;
  /// The step's fingerprint (step_signature.h): its loss and per-parameter
  /// gradient norms and NaN/Inf counts, hashed (0: not measured).
  uint64_t signature = 0;
  std::vector<finding> findings;  ///< the tracer's findings from the replay
  int64_t rollback_to = -1;     ///< rollback: the step of the restored snapshot (one before the first step: the initial weights)
  std::string bundle;           ///< abort: the repro bundle's directory
  /// The remedy the guard applied to a bad step, e.g. "skipped the step;
  /// loss scale 65536 -> 32768" or "rolled back to step 40; lr 0.1 -> 0.05"
  /// ("" on a healthy step). Why the step went bad: its findings' diagnosis.
  std::string remedy;
  std::string note;             ///< free text: an error, or on rollback the parameters that moved most
  /// auto_fix: the verified op rewrite the guard keeps in force for the
  /// rest of the run ("eps 1e-05 on the zero denominators of aten::div"); "" when none.
  std::string auto_fix;
  /// A finite step whose loss or grad norm grows toward its dtype's range:
  /// where and when it leaves it (forecast.h); none on a healthy step.
  std::optional<range_forecast> forecast;
  /// Milliseconds the guard itself spent on this step: all of guard::step
  /// but the user's forward, the backward and the optimizer step (which a
  /// plain loop runs too) and this event's own log line; for a step a
  /// framework runs, begin_step() and check() without what runs between.
  double guard_ms = 0;
  /// A data event's counts (action "data"); empty for a training step.
  std::optional<data_counts> data;
};

/// One JSON object, no newline.
std::string to_json(const step_event& e);
/// Reads a line written by to_json. Throws c10::Error on malformed input.
step_event step_event_from_json(const std::string& line);

/// Appends step events to a JSONL file, one flushed line each.
/// What event_log throws when its file cannot be opened or written (a full
/// disk): an error of the output, not of the training, which a caller may
/// want to tell apart (`nanguard train` exits 2 on it).
class event_log_error : public c10::Error {
 public:
  using c10::Error::Error;
};

class event_log {
 public:
  /// Opens `path` for appending (truncates first when `truncate`).
  /// Throws event_log_error when the file cannot be opened.
  explicit event_log(const std::string& path, bool truncate = false);
  ~event_log();
  event_log(const event_log&) = delete;
  event_log& operator=(const event_log&) = delete;
  /// Writes one line and flushes it; throws event_log_error when it cannot.
  void write(const step_event& e);
  /// The file it writes.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

/// Every event of a JSONL log, in order (blank lines skipped). Throws
/// c10::Error naming the file, and for a malformed line "path:line:".
std::vector<step_event> read_events(const std::string& path);

}  // namespace nanguard
