#include "nanguard/bundle.h"

#include "detail/pickle_lengths.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("nanguard_bundle_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

nanguard::bundle sample() {
  nanguard::bundle b;
  b.step = 42;
  b.lr = 1e-3;
  b.scale = 512;
  b.loss = INFINITY;
  b.policy = nanguard::policy::abort;
  b.verdict = nanguard::verdict::reproduced;
  b.note = "replay: the loss was inf";
  nanguard::finding f;
  f.step = 42;
  f.op = "aten::exp";
  f.module = "head";
  f.index = 3;
  f.value = INFINITY;
  b.finding = f;
  b.batch = {torch::randn({4, 3}), torch::arange(4)};
  b.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  b.cuda_rng_states = {torch::arange(16, torch::kUInt8)};  // a CUDA generator's seed and offset, as bytes
  b.culprit_inputs = {torch::full({5}, 100.0)};
  b.parameters = {{"head.weight", torch::randn({2, 3})}, {"head.bias", torch::zeros({2})}};
  return b;
}

TEST(bundle, round_trip) {
  const fs::path dir = fresh_dir("round_trip");
  const auto b = sample();
  const std::string path = nanguard::write_bundle(dir.string(), b);
  EXPECT_EQ((dir / "step-000042").string(), path);
  for (const char* f : {"meta.json", "batch.pt", "rng_state.pt", "cuda_rng_state.pt", "culprit_inputs.pt", "parameters.pt"})
    EXPECT_TRUE(fs::exists(fs::path(path) / f)) << f;
  const auto back = nanguard::read_bundle(path);
  EXPECT_EQ(42, back.step);
  EXPECT_EQ(1e-3, back.lr);
  EXPECT_EQ(512, back.scale);
  EXPECT_TRUE(std::isinf(back.loss));
  EXPECT_EQ(nanguard::policy::abort, back.policy);
  EXPECT_EQ(nanguard::verdict::reproduced, back.verdict);
  EXPECT_EQ("0.1.0", back.nanguard_version);
  EXPECT_EQ(TORCH_VERSION, back.torch_version);
  ASSERT_TRUE(back.finding.has_value());
  EXPECT_EQ("aten::exp", back.finding->op);
  EXPECT_EQ("head", back.finding->module);
  EXPECT_EQ(b.note, back.note);
  ASSERT_EQ(2u, back.batch.size());
  EXPECT_TRUE(at::equal(b.batch[0], back.batch[0]));
  EXPECT_TRUE(at::equal(b.batch[1], back.batch[1]));
  EXPECT_TRUE(at::equal(b.rng_state, back.rng_state));
  ASSERT_EQ(1u, back.cuda_rng_states.size());
  EXPECT_TRUE(at::equal(b.cuda_rng_states[0], back.cuda_rng_states[0]));
  ASSERT_EQ(1u, back.culprit_inputs.size());
  EXPECT_TRUE(at::equal(b.culprit_inputs[0], back.culprit_inputs[0]));
  ASSERT_EQ(2u, back.parameters.size());
  EXPECT_EQ("head.weight", back.parameters[0].first);
  EXPECT_TRUE(at::equal(b.parameters[0].second, back.parameters[0].second));
  // The stored RNG state replays the same draws.
  auto gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(back.rng_state);
  const auto first = torch::rand({3});
  gen.set_state(b.rng_state);
  EXPECT_TRUE(at::equal(first, torch::rand({3})));
  fs::remove_all(dir);
}

TEST(bundle, tags_round_trip_sorted_by_key) {
  const fs::path dir = fresh_dir("tags");
  auto b = sample();
  b.tags = {{"task", "classify"}, {"model", "m.pt"}};
  const auto back = nanguard::read_bundle(nanguard::write_bundle(dir.string(), b));
  ASSERT_EQ(2u, back.tags.size());
  EXPECT_EQ((std::pair<std::string, std::string>("model", "m.pt")), back.tags[0]);
  EXPECT_EQ((std::pair<std::string, std::string>("task", "classify")), back.tags[1]);
  EXPECT_TRUE(nanguard::read_bundle(nanguard::write_bundle(dir.string(), sample())).tags.empty());
  fs::remove_all(dir);
}

TEST(bundle, a_second_bundle_of_the_same_step_gets_a_suffix_and_no_temp_is_left) {
  const fs::path dir = fresh_dir("suffix");
  const auto b = sample();
  const std::string first = nanguard::write_bundle(dir.string(), b);
  const std::string second = nanguard::write_bundle(dir.string(), b);
  EXPECT_NE(first, second);
  EXPECT_EQ((dir / "step-000042-2").string(), second);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    ++entries;
    EXPECT_NE('.', e.path().filename().string()[0]) << e.path();
  }
  EXPECT_EQ(2, entries);
  fs::remove_all(dir);
}

TEST(bundle, truncated_files_are_named_in_one_line) {
  const fs::path dir = fresh_dir("truncated");
  const std::string path = nanguard::write_bundle(dir.string(), sample());
  for (const char* name : {"batch.pt", "parameters.pt", "meta.json"}) {
    const fs::path copy = dir / ("cut_" + std::string(name));
    fs::copy(path, copy);
    fs::resize_file(copy / name, fs::file_size(copy / name) / 2);
    try {
      nanguard::read_bundle(copy.string());
      ADD_FAILURE() << name;
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(std::string::npos, what.find((copy / name).string() + "' is")) << what;
      EXPECT_EQ(std::string::npos, what.find('\n')) << what;  // no C++ backtrace of torch's reader
    }
  }
  fs::remove_all(dir);
}

TEST(bundle, a_write_that_fails_leaves_nothing_behind) {
  const fs::path dir = fresh_dir("full");
  fs::create_directories(dir);
  nanguard::bundle b = sample();
  b.parameters = {{"big", torch::ones({1 << 18})}};  // 1 MiB
  // A full disk: writes beyond 64 KiB fail (EFBIG) while the limit holds.
  rlimit before{};
  ASSERT_EQ(0, ::getrlimit(RLIMIT_FSIZE, &before));
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = before;
  small.rlim_cur = 64 << 10;
  ASSERT_EQ(0, ::setrlimit(RLIMIT_FSIZE, &small));
  EXPECT_THROW(nanguard::write_bundle(dir.string(), b), c10::Error);
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(fs::is_empty(dir)) << fs::directory_iterator(dir)->path();
  fs::remove_all(dir);
}

TEST(bundle, python_torch_load_reads_the_tensors) {
  const fs::path dir = fresh_dir("python");
  const std::string path = nanguard::write_bundle(dir.string(), sample());
  const std::string script =
      "import torch, json, sys; d = sys.argv[1]; "
      "b = torch.load(d + '/batch.pt'); assert len(b) == 2 and list(b[0].shape) == [4, 3]; "
      "c = torch.load(d + '/culprit_inputs.pt'); assert float(c[0][0]) == 100.0; "
      "p = torch.load(d + '/parameters.pt'); assert list(p.keys()) == ['head.weight', 'head.bias']; "
      "r = torch.load(d + '/rng_state.pt'); assert r.dtype == torch.uint8; "
      "m = json.load(open(d + '/meta.json')); assert m['finding']['op'] == 'aten::exp'";
  EXPECT_EQ(0, std::system((std::string(NANGUARD_PYTHON) + " -c \"" + script + "\" " + path).c_str()));
  fs::remove_all(dir);
}

TEST(bundle, reading_a_directory_that_is_not_a_bundle_says_so) {
  const fs::path dir = fresh_dir("missing");
  fs::create_directories(dir);
  try {
    nanguard::read_bundle(dir.string());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("meta.json' is missing"));
  }
  const std::string path = nanguard::write_bundle(dir.string(), sample());
  fs::remove(fs::path(path) / "batch.pt");
  try {
    nanguard::read_bundle(path);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("batch.pt' is missing"));
  }
  fs::remove_all(dir);
}

// torch's unpickler reserves what a string opcode declares before reading
// it: a 2 KB corrupt file asked for 1.8 GB (fuzz/bundle_fuzz).
TEST(bundle, a_pickle_that_declares_more_than_it_holds_is_refused_before_torch_reads_it) {
  const std::string huge_string = std::string("\x80\x02X\xff\xff\xff\x7f", 7) + "abc.";
  try {
    nanguard::detail::check_pickle_lengths(huge_string.data(), huge_string.size());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what_without_backtrace()).find("declares 2147483647 bytes"));
  }
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("a string long enough for BINUNICODE", std::vector<int64_t>{1, 2, 3});
  d.insert("pi", 3.14);
  const std::vector<char> pickled = torch::jit::pickle(d, nullptr);  // the bare pickle stream
  ASSERT_EQ('\x80', pickled.front());
  EXPECT_NO_THROW(nanguard::detail::check_pickle_lengths(pickled.data(), pickled.size()));
}

}  // namespace
