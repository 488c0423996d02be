// The TensorBoard event-file writer: CRC-32C against known vectors, TFRecord
// framing, Event bytes against what protobuf itself serializes (reference
// bytes taken from tensorboard's event_pb2 and torch's text summary), the
// file a writer leaves, the tags of a step, and the data events of the log.
// (python/tests/test_tensorboard.py reads the files with tensorboard's own
// EventAccumulator.)
#include "nanguard/tensorboard.h"

#include "support.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

namespace {

namespace fs = std::filesystem;
using nanguard::test::error_of;

std::string hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

template <typename T>
T read_le(const std::string& s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

// The payloads of a TFRecord file; fails the test on a bad length or CRC.
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  size_t at = 0;
  while (at < s.size()) {
    EXPECT_LE(at + 12, s.size()) << "truncated header at " << at;
    if (at + 12 > s.size()) break;
    const uint64_t n = read_le<uint64_t>(s, at);
    EXPECT_EQ(nanguard::masked_crc32c(std::string_view(s.data() + at, 8)), read_le<uint32_t>(s, at + 8));
    EXPECT_LE(at + 12 + n + 4, s.size()) << "truncated record at " << at;
    if (at + 12 + n + 4 > s.size()) break;
    std::string payload = s.substr(at + 12, n);
    EXPECT_EQ(nanguard::masked_crc32c(payload), read_le<uint32_t>(s, at + 12 + n));
    out.push_back(std::move(payload));
    at += 12 + n + 4;
  }
  return out;
}

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("nanguard_tb_test_" + std::to_string(::getpid()));
  temp_dir() { fs::remove_all(path); }
  ~temp_dir() { fs::remove_all(path); }
};

TEST(tensorboard, crc32c_known_vectors) {
  EXPECT_EQ(0xE3069283u, nanguard::crc32c("123456789"));
  EXPECT_EQ(0x8A9136AAu, nanguard::crc32c(std::string(32, '\0')));      // RFC 3720 B.4
  EXPECT_EQ(0x62A8AB43u, nanguard::crc32c(std::string(32, '\xff')));    // RFC 3720 B.4
  EXPECT_EQ(0u, nanguard::crc32c(""));
  EXPECT_EQ(0x364B3FB7u, nanguard::crc32c("abc"));
}

TEST(tensorboard, masked_crc32c_matches_tensorboards) {
  // tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c
  EXPECT_EQ(0xC78AB0E5u, nanguard::masked_crc32c("123456789"));
  EXPECT_EQ(0xA282EAD8u, nanguard::masked_crc32c(""));
  EXPECT_EQ(0x21F1576Eu, nanguard::masked_crc32c("abc"));
}

TEST(tensorboard, record_framing) {
  const std::string r = nanguard::tfrecord("abc");
  ASSERT_EQ(8u + 4 + 3 + 4, r.size());
  EXPECT_EQ(3u, read_le<uint64_t>(r, 0));
  EXPECT_EQ(0x0E4999B0u, read_le<uint32_t>(r, 8));  // masked CRC of the 8 length bytes, from tensorboard
  EXPECT_EQ("abc", r.substr(12, 3));
  EXPECT_EQ(0x21F1576Eu, read_le<uint32_t>(r, 15));
  EXPECT_EQ(12u + 4, nanguard::tfrecord("").size());
}

TEST(tensorboard, events_are_the_bytes_protobuf_writes) {
  // event_pb2.Event(wall_time=1.5, step=7, summary=Summary(value=[Value(tag="loss", simple_value=0.25)]))
  EXPECT_EQ("09000000000000f83f10072a0d0a0b0a046c6f7373150000803e",
            hex(nanguard::scalars_event({{"loss", 0.25f}}, 7, 1.5)));
  // Event(wall_time=1.5, step=7, summary=torch.utils.tensorboard.summary.text("nanguard/findings", "hi"))
  EXPECT_EQ("09000000000000f83f10072a3a0a380a1e6e616e67756172642f66696e64696e67732f746578745f73756d6d617279420c08071204"
            "12020801420268694a080a060a0474657874",
            hex(nanguard::text_event("nanguard/findings/text_summary", "hi", 7, 1.5)));
}

TEST(tensorboard, writer_makes_the_directory_and_a_tensorflow_named_file) {
  temp_dir tmp;
  const fs::path dir = tmp.path / "runs" / "a";
  std::string path;
  {
    nanguard::tensorboard_writer tb(dir.string());
    path = tb.path();
    tb.add_scalar("loss", 0.5, 1, 1.5);
    tb.add_text("notes", "hello", 1, 1.5);
    // Flushed per record: readable before the writer closes.
    EXPECT_EQ(3u, read_records(path).size());
  }
  EXPECT_EQ(dir, fs::path(path).parent_path());
  EXPECT_EQ(0u, fs::path(path).filename().string().rfind("events.out.tfevents.", 0)) << path;
  const auto records = read_records(path);
  ASSERT_EQ(3u, records.size());
  EXPECT_NE(std::string::npos, records[0].find("brain.Event:2"));
  EXPECT_EQ(nanguard::scalars_event({{"loss", 0.5f}}, 1, 1.5), records[1]);
  // A second writer in the same second gets a file of its own.
  nanguard::tensorboard_writer a(dir.string()), b(dir.string());
  EXPECT_NE(a.path(), b.path());
}

TEST(tensorboard, a_file_as_the_directory_is_refused_by_name) {
  temp_dir tmp;
  fs::create_directories(tmp.path);
  const std::string file = (tmp.path / "plain").string();
  std::ofstream(file) << "x";
  const std::string msg = error_of([&] { nanguard::tensorboard_writer tb(file); });
  EXPECT_NE(std::string::npos, msg.find("'" + file + "' is a file, not a directory")) << msg;
  const std::string below = error_of([&] { nanguard::tensorboard_writer tb(file + "/sub"); });
  EXPECT_NE(std::string::npos, below.find("cannot create the directory '" + file + "/sub'")) << below;
  EXPECT_NE(std::string::npos, error_of([] { nanguard::tensorboard_writer tb(""); }).find("is empty"));
}

TEST(tensorboard, step_tags_and_text) {
  nanguard::step_event e;
  e.step = 4;
  e.loss = NAN;
  e.grad_norm = 2;
  e.lr = 0.1;
  e.scale = 1024;
  e.clip_coef = 0.5;
  e.skipped = true;
  e.action = nanguard::action::skip;
  e.top_norms = {{"head.weight", 3}, {"body.bias", 1}};
  e.remedy = "skipped the step";
  std::map<std::string, float> tags;
  for (const auto& [tag, v] : nanguard::step_scalars(e)) tags[tag] = v;
  ASSERT_EQ(8u, tags.size());
  EXPECT_TRUE(std::isnan(tags["loss"]));
  EXPECT_EQ(2.0f, tags["grad_norm"]);
  EXPECT_EQ(0.1f, tags["lr"]);
  EXPECT_EQ(1024.0f, tags["loss_scale"]);
  EXPECT_EQ(0.5f, tags["clip_coef"]);
  EXPECT_EQ(1.0f, tags["skipped"]);
  EXPECT_EQ(3.0f, tags["grad_norm/head.weight"]);
  EXPECT_EQ(1.0f, tags["grad_norm/body.bias"]);
  const std::string text = nanguard::step_text(e);
  EXPECT_NE(std::string::npos, text.find("**step 4: skip**")) << text;
  EXPECT_NE(std::string::npos, text.find("- remedy: skipped the step")) << text;
  EXPECT_NE(std::string::npos, text.find("- loss = nan")) << text;
  nanguard::step_event healthy;
  healthy.step = 5;
  EXPECT_EQ("", nanguard::step_text(healthy));
}

TEST(tensorboard, data_events_have_their_own_tags) {
  nanguard::step_event e;
  e.step = 2;
  e.action = nanguard::action::data;
  e.data = nanguard::data_counts{};
  e.data->checked = 32;
  e.data->dropped = 3;
  e.data->nan = 4;
  std::map<std::string, float> tags;
  for (const auto& [tag, v] : nanguard::step_scalars(e)) tags[tag] = v;
  EXPECT_EQ(10u, tags.size());
  EXPECT_EQ(32.0f, tags["data/checked"]);
  EXPECT_EQ(3.0f, tags["data/dropped"]);
  EXPECT_EQ(4.0f, tags["data/nan"]);
  EXPECT_EQ(0u, tags.count("loss"));
}

TEST(events, data_event_round_trip_and_checks) {
  nanguard::step_event e;
  e.step = 3;
  e.action = nanguard::action::data;
  e.data = nanguard::data_counts{};
  e.data->source = "firewall_collate";
  e.data->checked = 16;
  e.data->repaired = 2;
  e.data->changed = 1;
  e.data->pos_inf = 2;
  e.data->raised = 1;
  const auto back = nanguard::step_event_from_json(nanguard::to_json(e));
  ASSERT_TRUE(back.data.has_value());
  EXPECT_EQ("firewall_collate", back.data->source);
  EXPECT_EQ(16, back.data->checked);
  EXPECT_EQ(2, back.data->repaired);
  EXPECT_EQ(1, back.data->changed);
  EXPECT_EQ(2, back.data->pos_inf);
  EXPECT_EQ(1, back.data->raised);
  EXPECT_FALSE(nanguard::step_event_from_json(R"({"step": 1, "action": "step"})").data.has_value());
  EXPECT_NE(std::string::npos, error_of([] { nanguard::step_event_from_json(R"({"step": 1, "action": "data"})"); })
                                   .find("action \"data\" without the \"data\" counts"));
  EXPECT_NE(std::string::npos,
            error_of([] { nanguard::step_event_from_json(R"({"step": 1, "action": "step", "data": {}})"); })
                .find("has \"data\" counts but its action is \"step\""));
  EXPECT_NE(std::string::npos,
            error_of([] { nanguard::step_event_from_json(R"({"step": 1, "action": "data", "data": {"dropped": -1}})"); })
                .find("\"dropped\" must be >= 0"));
}

}  // namespace
