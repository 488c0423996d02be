// Uses the installed nanguard: must build against the exported config and run.
#include <nanguard/nanguard.h>

#include <ATen/ATen.h>

#include <cmath>
#include <iostream>

int main() {
  at::Tensor x = at::ones({8});
  x[3] = std::nan("");
  const nanguard::tensor_stats s = nanguard::census(x);
  std::cout << s << "\n";
  return (s.nan == 1 && s.first_nonfinite_index == 3 && nanguard::has_nonfinite(x)) ? 0 : 1;
}
