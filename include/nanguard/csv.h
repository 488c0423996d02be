// csv.h — a fast, streaming reader and an atomic writer for numeric CSV files.
//
// The data firewall reads training data from CSV: a header row, then numeric
// cells. Missing values may be written as an empty cell, NA, N/A, NaN, null
// or None (read as NaN); inf, +inf, -inf, Infinity are read as ±Inf. Quoted
// fields ("1.5", "a, b") are understood. The reader streams the file in
// chunks, so files larger than memory can be scanned batch by batch:
//
//   nanguard::csv_reader in("train.csv");
//   while (true) {
//     at::Tensor batch = in.next_batch(65536);  // [rows, columns] float64
//     if (batch.size(0) == 0) break;
//     stats.update(batch);
//   }
//
// Errors (a missing or empty file, a ragged row, a cell that is not a number)
// throw c10::Error naming the file, the line and the column.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace nanguard {
namespace detail {
struct csv_piece;
}  // namespace detail

struct csv_table;

/// Options of `csv_reader` and `read_csv`.
struct csv_options {
  /// The field separator.
  TORCH_ARG(char, delimiter) = ',';
  /// Bytes read from the file at a time (the reader's memory is about this).
  /// The threads that parse a chunk meet once per chunk: on a busy machine
  /// a meeting waits for a descheduled thread, so chunks are large.
  TORCH_ARG(int64_t, chunk_bytes) = int64_t(16) << 20;
  /// The file's name in error messages; empty: its path. E.g. the pipe that
  /// the file read is a temporary copy of.
  TORCH_ARG(std::string, name) = "";
};

/// Reads a numeric CSV file with a header row, one batch of rows at a time.
///
/// Each cell becomes a float64; missing cells become NaN. The reader never
/// holds more than one chunk of the file plus the batch it returns.
///
///   nanguard::csv_reader in("data.csv");
///   at::Tensor all = in.next_batch(1 << 20);  // up to 2^20 rows
class csv_reader {
 public:
  /// Opens `path` and reads its header row. Throws c10::Error when the file
  /// is missing, unreadable or empty, or the header is malformed or names a
  /// column twice.
  explicit csv_reader(std::string path, csv_options options = {});
  ~csv_reader();
  csv_reader(const csv_reader&) = delete;
  csv_reader& operator=(const csv_reader&) = delete;

  /// The column names from the header row.
  const std::vector<std::string>& columns() const { return columns_; }
  /// The file being read.
  const std::string& path() const { return path_; }
  /// Rows returned so far.
  int64_t rows_read() const { return rows_read_; }
  /// Bytes consumed from the file so far.
  int64_t bytes_read() const { return bytes_consumed_; }
  /// The 1-based file line on which the last row read ended (the header's
  /// line before any row): maps a row back to its line in the file.
  int64_t line() const { return line_; }

  /// Appends up to `max_rows` rows to `out` (row-major, columns().size()
  /// values a row) and returns how many it read; 0 at the end of the file.
  /// Throws c10::Error naming line and column for a ragged row or a cell
  /// that is not a number.
  int64_t read_rows(std::vector<double>& out, int64_t max_rows);

  /// The next up to `max_rows` rows as a [rows, columns] float64 tensor;
  /// a tensor with 0 rows at the end of the file.
  at::Tensor next_batch(int64_t max_rows);

 private:
  bool fill();  // reads more of the file; false at EOF with nothing new
  // read_rows and read_block into a std::vector<double> or read_csv's
  // detail::uninitialized_doubles (csv.cpp).
  template <typename Rows>
  int64_t read_rows_into(Rows& out, int64_t max_rows);
  template <typename Rows>
  int64_t read_block(Rows& out, int64_t max_rows);
  friend csv_table read_csv(const std::string& path, csv_options options);
  [[noreturn]] void fail_cell(const char* begin, const char* end, int64_t column) const;

  std::string path_;
  std::string name_;  // path_ as errors name it
  csv_options options_;
  // Closed however the reader ends, also when its constructor throws.
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_{nullptr, std::fclose};
  std::unique_ptr<char[]> buf_;
  int64_t buf_size_ = 0;
  int64_t begin_ = 0;  // first unparsed byte in buf_
  int64_t end_ = 0;    // one past the last valid byte in buf_
  bool eof_ = false;
  int64_t line_ = 0;  // 1-based line number of the last line parsed
  int64_t rows_read_ = 0;
  int64_t bytes_consumed_ = 0;
  std::vector<std::string> columns_;
  std::string field_;           // scratch for quoted fields
  std::vector<double> scratch_;  // next_batch's rows, reused: no heap churn per batch
  std::vector<detail::csv_piece> pieces_;  // read_block's, reused likewise
};

/// A whole numeric CSV file in memory.
struct csv_table {
  std::vector<std::string> columns;  ///< the header
  at::Tensor data;                   ///< [rows, columns] float64; NaN where missing
};

/// Reads all of `path` into memory (use `csv_reader` to stream large files).
///
///   auto t = nanguard::read_csv("data.csv");
///   at::Tensor x = t.data;  // [rows, columns] float64
csv_table read_csv(const std::string& path, csv_options options = {});

/// Writes CSV rows to a temporary file next to `path` and renames it into
/// place on `commit()`, so readers never see a half-written file.
///
///   nanguard::csv_writer out("clean.csv", {"a", "b"});
///   out.write(batch);  // [rows, 2]
///   out.commit();      // without commit(), the destructor removes the temp file
class csv_writer {
 public:
  /// Creates the temporary file and writes the header. Throws c10::Error
  /// when the directory is not writable.
  csv_writer(std::string path, std::vector<std::string> columns, char delimiter = ',');
  ~csv_writer();
  csv_writer(const csv_writer&) = delete;
  csv_writer& operator=(const csv_writer&) = delete;

  /// Appends the rows of a [rows, columns] floating tensor; NaN is written as
  /// an empty cell, ±Inf as inf / -inf, other values in the shortest form
  /// that reads back to the same double.
  void write(const at::Tensor& rows);
  /// Flushes, closes and renames the temporary file onto the path.
  void commit();
  /// The temporary file written until commit(), e.g. to remove on a signal.
  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string path_;
  std::string temp_path_;
  std::vector<std::string> columns_;
  char delimiter_;
  std::FILE* file_ = nullptr;
  std::string line_buf_;
};

/// Writes `data` ([rows, columns]) with a header atomically (temp + rename).
void write_csv(const std::string& path, const std::vector<std::string>& columns,
               const at::Tensor& data);

}  // namespace nanguard
