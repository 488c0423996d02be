// event_log_fuzz — the event-log reader (what `nanguard report` reads) over
// any bytes: JSON lines of any shape, types and numbers.
#include "fuzz_input.h"

#include <nanguard/events.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = (nanguard::fuzz::scratch_dir() / "events.jsonl").string();
  nanguard::fuzz::write_bytes(path, data, size);
  nanguard::fuzz::expect_clear_error(path, [&] { nanguard::read_events(path); });
  return 0;
}
