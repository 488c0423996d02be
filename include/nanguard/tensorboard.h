// tensorboard.h — TensorBoard event files, written without TensorFlow or
// protobuf: TFRecord framing around hand-encoded `Event` messages, which
// TensorBoard (and tensorboard's own EventAccumulator) reads.
//
//   nanguard::tensorboard_writer tb("runs/guarded");   // creates the directory
//   tb.add_scalar("loss", 0.31, /*step=*/7);
//   tb.add_text("nanguard/findings", "step 7: **skip**", 7);
//   for (auto& e : nanguard::read_events("train.jsonl")) nanguard::write_step_event(tb, e);
//
// The file is `DIR/events.out.tfevents.<seconds>.<host>` as TensorFlow names
// it; its first record says `file_version: "brain.Event:2"`. Every add_*
// call writes one record and flushes it, so a crash loses at most the record
// being written (TensorBoard skips a truncated last record).
//
// The tags of one guarded step (the C++ writer here and Python's
// nanguard.tensorboard.StepLogger write the same ones):
// - loss, grad_norm, lr, loss_scale, clip_coef: the step event's values;
// - skipped: 1 when the optimizer did not step, else 0;
// - grad_norm/<parameter>: the per-parameter norms of top_norms;
// - nanguard/findings (text): findings, verdict, remedy and note of a bad step;
// - data/<count>: a data-firewall event (action "data"), one tag per count
//  of nanguard::data_counts (checked, dropped, changed, repaired, clipped,
//  nan, pos_inf, neg_inf, outliers, raised).
#pragma once

#include <nanguard/events.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace nanguard {

/// CRC-32C (Castagnoli) of `bytes`: crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view bytes);

/// TFRecord's masked CRC-32C: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(std::string_view bytes);

/// One TFRecord: uint64 length (little-endian), masked CRC-32C of those 8
/// bytes, the payload, masked CRC-32C of the payload.
std::string tfrecord(std::string_view payload);

/// The serialized `tensorflow.Event` of one summary of scalars (Summary.Value
/// with tag and simple_value), at `wall_time` seconds since the epoch.
std::string scalars_event(const std::vector<std::pair<std::string, float>>& scalars, int64_t step,
                          double wall_time);

/// The serialized `tensorflow.Event` of one text summary as tensorboard's text
/// plugin reads it: plugin_name "text", a DT_STRING tensor of shape [1].
std::string text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time);

/// Appends TensorBoard events to one new event file in a log directory.
class tensorboard_writer {
 public:
  /// Creates `logdir` (and its parents) when missing and opens a new event
  /// file in it (`events.out.tfevents.<seconds>.<host>`, `.2`, `.3`, ... when
  /// taken), whose first record is the file_version event. Throws c10::Error
  /// naming the directory when it is a file or cannot be created or written.
  explicit tensorboard_writer(const std::string& logdir);
  ~tensorboard_writer();
  tensorboard_writer(const tensorboard_writer&) = delete;
  tensorboard_writer& operator=(const tensorboard_writer&) = delete;

  /// Writes one scalar (a float, as TensorBoard stores it) and flushes.
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time = now());
  /// Writes several scalars of one step as one record (one Summary) and flushes.
  void add_scalars(const std::vector<std::pair<std::string, float>>& scalars, int64_t step,
                   double wall_time = now());
  /// Writes one text summary (Markdown, shown by the TEXT tab) and flushes.
  void add_text(const std::string& tag, const std::string& text, int64_t step, double wall_time = now());
  /// The event file it writes.
  const std::string& path() const { return path_; }
  /// Seconds since the epoch, as Event.wall_time holds them.
  static double now();

 private:
  void write_record(const std::string& event);

  std::string path_;
  std::FILE* file_ = nullptr;
};

/// The scalars of one step event under nanguard's tags (see the list above):
/// loss ... skipped and grad_norm/<parameter> for a step; data/<count> for a
/// data-firewall event. NaN and Inf values are kept (TensorBoard shows them).
std::vector<std::pair<std::string, float>> step_scalars(const step_event& e);

/// The Markdown text of a step's findings, verdict, remedy and note ("" when
/// there is none: a healthy step writes no text).
std::string step_text(const step_event& e);

/// Writes step_scalars(e) and step_text(e) (under "nanguard/findings") for
/// e.step: one record for the scalars, one for the text when there is some.
void write_step_event(tensorboard_writer& writer, const step_event& e, double wall_time = tensorboard_writer::now());

}  // namespace nanguard
