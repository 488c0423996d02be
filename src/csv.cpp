#include "nanguard/csv.h"

#include "nanguard/spelling.h"

#include "detail/chunked_parallel.h"
#include "detail/default_init_allocator.h"
#include "detail/printable.h"
#include "detail/short_decimal.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string_view>
#include <unordered_map>
#include <unistd.h>

namespace nanguard {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
// read_block shares out pieces of at least this many bytes, when the caller
// asks for at least kBlockMinRows rows: fewer go line by line, e.g. one row
// at a time to map rows to lines.
constexpr int64_t kPieceBytes = int64_t(64) << 10;
constexpr int64_t kBlockMinRows = 256;

bool iequals(const char* b, const char* e, const char* word) {
  const size_t n = std::strlen(word);
  if (size_t(e - b) != n) return false;
  for (size_t i = 0; i < n; ++i) {
    char c = b[i];
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
    if (c != word[i]) return false;
  }
  return true;
}

// Whether a header row is a row of data: every field a number, one at least
// not a plain count (names such as "0", "1", "2" are real headers).
bool looks_like_data(const std::vector<std::string>& names) {
  bool fraction = false;
  for (const std::string& n : names) {
    double v = 0;
    const auto r = std::from_chars(n.data(), n.data() + n.size(), v);
    if (n.empty() || r.ec != std::errc() || r.ptr != n.data() + n.size()) return false;
    fraction = fraction || n.find_first_not_of("0123456789") != std::string::npos;
  }
  return fraction;
}

// What to do when the header is one column whose name holds another common
// delimiter ('a;b' of a file written with ';'); "" otherwise. The error
// alone blamed a cell ('1;2' is not a number) or a row's field count.
std::string other_delimiter_hint(const std::vector<std::string>& columns, char delimiter) {
  if (columns.size() != 1) return "";
  for (const char d : {';', '\t', '|', ','}) {
    if (d == delimiter || columns[0].find(d) == std::string::npos) continue;
    const std::string shown = d == '\t' ? "\\t" : std::string(1, d);
    return fmt::format("; the header is one column ('{}'): if the file is delimited by '{}', read it with that "
                       "delimiter ({}) or convert it",
                       detail::printable(columns[0]), shown,
                       spelled("csv_options().delimiter('", "read_csv(path, delimiter='") + shown + "')");
  }
  return "";
}

// Parses one cell; false when it is neither a number nor a missing-value token.
bool parse_cell(const char* b, const char* e, double& v) {
  while (b < e && (*b == ' ' || *b == '\t')) ++b;
  while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r')) --e;
  if (b == e) {
    v = kNaN;
    return true;
  }
  const char* s = b;
  if (*s == '+' && e - s > 1 && s[1] != '-' && s[1] != '+') ++s;  // from_chars rejects '+'
  const auto r = std::from_chars(s, e, v);
  if (r.ptr == e) {
    if (r.ec == std::errc()) return true;
    if (r.ec == std::errc::result_out_of_range) {  // 1e999 -> inf, 1e-999 -> 0, like strtod
      const std::string tmp(s, e);
      v = std::strtod(tmp.c_str(), nullptr);
      return true;
    }
  }
  if (iequals(b, e, "na") || iequals(b, e, "n/a") || iequals(b, e, "null") ||
      iequals(b, e, "none") || iequals(b, e, "nan")) {
    v = kNaN;
    return true;
  }
  if (iequals(b, e, "+inf") || iequals(b, e, "+infinity")) {
    v = kInf;
    return true;
  }
  return false;
}

// The '\n's in [p, e), counted a block of 255 bytes at a time into one
// byte: a loop the compiler vectorizes, 4x std::count's speed.
int64_t count_newlines(const char* p, const char* e) {
  int64_t n = 0;
  while (p < e) {
    const char* const block_end = p + std::min<int64_t>(e - p, 255);
    uint8_t in_block = 0;
    for (; p < block_end; ++p) in_block += *p == '\n';
    n += in_block;
  }
  return n;
}

// Whether [p, line_end) is a blank line (or a lone '\r'): skipped, not a row.
bool is_blank(const char* p, const char* line_end) {
  return line_end == p || (line_end == p + 1 && *p == '\r');
}

// Parses an unquoted line [p, line_end) into `row` (ncols values); false when
// it needs the careful path of csv_reader::read_rows (a quote, a ragged row,
// a cell that is not a number), which parses it again and names the error.
// Most cells are short plain numbers: parse_short_decimal stops at the
// delimiter, with no separate scan for it and no trimming; other numbers
// take from_chars, other cells parse_cell.
// REQUIRES: *line_end is the line's '\n' (parse_short_decimal's end mark),
// and buf_'s padding follows it.
bool parse_plain_line(const char* p, const char* line_end, char delim, int64_t ncols, double* row) {
  for (int64_t c = 0; c < ncols; ++c) {
    double v;
    const char* q = detail::parse_short_decimal(p, v);
    if (q == nullptr || (q != line_end && *q != delim)) {
      const auto r = std::from_chars(p, line_end, v);
      q = r.ptr;
      if (r.ec != std::errc() || (q != line_end && *q != delim)) {
        q = p;
        while (q < line_end && *q != delim) ++q;
        if (*p == '"' || !parse_cell(p, q, v)) return false;
      }
    }
    row[c] = v;
    if (c + 1 == ncols) return q == line_end;
    if (q == line_end) return false;
    p = q + 1;
  }
  return true;
}

}  // namespace

// What one piece of a block of complete, unquoted lines gave, parsed on one
// thread straight into its place in the reader's output. A piece stops
// early at its row limit or at a line that needs the careful path.
struct detail::csv_piece {
  int64_t rows = 0;
  int64_t lines = 0;            // lines consumed, blank ones included
  const char* stop = nullptr;   // first byte not consumed
};

namespace {

// Parses the lines of [p, e) into `rows`, ncols values a row, up to max_rows.
void parse_piece(const char* p, const char* e, char delim, int64_t ncols, int64_t max_rows, double* rows,
                 detail::csv_piece& out) {
  out.rows = out.lines = 0;
  while (p < e && out.rows < max_rows) {
    const char* const line_end = static_cast<const char*>(std::memchr(p, '\n', size_t(e - p)));
    if (!is_blank(p, line_end)) {
      if (!parse_plain_line(p, line_end, delim, ncols, rows + out.rows * ncols)) break;
      ++out.rows;
    }
    ++out.lines;
    p = line_end + 1;
  }
  out.stop = p;
}

// Reads a quoted field starting at the opening quote *p. On success moves p
// past the closing quote, stores the content in `out`, adds the newlines it
// spans to `newlines`, and returns true; false when the buffer ends first.
bool parse_quoted(const char*& p, const char* e, std::string& out, int64_t& newlines) {
  out.clear();
  const char* q = p + 1;
  int64_t nl = 0;
  while (q < e) {
    const char c = *q;
    if (c == '"') {
      if (q + 1 >= e) return false;  // need the next char to decide
      if (q[1] == '"') {
        out.push_back('"');
        q += 2;
        continue;
      }
      p = q + 1;
      newlines += nl;
      return true;
    }
    nl += c == '\n';
    out.push_back(c);
    ++q;
  }
  return false;
}

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

}  // namespace

// ---------------------------------------------------------------- reader

csv_reader::csv_reader(std::string path, csv_options options)
    : path_(std::move(path)), name_(options.name().empty() ? path_ : options.name()), options_(options) {
  TORCH_CHECK(options_.chunk_bytes() >= 16, "nanguard::csv_reader: chunk_bytes must be at least 16 "
              "but is ", options_.chunk_bytes(), "; use the default (16 MiB) unless memory is tight");
  TORCH_CHECK(options_.delimiter() != '"' && options_.delimiter() != '\n',
              "nanguard::csv_reader: the delimiter cannot be a quote or a newline; use ',', ';' or '\\t'");
  file_.reset(std::fopen(path_.c_str(), "rb"));
  TORCH_CHECK(file_ != nullptr, "nanguard::read_csv: cannot open '", name_, "': ",
              std::strerror(errno), "; check the path");
  buf_size_ = options_.chunk_bytes();
  buf_.reset(new char[size_t(buf_size_)]);  // not zeroed: fill writes what is read
  // The header: the first non-blank record, fields kept as strings.
  while (true) {
    if (begin_ == end_ && !fill()) {
      TORCH_CHECK(false, "nanguard::read_csv: '", name_, "' is empty; expected a header row with "
                  "the column names, then one row per sample");
    }
    const char* const base = buf_.get();
    const char* p = base + begin_;
    const char* const e = base + end_;
    // Skip a UTF-8 byte order mark.
    if (bytes_consumed_ == 0 && e - p >= 3 && std::memcmp(p, "\xEF\xBB\xBF", 3) == 0) {
      begin_ += 3;
      bytes_consumed_ += 3;
      continue;
    }
    std::vector<std::string> names;
    int64_t newlines = 0;
    bool complete = false;
    bool lone_cr = false;  // a '\r' inside an unquoted name: lines that end with '\r' alone
    while (p < e) {
      std::string name;
      if (*p == '"') {
        if (!parse_quoted(p, e, name, newlines)) break;
        while (p < e && *p != options_.delimiter() && *p != '\n') ++p;  // junk after quote
      } else {
        const char* q = p;
        while (q < e && *q != options_.delimiter() && *q != '\n') ++q;
        name.assign(p, q);
        lone_cr = lone_cr || trim(name).find('\r') != std::string::npos;
        p = q;
      }
      if (p >= e) break;
      names.push_back(trim(name));
      if (*p++ == '\n') {
        complete = true;
        break;
      }
    }
    if (!complete) {
      TORCH_CHECK(fill(), "nanguard::read_csv: '", name_, "' ends inside a quoted field of the "
                  "header; close the quote (\")");
      continue;
    }
    line_ += 1 + newlines;
    bytes_consumed_ += (p - base) - begin_;
    begin_ = p - base;
    if (names.size() == 1 && names[0].empty()) continue;  // a blank line before the header
    // Read as one header line, such a file had no data rows.
    TORCH_CHECK(!lone_cr, "nanguard::read_csv: '", name_, "' line ", line_, ": the lines end with a lone "
                "carriage return ('\\r', as classic Mac OS wrote them), not '\\n' or '\\r\\n'; convert the line "
                "endings first, e.g. tr '\\r' '\\n' < in.csv > out.csv");
    columns_ = std::move(names);
    break;
  }
  // Columns are chosen by name (a label, a target): each must name one.
  std::unordered_map<std::string_view, size_t> first;
  for (size_t j = 0; j < columns_.size(); ++j) {
    const auto [it, fresh] = first.emplace(columns_[j], j);
    TORCH_CHECK(fresh, "nanguard::read_csv: '", name_, "' line ", line_, ": the column name '", columns_[j],
                "' appears twice (columns ", it->second + 1, " and ", j + 1, "); give every column a unique name");
  }
  TORCH_CHECK(columns_.size() < 2 || !columns_.back().empty(), "nanguard::read_csv: '", name_, "' line ", line_,
              ": the last column has no name (the line ends with '", options_.delimiter(),
              "'); remove the trailing delimiter from every line, or name the column");
  TORCH_CHECK(!looks_like_data(columns_), "nanguard::read_csv: '", name_, "' line ", line_,
              ": the header row holds numbers only ('", columns_.front(),
              "', ...): is it a row of data? Add a first line with the column names");
}

bool csv_reader::fill() {
  if (eof_) return false;
  // Keep the unparsed tail; grow when one record fills the whole buffer.
  const int64_t tail = end_ - begin_;
  if (begin_ > 0 && tail > 0) std::memmove(buf_.get(), buf_.get() + begin_, size_t(tail));
  begin_ = 0;
  end_ = tail;
  // Room for a final '\n', and past it the bytes parse_short_decimal may read.
  constexpr int64_t kSpare = 1 + detail::kShortDecimalPadding;
  if (end_ + kSpare >= buf_size_) {
    std::unique_ptr<char[]> larger(new char[size_t(2 * buf_size_)]);
    std::memcpy(larger.get(), buf_.get(), size_t(end_));
    buf_ = std::move(larger);
    buf_size_ *= 2;
  }
  const size_t got = std::fread(buf_.get() + end_, 1, size_t(buf_size_ - end_ - kSpare), file_.get());
  bool more = got > 0;
  if (got == 0) {
    TORCH_CHECK(!std::ferror(file_.get()), "nanguard::read_csv: error reading '", name_, "': ",
                std::strerror(errno));
    eof_ = true;
    more = end_ > 0 && buf_[size_t(end_ - 1)] != '\n';
    if (more) {
      buf_[size_t(end_++)] = '\n';  // the last line needs no newline in the file
      bytes_consumed_ -= 1;         // ... and the added one is not a byte of it
    }
  }
  end_ += int64_t(got);
  // Zeros, not bytes never written: parse_short_decimal reads (and ignores) them.
  std::memset(buf_.get() + end_, 0, size_t(detail::kShortDecimalPadding));
  return more;
}

csv_reader::~csv_reader() = default;

// Parses the complete, unquoted lines at the start of the buffer on every
// thread: the block is cut at newlines into pieces, each parsed on its own
// straight into `out`, where its rows start after as many rows as the
// pieces before it have lines (a blank line leaves a gap, closed after).
// Pieces that start past `max_rows` are not parsed. A quoted line, a
// malformed one or the buffer's partial last line ends the block: the
// careful path of read_rows parses it (and names its error). A short block
// (a chunk's last lines) is one piece: declining it would send each of its
// lines to the careful path, and each of those back here to scan the rest
// of the buffer again. Returns the rows taken; 0 when the first line needs
// the careful path.
template <typename Rows>
int64_t csv_reader::read_block(Rows& out, int64_t max_rows) {
  const char* const base = buf_.get();
  const char* const p = base + begin_;
  const char* const quote = static_cast<const char*>(std::memchr(p, '"', size_t(end_ - begin_)));
  const char* const limit = quote ? quote : base + end_;
  const char* const last_newline = static_cast<const char*>(::memrchr(p, '\n', size_t(limit - p)));
  if (last_newline == nullptr) return 0;
  const char* const e = last_newline + 1;

  const int64_t pieces = std::clamp<int64_t>((e - p) / kPieceBytes, 1, 4 * at::get_num_threads());
  std::vector<const char*> cuts(size_t(pieces) + 1, e);
  std::vector<int64_t> first_row(size_t(pieces) + 1, 0);  // at most one row a line
  cuts[0] = p;
  for (int64_t i = 1; i < pieces; ++i) {
    const char* const mid = std::max(cuts[size_t(i - 1)], p + (e - p) * i / pieces);
    cuts[size_t(i)] = mid == e ? e : static_cast<const char*>(std::memchr(mid, '\n', size_t(e - mid))) + 1;
  }
  for (int64_t i = 0; i < pieces; ++i)
    first_row[size_t(i + 1)] = first_row[size_t(i)] + count_newlines(cuts[size_t(i)], cuts[size_t(i + 1)]);
  if (pieces_.size() < size_t(pieces)) pieces_.resize(size_t(pieces));
  const int64_t ncols = int64_t(columns_.size());
  const size_t mark = out.size();
  out.resize(mark + size_t(std::min(first_row[size_t(pieces)], max_rows) * ncols));
  double* const rows_out = out.data() + mark;
  detail::for_each_chunk(pieces, [&](int64_t i) {
    const int64_t first = first_row[size_t(i)];
    if (first < max_rows) {
      parse_piece(cuts[size_t(i)], cuts[size_t(i + 1)], options_.delimiter(), ncols, max_rows - first,
                  rows_out + first * ncols, pieces_[size_t(i)]);
    }
  });

  // A piece's rows are all taken: it stopped at the rows left after the
  // lines before it, no fewer than the rows left after the rows before it.
  int64_t rows = 0;
  int64_t lines = 0;
  const char* stop = p;
  for (int64_t i = 0; i < pieces && first_row[size_t(i)] < max_rows; ++i) {
    const detail::csv_piece& piece = pieces_[size_t(i)];
    if (rows < first_row[size_t(i)] && piece.rows > 0) {
      std::memmove(rows_out + rows * ncols, rows_out + first_row[size_t(i)] * ncols,
                   size_t(piece.rows * ncols) * sizeof(double));
    }
    rows += piece.rows;
    lines += piece.lines;
    stop = piece.stop;
    if (stop != cuts[size_t(i + 1)]) break;  // its row limit, or a line for the careful path
  }
  out.resize(mark + size_t(rows * ncols));
  line_ += lines;
  bytes_consumed_ += stop - p;
  begin_ = stop - base;
  return rows;
}

void csv_reader::fail_cell(const char* begin, const char* end, int64_t column) const {
  std::string cell(begin, end);
  if (cell.size() > 40) cell = cell.substr(0, 37) + "...";
  TORCH_CHECK(false, "nanguard::read_csv: '", name_, "' line ", line_ + 1, ", column ", column + 1, " ('",
              detail::printable(columns_[size_t(column)]), "'): '", detail::printable(cell),
              "' is not a number; numeric columns take numbers and, for a missing value, an empty cell, NA, NaN, "
              "null or inf", other_delimiter_hint(columns_, options_.delimiter()));
}

int64_t csv_reader::read_rows(std::vector<double>& out, int64_t max_rows) { return read_rows_into(out, max_rows); }

template <typename Rows>
int64_t csv_reader::read_rows_into(Rows& out, int64_t max_rows) {
  TORCH_CHECK(max_rows >= 0, "nanguard::csv_reader::read_rows: max_rows must be >= 0 but is ",
              max_rows);
  const int64_t ncols = int64_t(columns_.size());
  const char delim = options_.delimiter();
  int64_t rows = 0;
  while (rows < max_rows) {
    if (begin_ == end_ && !fill()) break;
    if (max_rows - rows >= kBlockMinRows) {
      const int64_t taken = read_block(out, max_rows - rows);
      rows += taken;
      if (taken > 0) continue;
    }
    const char* const base = buf_.get();
    const char* p = base + begin_;
    const char* const e = base + end_;
    const char* line_end = static_cast<const char*>(std::memchr(p, '\n', size_t(e - p)));
    if (line_end == nullptr) {
      TORCH_CHECK(fill() || begin_ == end_, "nanguard::read_csv: '", name_, "' line ", line_ + 1,
                  " ends inside a quoted field; close the quote (\")");
      continue;
    }
    if (is_blank(p, line_end)) {
      ++line_;
      bytes_consumed_ += line_end + 1 - p;
      begin_ = line_end + 1 - base;
      continue;
    }
    const size_t mark = out.size();
    out.resize(mark + size_t(ncols));
    double* row = out.data() + mark;
    if (parse_plain_line(p, line_end, delim, ncols, row)) {
      ++line_;
      bytes_consumed_ += line_end + 1 - p;
      begin_ = line_end + 1 - base;
      ++rows;
      continue;
    }
    int64_t newlines = 0;
    bool incomplete = false;
    for (int64_t c = 0; c < ncols; ++c) {
      double v;
      const char* q;
      if (*p == '"') {
        const char* r = p;
        if (!parse_quoted(r, e, field_, newlines)) {
          incomplete = true;
          break;
        }
        if (newlines) line_end = static_cast<const char*>(std::memchr(r, '\n', size_t(e - r)));
        if (line_end == nullptr) {
          incomplete = true;
          break;
        }
        q = r;
        while (q < line_end && *q != delim) ++q;
        if (!parse_cell(field_.data(), field_.data() + field_.size(), v) ||
            (q > r && !(q == r + 1 && *r == '\r'))) {
          line_ += newlines;
          fail_cell(p, q, c);
        }
      } else {
        q = p;
        while (q < line_end && *q != delim) ++q;
        if (!parse_cell(p, q, v)) fail_cell(p, q, c);
      }
      row[c] = v;
      if (c + 1 < ncols) {
        if (q == line_end) {
          TORCH_CHECK(false, "nanguard::read_csv: '", name_, "' line ", line_ + 1 + newlines,
                      " has ", c + 1, " field", c == 0 ? "" : "s", " but the header has ", ncols,
                      " columns; every row needs one value per column (leave a cell empty for a "
                      "missing value)", other_delimiter_hint(columns_, options_.delimiter()));
        }
        p = q + 1;
      } else if (q != line_end) {
        int64_t fields = ncols;
        for (const char* s = q; s < line_end; ++s) fields += *s == delim;
        TORCH_CHECK(false, "nanguard::read_csv: '", name_, "' line ", line_ + 1 + newlines,
                    " has ", fields, " fields but the header has ", ncols,
                    " columns; every row needs one value per column (quote a cell that holds ",
                    "the delimiter)", other_delimiter_hint(columns_, options_.delimiter()));
      }
    }
    if (incomplete) {
      out.resize(mark);
      if (!fill()) {
        TORCH_CHECK(false, "nanguard::read_csv: '", name_, "' line ", line_ + 1,
                    " ends inside a quoted field; close the quote (\")");
      }
      continue;
    }
    line_ += 1 + newlines;
    bytes_consumed_ += line_end + 1 - (base + begin_);
    begin_ = line_end + 1 - base;
    ++rows;
  }
  rows_read_ += rows;
  return rows;
}

at::Tensor csv_reader::next_batch(int64_t max_rows) {
  scratch_.clear();
  const int64_t n = read_rows(scratch_, max_rows);
  const int64_t ncols = int64_t(columns_.size());
  at::Tensor t = at::empty({n, ncols}, at::kDouble);
  if (n) std::memcpy(t.data_ptr<double>(), scratch_.data(), scratch_.size() * sizeof(double));
  return t;
}

namespace {

// The rows as a [rows, ncols] float64 tensor that takes over `values`'
// memory: no copy of the table, no second table's worth of fresh pages.
// The storage stays resizable: a resize_ that grows it allocates anew from
// the CPU allocator and frees the vector.
at::Tensor adopt_rows(detail::uninitialized_doubles&& values, int64_t rows, int64_t ncols) {
  if (values.empty()) return at::empty({rows, ncols}, at::kDouble);
  auto owner = std::make_unique<detail::uninitialized_doubles>(std::move(values));
  at::Tensor t = at::for_blob(owner->data(), {rows, ncols})
                     .context(owner.get(), [](void* o) { delete static_cast<detail::uninitialized_doubles*>(o); })
                     .resizeable_storage()
                     .allocator(c10::GetCPUAllocator())
                     .options(at::kDouble)
                     .make_tensor();
  owner.release();  // the tensor's storage deletes it
  return t;
}

}  // namespace

csv_table read_csv(const std::string& path, csv_options options) {
  csv_reader in(path, options);
  const int64_t ncols = int64_t(in.columns().size());
  detail::uninitialized_doubles values;  // every value is written: no zeroing first
  // The first rows line by line (fewer than read_block takes: exactly these
  // are parsed), to size the table from their bytes per row: a vector grown
  // by doubling copies its rows and touches fresh pages each time.
  int64_t rows = in.read_rows_into(values, kBlockMinRows - 1);
  std::error_code no_size;  // a pipe: the vector grows
  const auto file_bytes = int64_t(std::filesystem::file_size(path, no_size));
  if (rows > 0 && !no_size) {
    const double bytes_per_row = double(in.bytes_read()) / double(rows);
    const double rest = std::max(0.0, double(file_bytes - in.bytes_read()) / bytes_per_row);
    values.reserve(values.size() + size_t(1.0625 * rest + 1) * size_t(ncols));
  }
  // The rest in one call: each call of read_block first scans the rest of
  // the buffer for a quote.
  rows += in.read_rows_into(values, std::numeric_limits<int64_t>::max());
  csv_table t;
  t.columns = in.columns();
  t.data = adopt_rows(std::move(values), rows, ncols);
  return t;
}

// ---------------------------------------------------------------- writer

namespace {

std::string quote_if_needed(const std::string& s, char delimiter) {
  if (s.find_first_of(std::string{'"', '\n', '\r', delimiter}) == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q.push_back('"');
    q.push_back(c);
  }
  q.push_back('"');
  return q;
}

}  // namespace

csv_writer::csv_writer(std::string path, std::vector<std::string> columns, char delimiter)
    : path_(std::move(path)), columns_(std::move(columns)), delimiter_(delimiter) {
  TORCH_CHECK(!columns_.empty(), "nanguard::csv_writer: no columns given for '", path_,
              "'; pass the header names");
  // Refused now, not when the written file is renamed into place at commit().
  TORCH_CHECK(!path_.empty(), "nanguard::csv_writer: the output path is empty; name the file to write");
  std::error_code ec;
  TORCH_CHECK(!std::filesystem::is_directory(path_, ec), "nanguard::csv_writer: '", path_,
              "' is a directory; name the file to write in it, e.g. '",
              (std::filesystem::path(path_) / "clean.csv").string(), "'");
  std::random_device rd;
  temp_path_ = fmt::format("{}.tmp.{}.{:x}", path_, ::getpid(), rd());
  file_ = std::fopen(temp_path_.c_str(), "wb");
  TORCH_CHECK(file_ != nullptr, "nanguard::csv_writer: cannot create '", temp_path_, "' (for '",
              path_, "'): ", std::strerror(errno), "; check that the directory exists and is writable");
  std::string header;
  for (size_t i = 0; i < columns_.size(); ++i) {
    if (i) header.push_back(delimiter_);
    header += quote_if_needed(columns_[i], delimiter_);
  }
  header.push_back('\n');
  std::fwrite(header.data(), 1, header.size(), file_);
}

csv_writer::~csv_writer() {
  if (file_) {
    std::fclose(file_);
    std::remove(temp_path_.c_str());
  }
}

void csv_writer::write(const at::Tensor& rows) {
  TORCH_CHECK(file_ != nullptr, "nanguard::csv_writer: '", path_, "' was already committed");
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == int64_t(columns_.size()),
              "nanguard::csv_writer: expected a [rows, ", columns_.size(), "] tensor but got shape ",
              rows.sizes(), "; pass one value per column");
  const at::Tensor d = rows.to(at::kDouble).contiguous();
  const double* v = d.data_ptr<double>();
  const int64_t n = d.size(0), m = d.size(1);
  char num[32];
  for (int64_t i = 0; i < n; ++i) {
    line_buf_.clear();
    for (int64_t j = 0; j < m; ++j) {
      if (j) line_buf_.push_back(delimiter_);
      const double x = v[i * m + j];
      if (std::isnan(x)) continue;
      if (std::isinf(x)) {
        line_buf_ += x > 0 ? "inf" : "-inf";
        continue;
      }
      const auto r = std::to_chars(num, num + sizeof num, x);
      line_buf_.append(num, r.ptr);
    }
    line_buf_.push_back('\n');
    TORCH_CHECK(std::fwrite(line_buf_.data(), 1, line_buf_.size(), file_) == line_buf_.size(),
                "nanguard::csv_writer: cannot write '", temp_path_, "': ", std::strerror(errno),
                "; is the disk full?");
  }
}

void csv_writer::commit() {
  TORCH_CHECK(file_ != nullptr, "nanguard::csv_writer: '", path_, "' was already committed");
  const bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const int err = errno;
  std::fclose(file_);
  file_ = nullptr;
  if (!ok) {
    std::remove(temp_path_.c_str());
    TORCH_CHECK(false, "nanguard::csv_writer: cannot write '", temp_path_, "': ",
                std::strerror(err), "; is the disk full?");
  }
  if (std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    std::remove(temp_path_.c_str());
    TORCH_CHECK(false, "nanguard::csv_writer: cannot rename '", temp_path_, "' to '", path_,
                "': ", std::strerror(e));
  }
}

void write_csv(const std::string& path, const std::vector<std::string>& columns,
               const at::Tensor& data) {
  csv_writer out(path, columns);
  out.write(data);
  out.commit();
}

}  // namespace nanguard
