#include "nanguard/bundle.h"
#include "nanguard/version.h"

#include "detail/json_field.h"
#include "detail/json_number.h"
#include "detail/pickle_lengths.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <sstream>

namespace nanguard {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

json number(double v) { return detail::json_number(v); }

void write_file(const fs::path& path, const char* data, size_t size) {
  std::ofstream out(path, std::ios::binary);
  out.write(data, std::streamsize(size));
  out.flush();
  TORCH_CHECK(out.good(), "nanguard::write_bundle: cannot write '", path.string(),
              "'; check that the directory is writable and the disk not full");
}

// torch::pickle_save without type tags on lists and dicts: torch.load's
// default weights_only=True (torch >= 2.6) refuses the tag's global
// (torch.jit._pickle.restore_type_tag), and lists and dicts of tensors
// load the same without it. The container is torch.save's zip format.
std::vector<char> pickle_untagged(const c10::IValue& v) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* p, size_t n) { pickled.insert(pickled.end(), p, p + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(v);
  pickler.stop();
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    out.insert(out.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return out;
}

void save(const fs::path& path, const c10::IValue& v) {
  const std::vector<char> bytes = pickle_untagged(v);
  write_file(path, bytes.data(), bytes.size());
}

// The first line of an error message (torch's own errors span several).
std::string first_line(const std::string& what) { return what.substr(0, what.find('\n')); }

// A .pt file stores its records uncompressed: none, and no length its
// pickle declares, can exceed the file (torch would reserve what they say).
void check_declared_sizes(const std::vector<char>& bytes) {
  std::istringstream stream(std::string(bytes.begin(), bytes.end()));
  caffe2::serialize::PyTorchStreamReader reader(&stream);
  for (const std::string& name : reader.getAllRecords())
    TORCH_CHECK(reader.getRecordSize(name) <= bytes.size(), "its record '", name, "' declares ",
                reader.getRecordSize(name), " bytes, more than the file's ", bytes.size());
  TORCH_CHECK(reader.hasRecord("data.pkl"), "it holds no data.pkl record");
  const auto [pickle, size] = reader.getRecord("data.pkl");
  detail::check_pickle_lengths(static_cast<const char*>(pickle.get()), size);
}

c10::IValue load(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "nanguard::read_bundle: '", path.string(), "' is missing; is this a directory "
              "written by write_bundle?");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string why;
  try {
    check_declared_sizes(bytes);
    return torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    why = e.what_without_backtrace();  // what() carries a C++ backtrace
  } catch (const std::exception& e) {
    why = e.what();
  }
  TORCH_CHECK(false, "nanguard::read_bundle: '", path.string(), "' is truncated or corrupt (", first_line(why),
              "); write the bundle again");
}

// A plain list (None for an undefined tensor): a typed tensor list pickles
// as torch.jit._pickle.build_tensorlist, which torch.load refuses under its
// default weights_only=True (torch >= 2.6), as it does type tags.
c10::IValue tensor_list(const std::vector<at::Tensor>& ts) {
  c10::impl::GenericList l(c10::AnyType::get());
  for (const auto& t : ts) l.push_back(t.defined() ? c10::IValue(t.detach().cpu()) : c10::IValue());
  return l;
}

std::vector<at::Tensor> from_list(const c10::IValue& v, const fs::path& path) {
  TORCH_CHECK(v.isTensorList() || v.isList(), "nanguard::read_bundle: '", path.string(),
              "' should hold a list of tensors but holds ", v.tagKind());
  std::vector<at::Tensor> out;
  for (const auto& e : v.toListRef()) out.push_back(e.isTensor() ? e.toTensor() : at::Tensor());
  return out;
}

}  // namespace

std::string write_bundle(const std::string& parent, const bundle& b) {
  std::error_code ec;
  fs::create_directories(parent, ec);
  TORCH_CHECK(!ec, "nanguard::write_bundle: cannot create '", parent, "': ", ec.message());
  const fs::path tmp = fs::path(parent) / fmt::format(".tmp-step-{}-{}", b.step, ::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  TORCH_CHECK(!ec, "nanguard::write_bundle: cannot create '", tmp.string(), "': ", ec.message());
  // A write that fails (a full disk) leaves no half-written bundle behind.
  struct remove_unless_renamed {
    const fs::path& dir;
    ~remove_unless_renamed() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } cleanup{tmp};

  json meta;
  meta["format"] = "nanguard-bundle/1";
  meta["step"] = b.step;
  meta["lr"] = number(b.lr);
  meta["scale"] = number(b.scale);
  meta["loss"] = number(b.loss);
  meta["policy"] = b.policy ? to_string(*b.policy) : "";
  meta["verdict"] = to_string(b.verdict);
  meta["versions"] = {{"nanguard", version()}, {"torch", TORCH_VERSION}};
  meta["finding"] = b.finding ? json::parse(to_json(*b.finding)) : json(nullptr);
  meta["note"] = b.note;
  meta["tags"] = json::object();
  for (const auto& [key, value] : b.tags) meta["tags"][key] = value;
  meta["files"] = {"batch.pt", "rng_state.pt", "cuda_rng_state.pt", "culprit_inputs.pt", "parameters.pt"};
  const std::string text = meta.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  write_file(tmp / "meta.json", text.data(), text.size());

  save(tmp / "batch.pt", tensor_list(b.batch));
  save(tmp / "rng_state.pt", b.rng_state.defined() ? b.rng_state : at::empty({0}, at::kByte));
  save(tmp / "cuda_rng_state.pt", tensor_list(b.cuda_rng_states));
  save(tmp / "culprit_inputs.pt", tensor_list(b.culprit_inputs));
  c10::Dict<std::string, at::Tensor> params;
  for (const auto& [name, t] : b.parameters) params.insert(name, t.detach().cpu());
  save(tmp / "parameters.pt", params);

  fs::path dest = fs::path(parent) / fmt::format("step-{:06d}", b.step);
  for (int k = 2; fs::exists(dest); ++k) dest = fs::path(parent) / fmt::format("step-{:06d}-{}", b.step, k);
  fs::rename(tmp, dest, ec);
  TORCH_CHECK(!ec, "nanguard::write_bundle: cannot rename '", tmp.string(), "' to '", dest.string(),
              "': ", ec.message());
  return dest.string();
}

bundle read_bundle(const std::string& dir) {
  const fs::path d(dir);
  std::ifstream in(d / "meta.json");
  TORCH_CHECK(in, "nanguard::read_bundle: '", (d / "meta.json").string(),
              "' is missing; pass the directory write_bundle returned");
  json meta;
  try {
    in >> meta;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "nanguard::read_bundle: '", (d / "meta.json").string(), "' is not JSON: ", e.what());
  }
  // Every field is optional; one of the wrong type is an error naming the file.
  const std::string where = "nanguard::read_bundle: '" + (d / "meta.json").string() + "'";
  TORCH_CHECK(meta.is_object(), where, " should hold a JSON object but holds ", meta.dump().substr(0, 40));
  using detail::json_field;
  bundle b;
  b.step = json_field<int64_t>(meta, "step", -1, where);
  b.lr = json_field<double>(meta, "lr", 0.0, where);
  b.scale = json_field<double>(meta, "scale", 1.0, where);
  b.loss = json_field<double>(meta, "loss", 0.0, where);
  const std::string policy = json_field<std::string>(meta, "policy", "", where);
  const std::string verdict = json_field<std::string>(meta, "verdict", "", where);
  try {  // an unknown name is an error naming the file as well
    if (!policy.empty()) b.policy = policy_from_string(policy);
    b.verdict = verdict_from_string(verdict);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": ", e.what_without_backtrace());
  }
  const json versions = json_field<json::object_t>(meta, "versions", {}, where);
  b.nanguard_version = json_field<std::string>(versions, "nanguard", "", where);
  b.torch_version = json_field<std::string>(versions, "torch", "", where);
  b.note = json_field<std::string>(meta, "note", "", where);  // none in bundles written before it was kept
  for (const auto& [key, value] : json_field<json::object_t>(meta, "tags", {}, where))
    b.tags.emplace_back(key, value.is_string() ? value.get<std::string>() : value.dump());
  if (meta.contains("finding") && !meta["finding"].is_null()) {
    try {
      b.finding = finding_from_json(meta["finding"].dump());
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, where, ": its finding: ", e.what_without_backtrace());
    }
  }
  b.batch = from_list(load(d / "batch.pt"), d / "batch.pt");
  const c10::IValue rng = load(d / "rng_state.pt");
  TORCH_CHECK(rng.isTensor(), "nanguard::read_bundle: '", (d / "rng_state.pt").string(), "' should hold a tensor");
  b.rng_state = rng.toTensor();
  // Bundles written before CUDA generators were kept have no such file.
  if (fs::exists(d / "cuda_rng_state.pt"))
    b.cuda_rng_states = from_list(load(d / "cuda_rng_state.pt"), d / "cuda_rng_state.pt");
  b.culprit_inputs = from_list(load(d / "culprit_inputs.pt"), d / "culprit_inputs.pt");
  const c10::IValue params = load(d / "parameters.pt");
  const std::string params_path = (d / "parameters.pt").string();
  TORCH_CHECK(params.isGenericDict(), "nanguard::read_bundle: '", params_path, "' should hold a dict");
  for (const auto& e : params.toGenericDict()) {
    TORCH_CHECK(e.key().isString() && e.value().isTensor(), "nanguard::read_bundle: '", params_path,
                "' should map names to tensors but holds a ", e.key().tagKind(), " -> ", e.value().tagKind(),
                " entry");
    b.parameters.emplace_back(e.key().toStringRef(), e.value().toTensor());
  }
  return b;
}

}  // namespace nanguard
