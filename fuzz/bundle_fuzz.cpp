// bundle_fuzz — the repro-bundle reader (what `nanguard inspect` and
// `replay` read) over a bundle with one file replaced by any bytes: the
// first byte picks meta.json or one of the .pt files, the rest is its
// content. The other files are those of a real bundle written at start.
#include "fuzz_input.h"

#include <nanguard/bundle.h>

#include <ATen/ATen.h>

#include <array>

namespace {

const std::array<const char*, 5> kFiles = {"meta.json", "batch.pt", "rng_state.pt", "culprit_inputs.pt",
                                           "parameters.pt"};

// A small bundle like the guard writes: the fuzzed file replaces one of its files.
std::filesystem::path write_valid_bundle() {
  nanguard::bundle b;
  b.step = 7;
  b.lr = 1e-3;
  b.loss = std::nan("");
  b.policy = nanguard::policy::abort;
  b.batch = {at::arange(6, at::kFloat).reshape({2, 3}), at::tensor({1, 0}, at::kLong)};
  b.rng_state = at::zeros({16}, at::kByte);
  b.culprit_inputs = {at::zeros({3})};
  b.parameters = {{"fc.weight", at::ones({2, 3})}, {"fc.bias", at::zeros({2})}};
  b.tags = {{"task", "classify"}};
  return nanguard::write_bundle((nanguard::fuzz::scratch_dir() / "valid").string(), b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const fs::path valid = write_valid_bundle();
  if (size == 0) return 0;
  const fs::path dir = nanguard::fuzz::scratch_dir() / "bundle";
  fs::remove_all(dir);
  fs::copy(valid, dir);
  const fs::path target = dir / kFiles[data[0] % kFiles.size()];
  nanguard::fuzz::write_bytes(target, data + 1, size - 1);
  nanguard::fuzz::expect_clear_error(target.string(), [&] { nanguard::read_bundle(dir.string()); });
  return 0;
}
