// replay_main — runs a harness over files, without libFuzzer: the test suite
// replays the seed corpus and every input a fuzzing run found a bug with
// (fuzz/regressions), in the normal build.
//
//   csv_fuzz_replay fuzz/corpus/csv_fuzz fuzz/regressions/csv_fuzz
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    if (!fs::is_directory(argv[i])) continue;  // a harness with no regressions yet
    for (const auto& entry : fs::directory_iterator(argv[i])) {
      std::ifstream in(entry.path(), std::ios::binary);
      const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::printf("%s\n", entry.path().c_str());
      std::fflush(stdout);  // the input a crash came from is the last line printed
      LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
      ++replayed;
    }
  }
  std::printf("replayed %d inputs\n", replayed);
  return replayed > 0 ? 0 : 1;
}
