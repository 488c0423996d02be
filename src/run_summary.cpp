#include "nanguard/run_summary.h"

#include "nanguard/remedy_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace nanguard {
namespace {

// "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st".
std::string ordinal(int64_t n) {
  const int64_t tens = n % 100, ones = n % 10;
  const char* suffix = (tens >= 11 && tens <= 13) ? "th" : ones == 1 ? "st" : ones == 2 ? "nd" : ones == 3 ? "rd" : "th";
  return fmt::format("{}{}", n, suffix);
}

// "nan", "inf", "-inf" (fmt writes a NaN with its sign bit as "-nan").
std::string value_text(double v) { return std::isnan(v) ? "nan" : fmt::format("{}", v); }

// " in head (forward) at train.py:42 (forward)", " (backward)": the module,
// the direction and the user's line, when known.
std::string where(const finding& f) {
  return fmt::format("{}{} ({}){}", f.module.empty() ? "" : " in ", f.module, to_string(f.direction),
                     f.source.known() ? " at " + to_string(f.source) : "");
}

// What went wrong in a bad step, without its step number: the first
// finding's op and module, or the reason and the first bad parameter.
std::string failure(const step_event& e) {
  if (!e.findings.empty()) {
    const finding& f = e.findings.front();
    const std::string rank = f.rank >= 0 ? fmt::format(" on rank {}", f.rank) : "";
    switch (f.role) {
      case role::producer: return fmt::format("{} from {}{}{}", value_text(f.value), f.op, where(f), rank);
      case role::input:
        return fmt::format("{} in {} entering {}{}{}", value_text(f.value), f.culprit, f.op, where(f), rank);
      case role::propagator: return fmt::format("{} through {}{}{}", value_text(f.value), f.op, where(f), rank);
    }
  }
  std::string what = e.reason.empty() ? "non-finite step" : e.reason;
  if (!e.nonfinite_params.empty()) {
    what += " in " + e.nonfinite_params.front().name;
    if (e.nonfinite_params.size() > 1) what += fmt::format(" and {} more parameters", e.nonfinite_params.size() - 1);
  }
  switch (e.verdict) {
    case verdict::not_reproduced: return what + " (not reproduced by the replay)";
    case verdict::replay_failed: return what + " (the replay failed)";
    case verdict::compiled_only: return what + " (only in the compiled code)";
    case verdict::none:
    case verdict::reproduced: return what;
  }
  return what;
}

// The classified cause of a bad step ("" when none).
std::string cause_of(const step_event& e) {
  if (e.findings.empty() || e.findings.front().diagnosis.cause == cause::unclassified) return "";
  return to_string(e.findings.front().diagnosis.cause);
}

// `s` on one line.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// What to do about a runaway: the LR, which the rollbacks cut for this run only.
const char* const runaway_advice =
    "remedy: lower the LR or warm it up longer and clip the gradients (max_norm 1.0): the rollback cut the LR "
    "for this run only";

// What to do about a bad step, on one line: the diagnosis's remedy, or of
// a NaN/Inf only the compiled code makes (no op to diagnose) the note of
// the compiler's bisection: its stage, kernel and remedy, the note an
// abort's error ends with ("" when there is neither).
std::string advice_of(const step_event& e) {
  if (e.verdict == verdict::compiled_only) return one_line(e.note);
  if (is_runaway(e)) return runaway_advice;
  if (e.findings.empty() || e.findings.front().diagnosis.remedy.empty()) return "";
  const finding& f = e.findings.front();
  std::string advice = "remedy: " + one_line(f.diagnosis.remedy);
  if (const remedy_check* verified = verified_remedy(f.remedy_checks))
    advice += fmt::format(" [verified on this step: {} keeps it finite, loss {:.6g}]", verified->applied, verified->loss);
  else if (!f.remedy_checks.empty() && f.remedy_checks.front().remedy != remedy_kind::none)
    advice += " [" + to_string(f.remedy_checks.front()) + "]";  // tried, and not enough or not applicable
  return advice;
}

bool bad(const step_event& e) { return e.action != action::step && e.action != action::data; }

}  // namespace

bool is_runaway(const step_event& e) {
  return e.findings.empty() && std::isfinite(e.loss) &&
         (e.reason.rfind("loss diverging", 0) == 0 || e.reason.rfind("grad norm diverging", 0) == 0);
}

std::string warning_line(const step_event& e, int64_t times) {
  if (!bad(e)) return "";
  const std::string cause = cause_of(e);
  const int64_t sample = e.findings.empty() ? -1 : e.findings.front().dataset_index;
  std::string line = fmt::format("nanguard: step {}: {}{}{}", e.step, failure(e),
                                 sample >= 0 ? fmt::format(", dataset index {}", sample) : "",
                                 cause.empty() ? "" : " [" + cause + "]");
  if (times > 1) line += fmt::format(" again ({} time)", ordinal(times));
  line += ": " + (e.remedy.empty() ? std::string(to_string(e.action)) : e.remedy);
  const std::string advice = advice_of(e);
  if (times == 1 && !advice.empty()) line += "; " + advice;
  if (!e.auto_fix.empty()) line += "; auto_fix in force: " + e.auto_fix;
  return line;
}

const std::string& run_narrator::observe(const step_event& e) {
  last_warning_.clear();
  if (e.action == action::data) return last_warning_;
  run_summary& s = summary_;
  if (++s.steps == 1) {
    s.first_lr = e.lr;
    s.initial_step = e.step - 1;
  }
  s.last_step = e.step;
  s.loss_scale = e.scale;
  s.lr = e.lr;
  if (!e.auto_fix.empty() && s.auto_fix != e.auto_fix) {
    s.auto_fix = e.auto_fix;
    s.auto_fix_since = e.step;
  }
  if (!bad(e)) {
    if (e.fault == fault_class::transient) {
      ++s.transient_faults;
      last_warning_ = fmt::format("nanguard: step {}: transient fault: {}", e.step, one_line(e.note));
    }
    if (s.first_step < 0) {
      s.first_step = e.step;
      s.first_loss = e.loss;
    }
    s.final_step = e.step;
    s.final_loss = e.loss;
    s.ended_on_snapshot.reset();
    if (e.forecast && !forecasting_)
      last_warning_ = fmt::format("nanguard: step {}: {}; lower the LR or clip the gradients (max_norm): the "
                                  "guard rolls back when 3 steps are left (policy auto or rollback)",
                                  e.step, to_string(*e.forecast));
    forecasting_ = e.forecast.has_value();
    return last_warning_;
  }
  ++s.not_taken;
  s.last_bad_step = e.step;
  const std::string cause = cause_of(e);
  s.last_cause = !cause.empty() ? cause : !e.reason.empty() ? e.reason : "non-finite step";
  if (e.action == action::rollback) {
    ++s.rolled_back;
    s.last_rollback_to = s.ended_on_snapshot = e.rollback_to;
  }
  s.aborted = s.aborted || e.action == action::abort;
  last_warning_ = warning_line(e, ++seen_[failure(e) + "|" + cause]);
  return last_warning_;
}

const char* run_status(const run_summary& s) {
  if (s.steps == 0) return "empty";
  if (s.not_taken == 0) return std::isfinite(s.final_loss) ? "finite" : "nonfinite";
  const int64_t window = std::clamp<int64_t>(s.steps / 10, 1, 10);
  if (s.aborted || s.first_step < 0 || s.last_step - s.final_step >= window || !std::isfinite(s.final_loss))
    return "nonfinite";
  if (s.ended_on_snapshot == s.initial_step || !(s.final_loss < s.first_loss)) return "unrecovered";
  return "recovered";
}

std::string to_string(const run_summary& s) {
  std::string line = fmt::format("nanguard: {} step{}", s.steps, s.steps == 1 ? "" : "s");
  if (s.not_taken == 0) {
    line += ", all taken";
  } else {
    line += fmt::format(", {} not taken ({} skipped{})", s.not_taken, s.not_taken - s.rolled_back,
                        s.rolled_back ? fmt::format(", {} rolled back", s.rolled_back) : "");
    line += fmt::format("; last bad step {} [{}]", s.last_bad_step, s.last_cause);
  }
  if (s.first_step < 0) {
    line += "; no step was taken: the model is as it started";
  } else {
    line += fmt::format("; loss {:.4g} (step {})", s.first_loss, s.first_step);
    if (s.final_step > s.first_step) line += fmt::format(" -> {:.4g} (step {})", s.final_loss, s.final_step);
    if (s.final_step > s.first_step && !(s.final_loss < s.first_loss)) line += ", not below the first";
  }
  if (s.transient_faults > 0)
    line += fmt::format("; {} transient fault{} (the step ran again and was taken)", s.transient_faults,
                        s.transient_faults == 1 ? "" : "s");
  if (s.loss_scale != 1) line += fmt::format("; loss scale {:.6g}", s.loss_scale);
  if (s.ended_on_snapshot == s.initial_step)
    line += fmt::format("; ended on its initial weights (rolled back to before step {})", s.initial_step + 1);
  else if (s.ended_on_snapshot)
    line += fmt::format("; ended on the weights of step {} (rolled back)", *s.ended_on_snapshot);
  else if (s.last_rollback_to == s.initial_step)
    line += fmt::format("; the last rollback restored the initial weights (before step {})", s.initial_step + 1);
  if (s.rolled_back > 0 && s.lr < s.first_lr)
    line += fmt::format("; lr {:.4g} -> {:.4g} (cut by rollbacks): start the next run at lr <= {:.4g}", s.first_lr,
                        s.lr, s.lr);
  if (!s.auto_fix.empty())
    line += fmt::format("; auto_fix kept {} from step {}: make it a change to the model", s.auto_fix, s.auto_fix_since);
  if (s.aborted) line += fmt::format("; stopped at step {} (abort)", s.last_bad_step);
  return line;
}

}  // namespace nanguard
