// finding_json.cpp — a finding's JSON form (to_json, finding_from_json).
// Apart from finding.cpp because reading diagnoses a finding written before
// diagnoses existed: this file calls diagnose() (diagnosis.cpp), which reads
// findings, so it sits above both and neither calls back into it.
#include "nanguard/diagnosis.h"
#include "nanguard/finding.h"

#include "detail/enum_from_string.h"
#include "detail/json_field.h"
#include "detail/json_number.h"

#include <nlohmann/json.hpp>

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

// The value of the enum field `key` of `j`, among `values`.
template <typename E, size_t N>
E enum_field(const json& j, const char* key, const E (&values)[N]) {
  return detail::enum_field_from_string(json_field<std::string>(j, key, kWhere), values, kWhere.c_str(), key);
}

diagnosis diagnosis_from(const json& j) {
  return {enum_field(j, "cause", all_causes), json_field<std::string>(j, "evidence", kWhere),
          json_field<std::string>(j, "remedy", kWhere), enum_field(j, "confidence", all_confidences)};
}

json checks_json(const std::vector<remedy_check>& checks) {
  json out = json::array();
  for (const remedy_check& c : checks)
    out.push_back({{"remedy", to_string(c.remedy)},
                   {"applied", c.applied},
                   {"result", to_string(c.result)},
                   {"loss", number(c.loss)},
                   {"detail", c.detail}});
  return out;
}

// A finding written before remedies were checked has no "remedy_checks".
std::vector<remedy_check> checks_from(const json& j) {
  std::vector<remedy_check> out;
  if (!j.contains("remedy_checks")) return out;
  for (const json& c : json_field<json::array_t>(j, "remedy_checks", kWhere))
    out.push_back({enum_field(c, "remedy", all_remedy_kinds), json_field<std::string>(c, "applied", kWhere),
                   enum_field(c, "result", all_check_results), json_field<double>(c, "loss", kWhere),
                   json_field<std::string>(c, "detail", kWhere)});
  return out;
}

// The finding's source line; unknown in a finding written before they were recorded.
source_location source_from(const json& j) {
  if (!j.contains("source")) return {};
  const json& s = json_field<json::object_t>(j, "source", kWhere);
  return {json_field<std::string>(s, "file", kWhere), json_field<int64_t>(s, "line", kWhere),
          json_field<std::string>(s, "function", kWhere)};
}

}  // namespace

std::string to_json(const finding& f) {
  const json j = {{"step", f.step},
                  {"source", {{"file", f.source.file}, {"line", f.source.line}, {"function", f.source.function}}},
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
                  {"position", element_position(f)},
                  {"dataset_index", f.dataset_index},
                  {"value", number(f.value)},
                  {"thread", f.thread},
                  {"sequence_nr", f.sequence_nr},
                  {"backtrace", f.backtrace},
                  {"rank", f.rank},
                  {"diagnosis", diagnosis_json(f.diagnosis)},
                  {"remedy_checks", checks_json(f.remedy_checks)}};
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
  f.source = source_from(j);
  f.op = text_of("op");
  f.caller = json_field<std::string>(j, "caller", "", kWhere);
  f.direction = enum_field(j, "direction", all_directions);
  f.node = text_of("node");
  f.forward_op = text_of("forward_op");
  f.role = enum_field(j, "role", all_roles);
  f.module = text_of("module");
  f.culprit = text_of("culprit");
  f.inputs = records_from(j, "inputs");
  f.outputs = records_from(j, "outputs");
  f.output = integer("output");
  f.index = integer("index");
  f.dataset_index = json_field<int64_t>(j, "dataset_index", -1, kWhere);
  f.value = json_field<double>(j, "value", kWhere);
  f.thread = json_field<uint64_t>(j, "thread", kWhere);
  f.sequence_nr = integer("sequence_nr");
  f.backtrace = text_of("backtrace");
  f.rank = json_field<int64_t>(j, "rank", -1, kWhere);
  f.diagnosis =
      j.contains("diagnosis") ? diagnosis_from(json_field<json::object_t>(j, "diagnosis", kWhere)) : diagnose(f);
  f.remedy_checks = checks_from(j);
  return f;
}

}  // namespace nanguard
