// Uses nanguard as a C++ project would (installed, or added from its source
// tree): must build with the umbrella header alone and run.
#include <nanguard/nanguard.h>

#include <ATen/ATen.h>
#include <torch/version.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <string>

int main() {
  at::Tensor x = at::ones({8});
  x[3] = std::nan("");
  const nanguard::tensor_stats s = nanguard::census(x);
  std::cout << s << "\ntorch " << TORCH_VERSION << "\n";
  // The exported link order binds std::filesystem to the system libstdc++,
  // not to the copy torch wheels export (remove_all crashed there).
  const auto dir = std::filesystem::temp_directory_path() / "nanguard_consumer";
  std::filesystem::create_directories(dir / "sub");
  std::filesystem::remove_all(dir);
  const bool same_torch = std::string(TORCH_VERSION) == EXPECTED_TORCH_VERSION;
  if (!same_torch) std::cerr << "built against torch " << TORCH_VERSION << ", expected " << EXPECTED_TORCH_VERSION << "\n";
  const bool same_version = std::string(NANGUARD_VERSION) == EXPECTED_NANGUARD_VERSION;
  if (!same_version) std::cerr << "nanguard " << NANGUARD_VERSION << ", expected " << EXPECTED_NANGUARD_VERSION << "\n";
  return (same_torch && same_version && s.nan == 1 && s.first_nonfinite_index == 3 && nanguard::has_nonfinite(x)) ? 0 : 1;
}
