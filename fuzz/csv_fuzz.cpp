// csv_fuzz — the CSV reader over any bytes, read in chunks of any size (the
// first byte picks it: 16 to 79, the least the reader takes being 16) so that rows and quoted fields cross chunk
// ends, with ',' or ';' as the separator (the first byte's high bit).
#include "fuzz_input.h"

#include <nanguard/csv.h>

#include <ATen/ATen.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace nanguard;
  if (size == 0) return 0;
  const auto options = csv_options().chunk_bytes(16 + data[0] % 64).delimiter(data[0] & 0x80 ? ';' : ',');
  const std::string path = (fuzz::scratch_dir() / "input.csv").string();
  fuzz::write_bytes(path, data + 1, size - 1);
  fuzz::expect_clear_error(path, [&] {
    csv_reader in(path, options);
    for (at::Tensor rows = in.next_batch(3); rows.size(0) > 0; rows = in.next_batch(3))
      if (rows.size(1) != int64_t(in.columns().size())) std::abort();
  });
  return 0;
}
