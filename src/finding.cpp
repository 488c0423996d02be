#include "nanguard/finding.h"

#include "detail/json_field.h"
#include "detail/json_number.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace nanguard {
namespace {

using nlohmann::json;

json number(double v) { return detail::json_number(v); }
using detail::json_field;
const std::string kWhere = "nanguard::finding_from_json";

// A field of tensor_stats in JSON: a count as it is, a value as json_number.
json field_json(int64_t count) { return count; }
json field_json(double value) { return number(value); }

json stats_json(const tensor_stats& s) {
  json j = json::object();
  for_each_stats_field([&](const char* name, auto field) { j[name] = field_json(s.*field); });
  return j;
}

tensor_stats stats_from(const json& j) {
  tensor_stats s;
  for_each_stats_field([&](const char* name, auto field) {
    using value_type = std::remove_reference_t<decltype(s.*field)>;
    s.*field = json_field<value_type>(j, name, kWhere);
  });
  return s;
}

json records_json(const std::vector<tensor_record>& records) {
  json out = json::array();
  for (const auto& r : records)
    out.push_back({{"name", r.name}, {"dtype", r.dtype}, {"shape", r.shape}, {"stats", stats_json(r.stats)}});
  return out;
}

std::vector<tensor_record> records_from(const json& j, const char* key) {
  std::vector<tensor_record> out;
  for (const json& r : json_field<json::array_t>(j, key, kWhere))
    out.push_back({json_field<std::string>(r, "name", kWhere), json_field<std::string>(r, "dtype", kWhere),
                   json_field<std::vector<int64_t>>(r, "shape", kWhere),
                   stats_from(json_field<json::object_t>(r, "stats", kWhere))});
  return out;
}

json diagnosis_json(const diagnosis& d) {
  return {{"cause", to_string(d.cause)},
          {"evidence", d.evidence},
          {"remedy", d.remedy},
          {"confidence", to_string(d.confidence)}};
}

diagnosis diagnosis_from(const json& j) {
  return {cause_from_string(json_field<std::string>(j, "cause", kWhere)),
          json_field<std::string>(j, "evidence", kWhere), json_field<std::string>(j, "remedy", kWhere),
          confidence_from_string(json_field<std::string>(j, "confidence", kWhere))};
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// "nan", "inf", "-inf" (fmt would print "-nan" for some NaNs).
std::string value_string(double v) {
  if (std::isnan(v)) return "nan";
  return fmt::format("{}", v);
}

}  // namespace

const char* to_string(direction d) { return d == direction::forward ? "forward" : "backward"; }

const char* to_string(role r) {
  switch (r) {
    case role::producer: return "producer";
    case role::propagator: return "propagator";
    default: return "input";
  }
}

std::string to_string(const finding& f) {
  std::string where = f.module.empty() ? "" : " in " + f.module;
  std::string node = f.node.empty() ? "" : fmt::format(" ({} of {})", f.node, f.forward_op.empty() ? "?" : f.forward_op);
  std::string culprit = f.culprit.empty() ? "" : fmt::format(" from {}", f.culprit);
  std::string rank = f.rank >= 0 ? fmt::format(" rank {}", f.rank) : "";
  return fmt::format("step {}{} {} {}{}{}: {}{}, output {} [{}] = {}", f.step, rank, to_string(f.direction), f.op,
                     node, where, to_string(f.role), culprit, f.output, f.index, value_string(f.value));
}

std::string to_text(const finding& f) {
  std::string out = fmt::format("non-finite value at step {}{}\n", f.step,
                                f.rank >= 0 ? fmt::format(" on rank {}", f.rank) : "");
  out += fmt::format("  op:        {} ({}{})\n", f.op, to_string(f.direction),
                     f.caller.empty() ? "" : ", inside " + f.caller);
  if (!f.node.empty())
    out += fmt::format("  node:      {} (created by forward {})\n", f.node,
                       f.forward_op.empty() ? "?" : f.forward_op);
  out += fmt::format("  module:    {}\n", f.module.empty() ? "(unknown)" : f.module);
  out += fmt::format("  role:      {}{}\n", to_string(f.role),
                     f.culprit.empty() ? "" : " (non-finite " + f.culprit + ")");
  out += fmt::format("  element:   output {} flat index {} = {}\n", f.output, f.index, value_string(f.value));
  for (const auto* group : {&f.inputs, &f.outputs})
    for (const auto& r : *group)
      out += fmt::format("  {:<10} {} {}: {}\n", r.name + ":", r.dtype, shape_string(r.shape),
                         to_string(r.stats));
  const diagnosis& d = f.diagnosis;
  out += fmt::format("  cause:     {} ({} confidence)\n", to_string(d.cause), to_string(d.confidence));
  out += fmt::format("  evidence:  {}\n", d.evidence);
  out += fmt::format("  remedy:    {}\n", d.remedy);
  if (!f.backtrace.empty()) out += "  backtrace:\n" + f.backtrace + "\n";
  return out;
}

std::string to_json(const finding& f) {
  const json j = {{"step", f.step},
                  {"op", f.op},
                  {"caller", f.caller},
                  {"direction", to_string(f.direction)},
                  {"node", f.node},
                  {"forward_op", f.forward_op},
                  {"role", to_string(f.role)},
                  {"module", f.module},
                  {"culprit", f.culprit},
                  {"inputs", records_json(f.inputs)},
                  {"outputs", records_json(f.outputs)},
                  {"output", f.output},
                  {"index", f.index},
                  {"value", number(f.value)},
                  {"thread", f.thread},
                  {"sequence_nr", f.sequence_nr},
                  {"backtrace", f.backtrace},
                  {"rank", f.rank},
                  {"diagnosis", diagnosis_json(f.diagnosis)}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

finding finding_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "nanguard::finding_from_json: not valid JSON (", e.what(), ")");
  }
  const auto text_of = [&](const char* key) { return json_field<std::string>(j, key, kWhere); };
  const auto integer = [&](const char* key) { return json_field<int64_t>(j, key, kWhere); };
  finding f;
  f.step = integer("step");
  f.op = text_of("op");
  f.caller = json_field<std::string>(j, "caller", "", kWhere);
  const std::string d = text_of("direction");
  TORCH_CHECK(d == "forward" || d == "backward", kWhere, ": 'direction' is '", d,
              "'; expected \"forward\" or \"backward\"");
  f.direction = d == "backward" ? direction::backward : direction::forward;
  f.node = text_of("node");
  f.forward_op = text_of("forward_op");
  const std::string r = text_of("role");
  TORCH_CHECK(r == "producer" || r == "propagator" || r == "input", kWhere, ": 'role' is '", r,
              "'; expected \"producer\", \"propagator\" or \"input\"");
  f.role = r == "producer" ? role::producer : r == "propagator" ? role::propagator : role::input;
  f.module = text_of("module");
  f.culprit = text_of("culprit");
  f.inputs = records_from(j, "inputs");
  f.outputs = records_from(j, "outputs");
  f.output = integer("output");
  f.index = integer("index");
  f.value = json_field<double>(j, "value", kWhere);
  f.thread = json_field<uint64_t>(j, "thread", kWhere);
  f.sequence_nr = integer("sequence_nr");
  f.backtrace = text_of("backtrace");
  f.rank = json_field<int64_t>(j, "rank", -1, kWhere);
  f.diagnosis =
      j.contains("diagnosis") ? diagnosis_from(json_field<json::object_t>(j, "diagnosis", kWhere)) : diagnose(f);
  return f;
}

namespace {

// What a nonfinite_error says: where the value was born, its likely cause and the remedy.
std::string error_message(const finding& f) {
  std::string m = "nanguard: non-finite value: " + to_string(f) + "; cause: " + to_string(f.diagnosis.cause);
  if (!f.diagnosis.remedy.empty()) m += "; remedy: " + f.diagnosis.remedy;
  std::replace(m.begin(), m.end(), '\n', ' ');
  return m;
}

}  // namespace

nonfinite_error::nonfinite_error(nanguard::finding f)
    : c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, error_message(f)), finding_(std::move(f)) {}

}  // namespace nanguard
