#include "nanguard/spelling.h"

#include <atomic>

namespace nanguard {
namespace {

std::atomic<spelling> process_spelling{spelling::cpp};

}  // namespace

spelling message_spelling() { return process_spelling.load(std::memory_order_relaxed); }

void set_message_spelling(spelling s) { process_spelling.store(s, std::memory_order_relaxed); }

const char* spelled(const char* cpp, const char* python) {
  return message_spelling() == spelling::python ? python : cpp;
}

}  // namespace nanguard
