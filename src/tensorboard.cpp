#include "nanguard/tensorboard.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

namespace nanguard {
namespace {

namespace fs = std::filesystem;

// ------------------------------------------------------------ CRC-32C
// Table-driven, reflected polynomial 0x82F63B78 (Castagnoli).
std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// ------------------------------------------------------------ protobuf
// The few wire types nanguard writes: varint (0), 64-bit (1), length-
// delimited (2) and 32-bit (5).
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (uint64_t(field) << 3) | wire_type); }

template <typename T>
void put_fixed(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

void put_uint(std::string& out, uint32_t field, uint64_t v) {
  put_key(out, field, 0);
  put_varint(out, v);
}

// Event { wall_time = 1 (double), step = 2 (int64), file_version = 3, summary = 5 }.
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed<double>(e, wall_time);
  if (step != 0) put_uint(e, 2, uint64_t(step));  // int64: two's complement as varint
  return e;
}

std::string event_with_summary(const std::string& summary, int64_t step, double wall_time) {
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

// Summary.Value { tag = 1, simple_value = 2 (float) }.
std::string scalar_value(const std::string& tag, float v) {
  std::string value;
  put_bytes(value, 1, tag);
  put_key(value, 2, 5);
  put_fixed<float>(value, v);
  return value;
}

// Summary.Value { tag = 1, tensor = 8, metadata = 9 } as the text plugin reads it:
// SummaryMetadata { plugin_data = 1 { plugin_name = 1 "text" } } (content, the
// TextPluginData of version 0, serializes empty and is left out, as protobuf does),
// TensorProto { dtype = 1 DT_STRING (7), tensor_shape = 2 { dim = 2 { size = 1 } }, string_val = 8 }.
std::string text_value(const std::string& tag, const std::string& text) {
  std::string plugin_data;
  put_bytes(plugin_data, 1, "text");
  std::string metadata;
  put_bytes(metadata, 1, plugin_data);
  std::string dim;
  put_uint(dim, 1, 1);
  std::string shape;
  put_bytes(shape, 2, dim);
  std::string tensor;
  put_uint(tensor, 1, 7);
  put_bytes(tensor, 2, shape);
  put_bytes(tensor, 8, text);
  std::string value;
  put_bytes(value, 1, tag);
  put_bytes(value, 8, tensor);
  put_bytes(value, 9, metadata);
  return value;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)
    if (c == '/') c = '_';
  return h;
}

// A log directory to write into: made when missing; a clear error otherwise.
void make_logdir(const std::string& logdir) {
  TORCH_CHECK(!logdir.empty(), "nanguard::tensorboard_writer: the log directory is empty; name one, e.g. runs/train");
  std::error_code ec;
  if (fs::exists(logdir, ec)) {
    TORCH_CHECK(fs::is_directory(logdir, ec), "nanguard::tensorboard_writer: '", logdir,
                "' is a file, not a directory; TensorBoard reads a directory of event files: name a new or "
                "existing directory, e.g. runs/train");
    return;
  }
  fs::create_directories(logdir, ec);
  TORCH_CHECK(!ec, "nanguard::tensorboard_writer: cannot create the directory '", logdir, "': ", ec.message(),
              "; check that its parent exists, is a directory and is writable");
}

// events.out.tfevents.<seconds>.<host>, with .2, .3, ... when taken.
std::string new_event_file(const std::string& logdir) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  std::ostringstream name;
  name << "events.out.tfevents." << seconds << "." << host_name();
  const fs::path base = fs::path(logdir) / name.str();
  fs::path p = base;
  std::error_code ec;
  for (int n = 2; fs::exists(p, ec); ++n) p = base.string() + "." + std::to_string(n);
  return p.string();
}

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : bytes) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view payload) {
  std::string length;
  put_fixed<uint64_t>(length, payload.size());
  std::string out = length;
  put_fixed<uint32_t>(out, masked_crc32c(length));
  out.append(payload.data(), payload.size());
  put_fixed<uint32_t>(out, masked_crc32c(payload));
  return out;
}

std::string scalars_event(const std::vector<std::pair<std::string, float>>& scalars, int64_t step, double wall_time) {
  std::string summary;
  for (const auto& [tag, v] : scalars) put_bytes(summary, 1, scalar_value(tag, v));
  return event_with_summary(summary, step, wall_time);
}

std::string text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  std::string summary;
  put_bytes(summary, 1, text_value(tag, text));
  return event_with_summary(summary, step, wall_time);
}

tensorboard_writer::tensorboard_writer(const std::string& logdir) {
  make_logdir(logdir);
  path_ = new_event_file(logdir);
  file_ = std::fopen(path_.c_str(), "wb");
  TORCH_CHECK(file_ != nullptr, "nanguard::tensorboard_writer: cannot create '", path_, "': ", std::strerror(errno),
              "; check that the directory '", logdir, "' is writable");
  std::string version = event_header(now(), 0);
  put_bytes(version, 3, "brain.Event:2");
  write_record(version);
}

tensorboard_writer::~tensorboard_writer() {
  if (file_) std::fclose(file_);
}

double tensorboard_writer::now() {
  using namespace std::chrono;
  return duration_cast<duration<double>>(system_clock::now().time_since_epoch()).count();
}

void tensorboard_writer::write_record(const std::string& event) {
  const std::string record = tfrecord(event);
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_) == record.size() && std::fflush(file_) == 0;
  TORCH_CHECK(ok, "nanguard::tensorboard_writer: writing to '", path_, "' failed: ", std::strerror(errno),
              "; is the disk full?");
}

void tensorboard_writer::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  add_scalars({{tag, float(value)}}, step, wall_time);
}

void tensorboard_writer::add_scalars(const std::vector<std::pair<std::string, float>>& scalars, int64_t step,
                                     double wall_time) {
  write_record(scalars_event(scalars, step, wall_time));
}

void tensorboard_writer::add_text(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  write_record(text_event(tag, text, step, wall_time));
}

std::vector<std::pair<std::string, float>> step_scalars(const step_event& e) {
  std::vector<std::pair<std::string, float>> out;
  if (e.data) {
    const data_counts& d = *e.data;
    for (const auto& [key, v] : {std::pair<const char*, int64_t>{"checked", d.checked}, {"dropped", d.dropped},
                                 {"changed", d.changed}, {"repaired", d.repaired}, {"clipped", d.clipped},
                                 {"nan", d.nan}, {"pos_inf", d.pos_inf}, {"neg_inf", d.neg_inf},
                                 {"outliers", d.outliers}, {"raised", d.raised}})
      out.emplace_back(std::string("data/") + key, float(v));
    return out;
  }
  out = {{"loss", float(e.loss)},         {"grad_norm", float(e.grad_norm)}, {"lr", float(e.lr)},
         {"loss_scale", float(e.scale)},  {"clip_coef", float(e.clip_coef)}, {"skipped", e.skipped ? 1.0f : 0.0f}};
  for (const auto& [name, norm] : e.top_norms) out.emplace_back("grad_norm/" + name, float(norm));
  return out;
}

std::string step_text(const step_event& e) {
  std::vector<std::string> lines;
  for (const auto& f : e.findings)
    lines.push_back("- finding: " + to_string(f) + " (likely cause: " + to_string(f.diagnosis.cause) + ")");
  if (e.verdict != verdict::none) lines.push_back(std::string("- replay: ") + to_string(e.verdict));
  if (e.fault != fault_class::none) lines.push_back(std::string("- fault: ") + to_string(e.fault));
  if (!std::isfinite(e.loss) && !e.data) lines.push_back("- loss = " + format_number(e.loss));
  for (const auto& b : e.nonfinite_params)
    lines.push_back("- non-finite gradient: " + b.name + " (" + std::to_string(b.nonfinite) + " values)");
  if (!e.remedy.empty()) lines.push_back("- remedy: " + e.remedy);
  if (e.action == action::rollback && e.remedy.empty())
    lines.push_back("- rolled back to the snapshot of step " + std::to_string(e.rollback_to));
  if (!e.bundle.empty()) lines.push_back("- repro bundle: " + e.bundle);
  if (!e.note.empty()) lines.push_back("- note: " + e.note);
  if (lines.empty()) return "";
  std::string text = "**step " + std::to_string(e.step) + ": " + to_string(e.action) + "**\n\n";
  for (const auto& l : lines) text += l + "\n";
  return text;
}

void write_step_event(tensorboard_writer& writer, const step_event& e, double wall_time) {
  // A data event is plotted on its own axis: the number of the firewall's check.
  writer.add_scalars(step_scalars(e), e.data ? e.data->check : e.step, wall_time);
  const std::string text = step_text(e);
  if (!text.empty()) writer.add_text("nanguard/findings", text, e.step, wall_time);
}

}  // namespace nanguard
