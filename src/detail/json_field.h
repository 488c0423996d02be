// json_field.h — the fields of a JSON object nanguard wrote (an event line,
// a bundle's meta.json, a finding), read back with errors that name the
// field, what it should be and what it is, instead of the JSON library's
// "[json.exception.type_error.302] type must be number, but is string".
#pragma once

#include "json_number.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace nanguard::detail {

using json = nlohmann::json;

/// What a field read as T should hold, for the error message.
template <typename T>
constexpr const char* json_expected() {
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  else if constexpr (std::is_same_v<T, bool>) return "true or false";
  else if constexpr (std::is_integral_v<T>) return "an integer";
  else if constexpr (std::is_same_v<T, double>) return "a number (or \"nan\", \"inf\", \"-inf\")";
  else if constexpr (std::is_same_v<T, std::vector<int64_t>>) return "a list of integers";
  else if constexpr (std::is_same_v<T, json::array_t>) return "a list";
  else return "an object";
}

/// True when `v` holds a T.
template <typename T>
bool json_holds(const json& v) {
  if constexpr (std::is_same_v<T, std::string>) return v.is_string();
  else if constexpr (std::is_same_v<T, bool>) return v.is_boolean();
  else if constexpr (std::is_integral_v<T>) return v.is_number_integer();
  else if constexpr (std::is_same_v<T, double>)
    return v.is_number() || (v.is_string() && (v == "nan" || v == "inf" || v == "-inf"));
  else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (!v.is_array()) return false;
    for (const json& e : v)
      if (!e.is_number_integer()) return false;
    return true;
  } else if constexpr (std::is_same_v<T, json::array_t>) return v.is_array();
  else return v.is_object();
}

/// Field `key` of `j` as T; `where` (the reader and its file) begins the
/// c10::Error when it is missing or holds another type.
template <typename T>
T json_field(const json& j, const char* key, const std::string& where) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  TORCH_CHECK(it != j.end(), where, ": '", key, "' is missing", j.is_object() ? "" : " (expected an object)");
  if (!json_holds<T>(*it)) {
    std::string shown = it->dump();
    if (shown.size() > 40) shown = shown.substr(0, 37) + "...";
    TORCH_CHECK(false, where, ": '", key, "' should be ", json_expected<T>(), " but is ",
                it->is_number() ? "a number" : it->is_array() ? "a list" : it->is_object() ? "an object"
                : it->is_string() ? "a string" : it->is_boolean() ? "a boolean" : "null", " (", shown, ")");
  }
  if constexpr (std::is_same_v<T, double>) return number_from_json(*it, where.c_str());
  else return it->get<T>();
}

/// Field `key` of `j` as T, or `fallback` when `j` has no such field.
template <typename T>
T json_field(const json& j, const char* key, const T& fallback, const std::string& where) {
  return j.contains(key) ? json_field<T>(j, key, where) : fallback;
}

}  // namespace nanguard::detail
