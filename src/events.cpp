#include "nanguard/events.h"

#include "detail/json_number.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

namespace nanguard {
namespace {

using json = nlohmann::json;

json number(double v) { return detail::json_number(v); }
double number_from(const json& j) { return detail::number_from_json(j, "nanguard::step_event_from_json"); }

// The fields of a step event; a json::exception when one has the wrong type.
step_event event_from(const json& j) {
  step_event e;
  e.step = j.at("step").get<int64_t>();
  e.loss = number_from(j.value("loss", json(0.0)));
  e.grad_norm = number_from(j.value("grad_norm", json(0.0)));
  e.clip_coef = number_from(j.value("clip_coef", json(1.0)));
  e.scale = number_from(j.value("scale", json(1.0)));
  e.lr = number_from(j.value("lr", json(0.0)));
  e.skipped = j.value("skipped", false);
  e.action = j.at("action").get<std::string>();
  for (const auto& s : j.value("spikes", json::array()))
    e.spikes.push_back({s.at("series").get<std::string>(), number_from(s.at("value")), number_from(s.at("z"))});
  for (const auto& b : j.value("nonfinite_params", json::array()))
    e.nonfinite_params.push_back({b.at("name").get<std::string>(), b.at("nonfinite").get<int64_t>()});
  for (const auto& n : j.value("top_norms", json::array()))
    e.top_norms.emplace_back(n.at("name").get<std::string>(), number_from(n.at("norm")));
  e.rank = j.value("rank", int64_t(-1));
  e.nonfinite_ranks = j.value("nonfinite_ranks", std::vector<int64_t>());
  e.verdict = j.value("verdict", std::string());
  for (const auto& f : j.value("findings", json::array())) e.findings.push_back(finding_from_json(f.dump()));
  e.rollback_to = j.value("rollback_to", int64_t(-1));
  e.bundle = j.value("bundle", std::string());
  e.note = j.value("note", std::string());
  e.guard_ms = number_from(j.value("guard_ms", json(0.0)));
  return e;
}

}  // namespace

std::string to_json(const step_event& e) {
  json j;
  j["step"] = e.step;
  j["loss"] = number(e.loss);
  j["grad_norm"] = number(e.grad_norm);
  j["clip_coef"] = number(e.clip_coef);
  j["scale"] = number(e.scale);
  j["lr"] = number(e.lr);
  j["skipped"] = e.skipped;
  j["action"] = e.action;
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
  if (!e.verdict.empty()) j["verdict"] = e.verdict;
  json findings = json::array();
  for (const auto& f : e.findings) findings.push_back(json::parse(nanguard::to_json(f)));
  j["findings"] = findings;
  if (e.rollback_to >= 0) j["rollback_to"] = e.rollback_to;
  if (!e.bundle.empty()) j["bundle"] = e.bundle;
  if (!e.note.empty()) j["note"] = e.note;
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
  TORCH_CHECK(j.is_object() && j.contains("step") && j.contains("action"),
              "nanguard::step_event_from_json: expected an object with 'step' and 'action' but got: ",
              line.substr(0, 200));
  try {
    return event_from(j);
  } catch (const json::exception& ex) {
    TORCH_CHECK(false, "nanguard::step_event_from_json: a field has the wrong type (", ex.what(), "): ",
                line.substr(0, 200));
  }
}

event_log::event_log(const std::string& path, bool truncate) : path_(path) {
  file_ = std::fopen(path.c_str(), truncate ? "w" : "a");
  TORCH_CHECK(file_ != nullptr, "nanguard::event_log: cannot open '", path, "' for writing: ",
              std::strerror(errno), "; check that the directory exists and is writable");
}

event_log::~event_log() {
  if (file_) std::fclose(file_);
}

void event_log::write(const step_event& e) {
  const std::string line = to_json(e) + "\n";
  const bool ok = std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
  TORCH_CHECK(ok, "nanguard::event_log: writing to '", path_, "' failed: ", std::strerror(errno),
              "; is the disk full?");
}

std::vector<step_event> read_events(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "nanguard::read_events: cannot open '", path, "'; pass the path the guard's "
              "event_log option named");
  std::vector<step_event> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(step_event_from_json(line));
  return out;
}

}  // namespace nanguard
