#include "nanguard/events.h"
#include "nanguard/step_signature.h"

#include "detail/enum_from_string.h"
#include "detail/json_field.h"
#include "detail/json_number.h"
#include "detail/printable.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <unistd.h>

namespace nanguard {
namespace {

using json = nlohmann::json;

json number(double v) { return detail::json_number(v); }
using detail::json_field;
const std::string kWhere = "nanguard::step_event_from_json";

// The counts of a data_counts, in the order they are written.
constexpr std::pair<const char*, int64_t data_counts::*> kDataCounts[] = {
    {"checked", &data_counts::checked}, {"dropped", &data_counts::dropped},   {"changed", &data_counts::changed},
    {"repaired", &data_counts::repaired}, {"clipped", &data_counts::clipped}, {"nan", &data_counts::nan},
    {"pos_inf", &data_counts::pos_inf}, {"neg_inf", &data_counts::neg_inf}, {"outliers", &data_counts::outliers},
    {"raised", &data_counts::raised}};

json data_json(const data_counts& d) {
  json j;
  j["source"] = d.source;
  j["check"] = d.check;
  for (const auto& [key, member] : kDataCounts) j[key] = d.*member;
  if (!d.dropped_rows.empty()) j["dropped_rows"] = d.dropped_rows;
  if (!d.changed_rows.empty()) j["changed_rows"] = d.changed_rows;
  j["row_index"] = d.row_index;
  return j;
}

// `check`: what a log written before "check" existed numbered it with (its
// "step").
data_counts data_from_json(const json& j, int64_t check) {
  TORCH_CHECK(j.is_object(), kWhere, ": \"data\" must be an object of counts, got ", j.dump());
  data_counts d;
  d.source = json_field<std::string>(j, "source", "", kWhere);
  d.check = json_field<int64_t>(j, "check", check, kWhere);
  for (const auto& [key, member] : kDataCounts) {
    d.*member = json_field<int64_t>(j, key, 0, kWhere);
    TORCH_CHECK(d.*member >= 0, kWhere, ": data count \"", key, "\" must be >= 0, got ", d.*member);
  }
  d.dropped_rows = json_field<std::vector<int64_t>>(j, "dropped_rows", {}, kWhere);
  d.changed_rows = json_field<std::vector<int64_t>>(j, "changed_rows", {}, kWhere);
  d.row_index = json_field<std::string>(j, "row_index", "batch", kWhere);
  TORCH_CHECK(d.row_index == "batch" || d.row_index == "dataset" || d.row_index == "stream", kWhere,
              ": \"row_index\" must be \"batch\", \"dataset\" or \"stream\", got \"", d.row_index, "\"");
  return d;
}

}  // namespace

const char* to_string(action a) {
  switch (a) {
    case action::step: return "step";
    case action::skip: return "skip";
    case action::backoff: return "backoff";
    case action::rollback: return "rollback";
    case action::abort: return "abort";
    case action::data: return "data";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: action ", static_cast<int>(a), " has no name");
}

action action_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_actions, "action");
}

const char* to_string(verdict v) {
  switch (v) {
    case verdict::none: return "";
    case verdict::reproduced: return "reproduced";
    case verdict::not_reproduced: return "not reproduced";
    case verdict::replay_failed: return "replay failed";
    case verdict::compiled_only: return "compiled only";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: verdict ", static_cast<int>(v), " has no name");
}

verdict verdict_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_verdicts, "verdict");
}

const char* to_string(fault_class c) {
  switch (c) {
    case fault_class::none: return "";
    case fault_class::data: return "data";
    case fault_class::model: return "model";
    case fault_class::compiler: return "compiler";
    case fault_class::transient: return "transient";
    case fault_class::persistent: return "persistent";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: fault class ", static_cast<int>(c), " has no name");
}

fault_class fault_class_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_fault_classes, "fault_class");
}

std::string to_json(const step_event& e) {
  json j;
  if (e.data) {  // no training step: its own axis (data.check), no loss
    j["action"] = to_string(e.action);
    j["data"] = data_json(*e.data);
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  j["step"] = e.step;
  j["loss"] = number(e.loss);
  j["grad_norm"] = number(e.grad_norm);
  j["clip_coef"] = number(e.clip_coef);
  j["scale"] = number(e.scale);
  j["lr"] = number(e.lr);
  j["skipped"] = e.skipped;
  j["action"] = to_string(e.action);
  if (!e.reason.empty()) j["reason"] = e.reason;
  json spikes = json::array();
  for (const auto& s : e.spikes) spikes.push_back({{"series", s.series}, {"value", number(s.value)}, {"z", number(s.z)}});
  j["spikes"] = spikes;
  json bad = json::array();
  for (const auto& b : e.nonfinite_params) bad.push_back({{"name", b.name}, {"nonfinite", b.nonfinite}});
  j["nonfinite_params"] = bad;
  json norms = json::array();
  for (const auto& [name, norm] : e.top_norms) norms.push_back({{"name", name}, {"norm", number(norm)}});
  j["top_norms"] = norms;
  if (e.rank >= 0) j["rank"] = e.rank;
  if (!e.nonfinite_ranks.empty()) j["nonfinite_ranks"] = e.nonfinite_ranks;
  if (e.verdict != verdict::none) j["verdict"] = to_string(e.verdict);
  if (e.fault != fault_class::none) j["fault"] = to_string(e.fault);
  if (e.signature != 0) j["signature"] = signature_text(e.signature);
  json findings = json::array();
  for (const auto& f : e.findings) findings.push_back(json::parse(nanguard::to_json(f)));
  j["findings"] = findings;
  if (e.action == action::rollback) j["rollback_to"] = e.rollback_to;
  if (!e.bundle.empty()) j["bundle"] = e.bundle;
  if (!e.remedy.empty()) j["remedy"] = e.remedy;
  if (!e.note.empty()) j["note"] = e.note;
  if (!e.auto_fix.empty()) j["auto_fix"] = e.auto_fix;
  if (e.forecast) {
    const range_forecast& f = *e.forecast;
    j["forecast"] = {{"series", f.series},       {"value", number(f.value)},
                     {"growth", number(f.growth)}, {"limit", number(f.limit)},
                     {"steps_left", f.steps_left}};
  }
  j["guard_ms"] = number(e.guard_ms);
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

step_event step_event_from_json(const std::string& line) {
  json j;
  try {
    j = json::parse(line);
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, "nanguard::step_event_from_json: not JSON (", ex.what(), "): ", line.substr(0, 200));
  }
  TORCH_CHECK(j.is_object(), kWhere, ": expected a JSON object but got: ", line.substr(0, 200));
  const auto value = [&](const char* key, double fallback) { return json_field<double>(j, key, fallback, kWhere); };
  const auto list = [&](const char* key) { return json_field<json::array_t>(j, key, {}, kWhere); };
  step_event e;
  if (j.contains("data") && j.value("action", json()) == "data") {
    e.action = action::data;
    // Logs written before data events had their own axis numbered the checks as steps.
    e.data = data_from_json(j["data"], json_field<int64_t>(j, "step", 0, kWhere));
    return e;
  }
  e.step = json_field<int64_t>(j, "step", kWhere);
  e.loss = value("loss", 0.0);
  e.grad_norm = value("grad_norm", 0.0);
  e.clip_coef = value("clip_coef", 1.0);
  e.scale = value("scale", 1.0);
  e.lr = value("lr", 0.0);
  e.skipped = json_field<bool>(j, "skipped", false, kWhere);
  e.action = action_from_string(json_field<std::string>(j, "action", kWhere));
  e.reason = json_field<std::string>(j, "reason", "", kWhere);
  for (const json& s : list("spikes"))
    e.spikes.push_back({json_field<std::string>(s, "series", kWhere), json_field<double>(s, "value", kWhere),
                        json_field<double>(s, "z", kWhere)});
  for (const json& b : list("nonfinite_params"))
    e.nonfinite_params.push_back({json_field<std::string>(b, "name", kWhere), json_field<int64_t>(b, "nonfinite", kWhere)});
  for (const json& n : list("top_norms"))
    e.top_norms.emplace_back(json_field<std::string>(n, "name", kWhere), json_field<double>(n, "norm", kWhere));
  e.rank = json_field<int64_t>(j, "rank", -1, kWhere);
  e.nonfinite_ranks = json_field<std::vector<int64_t>>(j, "nonfinite_ranks", {}, kWhere);
  e.verdict = verdict_from_string(json_field<std::string>(j, "verdict", "", kWhere));
  e.fault = fault_class_from_string(json_field<std::string>(j, "fault", "", kWhere));
  e.signature = signature_from_text(json_field<std::string>(j, "signature", "", kWhere));
  for (const json& f : list("findings")) e.findings.push_back(finding_from_json(f.dump()));
  e.rollback_to = json_field<int64_t>(j, "rollback_to", -1, kWhere);
  e.bundle = json_field<std::string>(j, "bundle", "", kWhere);
  e.remedy = json_field<std::string>(j, "remedy", "", kWhere);
  e.note = json_field<std::string>(j, "note", "", kWhere);
  e.auto_fix = json_field<std::string>(j, "auto_fix", "", kWhere);
  if (j.contains("forecast")) {
    const json& f = j.at("forecast");
    e.forecast = range_forecast{json_field<std::string>(f, "series", kWhere), json_field<double>(f, "value", kWhere),
                                json_field<double>(f, "growth", kWhere), json_field<double>(f, "limit", kWhere),
                                json_field<int64_t>(f, "steps_left", kWhere)};
  }
  e.guard_ms = value("guard_ms", 0.0);
  TORCH_CHECK(!j.contains("data") && e.action != action::data, kWhere, ": step ", e.step,
              e.action == action::data ? std::string(": action \"data\" without the \"data\" counts")
                                       : std::string(": has \"data\" counts but its action is \"") +
                                             to_string(e.action) + "\" (a data event's is \"data\")");
  return e;
}

namespace {

[[noreturn]] void throw_event_log_error(std::string message) {
  throw event_log_error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(message));
}

}  // namespace

event_log::event_log(const std::string& path, bool truncate) : path_(path) {
  // Opened for appending even after truncating it: lines other writers
  // append to the same log (nanguard.data's data events) are never
  // overwritten.
  if (truncate) {
    if (std::FILE* emptied = std::fopen(path.c_str(), "w")) std::fclose(emptied);
  }
  file_ = std::fopen(path.c_str(), "a");
  if (!file_)
    throw_event_log_error(fmt::format("nanguard::event_log: cannot open '{}' for writing: {}; check that the "
                                      "directory exists and is writable", path, std::strerror(errno)));
}

event_log::~event_log() {
  if (file_) std::fclose(file_);
}

void event_log::write(const step_event& e) {
  const std::string line = to_json(e) + "\n";
  // Whole lines only: a write cut short (a full disk) is taken back, so
  // that the log stays readable. The FILE only owns the descriptor.
  const int fd = fileno(file_);
  const off_t end = ::lseek(fd, 0, SEEK_END);
  for (size_t written = 0; written < line.size();) {
    const ssize_t n = ::write(fd, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(n < 0 ? errno : ENOSPC);
      const bool taken_back = end >= 0 && ::ftruncate(fd, end) == 0;
      throw_event_log_error(fmt::format(
          "nanguard::event_log: writing to '{}' failed: {}; is the disk full? Step {} was already taken or "
          "skipped (do not run it again); {}",
          path_, why, e.step,
          taken_back ? "the log ends with the whole line before its event" : "the log's last line may be cut short"));
    }
    written += static_cast<size_t>(n);
  }
}

std::vector<step_event> read_events(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "nanguard::read_events: cannot open event log '", path, "': ", std::strerror(errno),
              "; pass the path the guard's event_log option named");
  std::vector<step_event> out;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      out.push_back(step_event_from_json(line));
    } catch (const c10::Error& e) {
      // The message quotes the line and its strings: their control bytes are shown, not sent to the terminal.
      TORCH_CHECK(false, path, ":", number, ": not a step event: ", detail::printable(e.what_without_backtrace()),
                  "; every line must be one JSON object as the guard's event_log writes it");
    }
  }
  return out;
}

}  // namespace nanguard
