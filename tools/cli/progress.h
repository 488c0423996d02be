// progress.h — a progress display for long CLI work (training steps).
//
// On a terminal (stderr is a TTY) it is one line rewritten in place, at most
// ten times a second: step/total, steps/s, loss, grad norm, loss scale and
// the count of skipped steps. When stderr is not a TTY (a log file, CI) it
// prints a plain line every `every` steps and for the last one.
//
//   nanguard::cli::progress p(total_steps, "train");
//   for (...) p.update(guard.step(batch, fn));
//   p.finish();  // ends the line on a terminal
#pragma once

#include <nanguard/events.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace nanguard::cli {

/// Shows the progress of `total` steps on stderr (or another stream).
class progress {
 public:
  /// `label` starts each line; `every` is the plain-line interval when the
  /// stream is not a TTY (0: about 10 lines for the whole run).
  progress(int64_t total, std::string label, int64_t every = 0, std::FILE* stream = stderr);
  /// Ends the line if finish() was not called.
  ~progress();
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;

  /// Records one finished step (its number, loss, grad norm, scale, skipped).
  void update(const step_event& e);
  /// Prints `line` (a warning) on a line of its own, above the progress on
  /// a terminal; "" prints nothing.
  void note(const std::string& line);
  /// Prints the last state and ends the line; later calls do nothing.
  void finish();
  /// True when the stream is a terminal (the line is rewritten in place).
  bool interactive() const { return tty_; }
  /// The line for the current state, without newline or carriage return.
  std::string line() const;

 private:
  void print(bool final);

  int64_t total_;
  std::string label_;
  int64_t every_;
  std::FILE* stream_;
  bool tty_;
  bool finished_ = false;
  int64_t step_ = 0;       // the last step seen
  int64_t updates_ = 0;    // update() calls
  int64_t skipped_ = 0;    // steps the optimizer did not take
  int64_t printed_at_ = 0;  // update count at the last plain line
  step_event last_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  size_t drawn_width_ = 0;  // chars of the line on the terminal now
};

}  // namespace nanguard::cli
