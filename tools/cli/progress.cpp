#include "progress.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace nanguard::cli {
namespace {

std::string number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.4g}", v);
}

}  // namespace

progress::progress(int64_t total, std::string label, int64_t every, std::FILE* stream)
    : total_(std::max<int64_t>(total, 0)),
      label_(std::move(label)),
      every_(every > 0 ? every : std::max<int64_t>(1, (total_ + 9) / 10)),
      stream_(stream),
      tty_(stream != nullptr && ::isatty(::fileno(stream))),
      start_(std::chrono::steady_clock::now()),
      last_draw_() {}

progress::~progress() { finish(); }

std::string progress::line() const {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = secs > 0 ? double(updates_) / secs : 0.0;
  const int width = int(std::to_string(total_).size());
  std::string s = fmt::format("{} step {:>{}}/{} {:6.1f} steps/s  loss {}  grad norm {}  scale {}", label_, step_,
                              width, total_, rate, number(last_.loss), number(last_.grad_norm),
                              number(last_.scale));
  if (skipped_ > 0) s += fmt::format("  skipped {}", skipped_);
  if (last_.skipped) s += fmt::format("  [{}]", to_string(last_.action));
  return s;
}

void progress::print(bool final) {
  if (!stream_) return;
  const std::string s = line();
  if (tty_) {
    // Pad over what was there, then return to the line's start.
    const size_t pad = drawn_width_ > s.size() ? drawn_width_ - s.size() : 0;
    std::fprintf(stream_, "\r%s%*s%s", s.c_str(), int(pad), "", final ? "\n" : "");
    drawn_width_ = s.size();
  } else {
    std::fprintf(stream_, "%s\n", s.c_str());
  }
  std::fflush(stream_);
}

void progress::update(const step_event& e) {
  if (finished_) return;
  last_ = e;
  step_ = e.step;
  ++updates_;
  if (e.skipped) ++skipped_;
  if (tty_) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_draw_ >= std::chrono::milliseconds(100)) {
      last_draw_ = now;
      print(false);
    }
  } else if (step_ % every_ == 0 || step_ == total_) {
    printed_at_ = updates_;
    print(false);
  }
}

void progress::note(const std::string& line) {
  if (!stream_ || line.empty()) return;
  // On a terminal: over the progress line (padded), which the next update draws again below.
  const size_t pad = tty_ && drawn_width_ > line.size() ? drawn_width_ - line.size() : 0;
  std::fprintf(stream_, "%s%s%*s\n", tty_ ? "\r" : "", line.c_str(), int(pad), "");
  std::fflush(stream_);
  drawn_width_ = 0;
}

void progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (updates_ == 0) return;
  if (tty_) print(true);
  else if (printed_at_ != updates_) print(true);  // the last step, if not printed yet
}

}  // namespace nanguard::cli
