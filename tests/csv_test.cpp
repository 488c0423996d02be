#include "nanguard/csv.h"
#include "support.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>

namespace {

using nanguard::test::error_of;

namespace fs = std::filesystem;
constexpr double kInf = std::numeric_limits<double>::infinity();

// A fresh file under the test's temporary directory with `text` in it.
std::string fixture(const std::string& name, const std::string& text) {
  const fs::path dir = fs::path(testing::TempDir()) / "nanguard_csv_test";
  fs::create_directories(dir);
  const fs::path p = dir / name;
  std::ofstream(p, std::ios::binary) << text;
  return p.string();
}

double at2(const at::Tensor& t, int64_t i, int64_t j) { return t[i][j].item<double>(); }

TEST(csv, reads_header_and_numbers) {
  const auto t = nanguard::read_csv(
      fixture("basic.csv", "a,b, c \n1,2.5,-3e2\n+4, .5 ,1E-3\n"));
  ASSERT_EQ(t.columns, (std::vector<std::string>{"a", "b", "c"}));
  ASSERT_EQ(t.data.sizes(), (at::IntArrayRef{2, 3}));
  EXPECT_EQ(t.data.scalar_type(), at::kDouble);
  EXPECT_EQ(at2(t.data, 0, 0), 1.0);
  EXPECT_EQ(at2(t.data, 0, 1), 2.5);
  EXPECT_EQ(at2(t.data, 0, 2), -300.0);
  EXPECT_EQ(at2(t.data, 1, 0), 4.0);
  EXPECT_EQ(at2(t.data, 1, 1), 0.5);
  EXPECT_EQ(at2(t.data, 1, 2), 1e-3);
}

TEST(csv, reads_missing_value_tokens_as_nan_and_inf) {
  const auto t = nanguard::read_csv(fixture(
      "missing.csv", "x,y,z,w\n,NA,NaN,null\nnan,N/A,None,NULL\ninf,-inf,+inf,Infinity\n-Infinity,INF,1e999,-1e999\n"));
  ASSERT_EQ(t.data.sizes(), (at::IntArrayRef{4, 4}));
  for (int j = 0; j < 4; ++j) {
    EXPECT_TRUE(std::isnan(at2(t.data, 0, j))) << j;
    EXPECT_TRUE(std::isnan(at2(t.data, 1, j))) << j;
  }
  EXPECT_EQ(at2(t.data, 2, 0), kInf);
  EXPECT_EQ(at2(t.data, 2, 1), -kInf);
  EXPECT_EQ(at2(t.data, 2, 2), kInf);
  EXPECT_EQ(at2(t.data, 2, 3), kInf);
  EXPECT_EQ(at2(t.data, 3, 0), -kInf);
  EXPECT_EQ(at2(t.data, 3, 1), kInf);
  EXPECT_EQ(at2(t.data, 3, 2), kInf);   // overflow reads as inf, like strtod
  EXPECT_EQ(at2(t.data, 3, 3), -kInf);
}

// Every number reads as strtod reads it, bit for bit (-0.0, subnormals, the
// limits of the short-number fast path and past them), in parallel pieces
// and line by line alike.
TEST(csv, numbers_read_bit_for_bit_as_strtod_reads_them) {
  const std::vector<std::string> cells = {
      "-0", "0", "-0.0", "+1.5", "0.1257302", "-1.265421e-05", "1e-400", "1e400", "-1e400",
      "4.9406564584124654e-324", "2.2250738585072009e-308", "1.7976931348623157e308",
      "9007199254740992", "9007199254740993", "123456789012345678901234567890", "1e22", "1e23",
      "1e-22", "1e-23", "-.5", "7.", "1E0005", "Infinity", "-inf", "+inf"};
  const size_t n = cells.size();
  std::string text;
  for (size_t j = 0; j < n; ++j) text += (j ? ",c" : "c") + std::to_string(j);
  text += "\n";
  constexpr int64_t kRows = 1000;  // enough for read_block's pieces
  for (int64_t i = 0; i < kRows; ++i) {
    for (size_t j = 0; j < n; ++j) text += (j ? "," : "") + cells[(size_t(i) + j) % n];
    text += "\n";
  }
  const std::string p = fixture("strtod.csv", text);
  const auto same_bits = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  const at::Tensor all = nanguard::read_csv(p).data.contiguous();
  nanguard::csv_reader one_by_one(p);
  ASSERT_EQ(all.size(0), kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    const at::Tensor row = one_by_one.next_batch(1);
    for (size_t j = 0; j < n; ++j) {
      const std::string& cell = cells[(size_t(i) + j) % n];
      const double expected = std::strtod(cell.c_str(), nullptr);
      ASSERT_TRUE(same_bits(all.data_ptr<double>()[i * int64_t(n) + int64_t(j)], expected)) << cell;
      ASSERT_TRUE(same_bits(row.data_ptr<double>()[j], expected)) << cell;
    }
  }
}

// read_csv's table takes over the memory its rows were parsed into; the
// tensor is an ordinary one all the same: it can grow.
TEST(csv, read_csv_table_is_an_ordinary_tensor) {
  std::string text = "a,b\n";
  for (int i = 0; i < 600; ++i) text += std::to_string(i) + ",0.5\n";
  at::Tensor t = nanguard::read_csv(fixture("adopted.csv", text)).data;
  ASSERT_EQ(t.sizes(), (at::IntArrayRef{600, 2}));
  EXPECT_EQ(at2(t, 599, 0), 599.0);
  t.resize_({1200, 2});
  EXPECT_EQ(at2(t, 599, 0), 599.0);
  EXPECT_EQ(at2(t, 599, 1), 0.5);
}

TEST(csv, understands_quoted_fields_crlf_and_no_final_newline) {
  const auto t = nanguard::read_csv(fixture(
      "quoted.csv", "\xEF\xBB\xBF\"id, first\",\"say \"\"hi\"\"\",\"multi\nline\"\r\n\"1.5\",2,\"\"\r\n\r\n3,\"-4\",5"));
  ASSERT_EQ(t.columns, (std::vector<std::string>{"id, first", "say \"hi\"", "multi\nline"}));
  ASSERT_EQ(t.data.sizes(), (at::IntArrayRef{2, 3}));
  EXPECT_EQ(at2(t.data, 0, 0), 1.5);
  EXPECT_EQ(at2(t.data, 0, 1), 2.0);
  EXPECT_TRUE(std::isnan(at2(t.data, 0, 2)));
  EXPECT_EQ(at2(t.data, 1, 1), -4.0);
  EXPECT_EQ(at2(t.data, 1, 2), 5.0);
}

TEST(csv, header_only_gives_zero_rows) {
  const auto t = nanguard::read_csv(fixture("header_only.csv", "a,b\n"));
  EXPECT_EQ(t.data.sizes(), (at::IntArrayRef{0, 2}));
}

TEST(csv, ragged_row_names_the_line) {
  const std::string p = fixture("short.csv", "a,b,c\n1,2,3\n4,5\n");
  const std::string msg = error_of([&] { nanguard::read_csv(p); });
  EXPECT_NE(msg.find("short.csv' line 3 has 2 fields but the header has 3 columns"), std::string::npos)
      << msg;
  const std::string p2 = fixture("long.csv", "a,b\n1,2\n3,4\n5,6,7,8\n");
  const std::string msg2 = error_of([&] { nanguard::read_csv(p2); });
  EXPECT_NE(msg2.find("long.csv' line 4 has 4 fields but the header has 2 columns"), std::string::npos)
      << msg2;
}

TEST(csv, non_numeric_cell_names_line_and_column) {
  const std::string p = fixture("text.csv", "a,age,c\n1,2,3\n4,abc,6\n");
  const std::string msg = error_of([&] { nanguard::read_csv(p); });
  EXPECT_NE(msg.find("text.csv' line 3, column 2 ('age'): 'abc' is not a number"), std::string::npos)
      << msg;
  const std::string p2 = fixture("junk.csv", "a\n1.5x\n");
  EXPECT_NE(error_of([&] { nanguard::read_csv(p2); }).find("line 2, column 1 ('a'): '1.5x'"),
            std::string::npos);
}

TEST(csv, a_file_with_another_delimiter_is_named_as_such) {
  // Read with ',', a ';' file is one column: the error blamed a cell, or a row's field count.
  const std::string msg = error_of([&] { nanguard::read_csv(fixture("semicolon.csv", "a;b\n1;2\n")); });
  EXPECT_NE(msg.find("'1;2' is not a number"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the header is one column ('a;b'): if the file is delimited by ';', read it with that "
                     "delimiter"), std::string::npos) << msg;
  const std::string decimal_commas = fixture("decimal_commas.csv", "a;b\n1,5;2,5\n");
  EXPECT_NE(error_of([&] { nanguard::read_csv(decimal_commas); }).find("delimited by ';'"), std::string::npos);
  const std::string tabs = fixture("tabs.csv", "a\tb\n1\t2\n");
  EXPECT_NE(error_of([&] { nanguard::read_csv(tabs); }).find("csv_options().delimiter('\\t')"), std::string::npos);
  // One column of its own: no hint.
  const std::string one = fixture("one_column.csv", "a\n1x\n");
  EXPECT_EQ(error_of([&] { nanguard::read_csv(one); }).find("the header is one column"), std::string::npos);
}

TEST(csv, empty_and_missing_files_are_clear_errors) {
  const std::string empty = fixture("empty.csv", "");
  const std::string msg = error_of([&] { nanguard::read_csv(empty); });
  EXPECT_NE(msg.find("empty.csv' is empty; expected a header row"), std::string::npos) << msg;
  const std::string msg2 = error_of([&] { nanguard::read_csv("/nonexistent/dir/data.csv"); });
  EXPECT_NE(msg2.find("cannot open '/nonexistent/dir/data.csv': No such file or directory"),
            std::string::npos)
      << msg2;
  const std::string open_quote = fixture("open_quote.csv", "a,b\n1,\"2\n3,4\n");
  EXPECT_NE(error_of([&] { nanguard::read_csv(open_quote); }).find("ends inside a quoted field"),
            std::string::npos);
}

TEST(csv, lone_carriage_return_line_endings_are_named) {
  // Read as one header line of columns 'a', 'b\r1', '2\r3', '4': zero rows, no error.
  const std::string p = fixture("mac.csv", "a,b\r1,2\r3,4\r");
  const std::string msg = error_of([&] { nanguard::read_csv(p); });
  EXPECT_NE(msg.find("mac.csv' line 1: the lines end with a lone carriage return"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tr '\\r' '\\n'"), std::string::npos) << msg;
  // A quoted name may hold one, and \r\n ends a line.
  const auto t = nanguard::read_csv(fixture("crlf_names.csv", "\"x\ry\",b\r\n1,2\r\n"));
  EXPECT_EQ(t.columns, (std::vector<std::string>{"x\ry", "b"}));
  EXPECT_EQ(t.data.size(0), 1);
}

TEST(csv, duplicate_column_names_are_refused) {
  // A label or target is chosen by name: a second 'a' made `train` use the
  // first and feed the other as a feature.
  const std::string p = fixture("dup.csv", "\na,b,a\n1,2,3\n");
  const std::string msg = error_of([&] { nanguard::read_csv(p); });
  EXPECT_NE(msg.find("dup.csv' line 2: the column name 'a' appears twice (columns 1 and 3)"), std::string::npos)
      << msg;
}

TEST(csv, errors_name_the_file_as_the_options_say) {
  // A temporary copy of a pipe is read; the user named the pipe.
  const std::string p = fixture("copy.csv", "a\nx\n");
  const std::string msg =
      error_of([&] { nanguard::read_csv(p, nanguard::csv_options().name("/dev/stdin")); });
  EXPECT_NE(msg.find("'/dev/stdin' line 2, column 1 ('a'): 'x' is not a number"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("copy.csv"), std::string::npos) << msg;
}

// A generated file read with tiny chunks and small batches gives the same
// values as one read with the defaults: the streaming path is exact.
TEST(csv, streams_in_small_chunks_and_batches) {
  std::mt19937 gen(3);
  std::normal_distribution<double> nd(0, 1e3);
  std::string text = "f0,f1,\"f,2\"\n";
  std::vector<double> expect;
  for (int i = 0; i < 500; ++i) {
    for (int j = 0; j < 3; ++j) {
      const double v = nd(gen);
      expect.push_back(v);
      char buf[64];
      std::snprintf(buf, sizeof buf, j == 2 && i % 7 == 0 ? "\"%.17g\"" : "%.17g", v);
      text += buf;
      text += j < 2 ? "," : (i % 3 ? "\n" : "\r\n");
    }
  }
  const std::string p = fixture("stream.csv", text);
  nanguard::csv_reader in(p, nanguard::csv_options().chunk_bytes(16));
  EXPECT_EQ(in.columns().size(), 3u);
  std::vector<at::Tensor> parts;
  for (at::Tensor b = in.next_batch(7); b.size(0) > 0; b = in.next_batch(7)) parts.push_back(b);
  EXPECT_EQ(parts.size(), size_t((500 + 6) / 7));
  const at::Tensor all = at::cat(parts);
  ASSERT_EQ(all.size(0), 500);
  EXPECT_EQ(in.rows_read(), 500);
  EXPECT_EQ(in.bytes_read(), int64_t(text.size()));
  const at::Tensor ref = at::tensor(expect, at::kDouble).reshape({500, 3});
  EXPECT_TRUE(at::equal(all, ref));
  EXPECT_TRUE(at::equal(nanguard::read_csv(p).data, ref));
}

TEST(csv, writer_round_trips_exactly_and_atomically) {
  const fs::path dir = fs::path(testing::TempDir()) / "nanguard_csv_write";
  fs::remove_all(dir);
  fs::create_directories(dir);
  at::manual_seed(1);
  at::Tensor x = at::randn({100, 4}, at::kDouble) * 1e5;
  x[3][1] = std::numeric_limits<double>::quiet_NaN();
  x[5][2] = kInf;
  x[6][0] = -kInf;
  x[7][3] = 5e-324;  // the smallest subnormal survives too
  const std::string path = (dir / "out.csv").string();
  nanguard::write_csv(path, {"a", "b,c", "q\"d", "e"}, x);
  const auto t = nanguard::read_csv(path);
  EXPECT_EQ(t.columns, (std::vector<std::string>{"a", "b,c", "q\"d", "e"}));
  EXPECT_TRUE(nanguard::test::same_values(t.data, x));
  EXPECT_TRUE(std::isnan(at2(t.data, 3, 1)));
  // Only the target is left: the temporary file was renamed.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 1);
  {
    nanguard::csv_writer w((dir / "never.csv").string(), {"a"});
    w.write(at::ones({2, 1}));
    // no commit: the destructor removes the temporary file
  }
  EXPECT_FALSE(fs::exists(dir / "never.csv"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 1);
  const std::string msg = error_of([&] { nanguard::write_csv((dir / "x.csv").string(), {"a"}, x); });
  EXPECT_NE(msg.find("expected a [rows, 1] tensor but got shape [100, 4]"), std::string::npos) << msg;
  const std::string msg2 = error_of([&] { nanguard::write_csv("/nonexistent/dir/x.csv", {"a"}, x); });
  EXPECT_NE(msg2.find("check that the directory exists and is writable"), std::string::npos) << msg2;
  // A directory is refused when the writer opens, not at the rename once the data is written.
  const std::string msg3 = error_of([&] { nanguard::csv_writer(dir.string(), {"a"}); });
  EXPECT_NE(msg3.find("is a directory; name the file to write in it"), std::string::npos) << msg3;
}

}  // namespace

// A file large enough that the reader parses it in parallel pieces, with
// what the pieces must hand back to the careful path: quoted cells, blank
// and CRLF lines, missing-value tokens, spaces around numbers.
struct large_file {
  std::string text = "a,b,c,d\n";
  std::vector<double> expect;
  int64_t rows = 0;
};

large_file make_large_file(int64_t rows) {
  std::mt19937 gen(11);
  std::normal_distribution<double> nd(0, 1);
  large_file f;
  for (int64_t i = 0; i < rows; ++i) {
    for (int j = 0; j < 4; ++j) {
      const double v = nd(gen);
      char buf[64];
      if (i % 997 == 5 && j == 1) {
        std::snprintf(buf, sizeof buf, "\"%.9g\"", v);  // quoted: the careful path
      } else if (i % 1009 == 7 && j == 2) {
        std::snprintf(buf, sizeof buf, " %.9g ", v);  // spaces: trimmed
      } else if (i % 1013 == 9 && j == 3) {
        std::snprintf(buf, sizeof buf, "NA");
      } else {
        std::snprintf(buf, sizeof buf, "%.9g", v);
      }
      f.text += buf;
      f.expect.push_back(i % 1013 == 9 && j == 3 ? std::nan("") : std::strtod(buf[0] == '"' ? buf + 1 : buf, nullptr));
      f.text += j < 3 ? "," : (i % 5 ? "\n" : "\r\n");
    }
    if (i % 2003 == 0) f.text += "\n";  // a blank line is not a row
  }
  f.rows = rows;
  return f;
}

TEST(csv, parallel_pieces_read_what_one_line_at_a_time_reads) {
  const large_file f = make_large_file(60000);
  const std::string p = fixture("large.csv", f.text);
  const at::Tensor ref = at::tensor(f.expect, at::kDouble).reshape({f.rows, 4});
  const at::Tensor all = nanguard::read_csv(p).data;
  EXPECT_TRUE(at::equal(all.isnan(), ref.isnan()));
  EXPECT_TRUE(at::equal(all.nan_to_num(), ref.nan_to_num()));

  // Batches that end inside a piece continue at the next row, and lines and
  // bytes are counted as line by line.
  nanguard::csv_reader in(p);
  std::vector<at::Tensor> parts;
  for (at::Tensor b = in.next_batch(4099); b.size(0) > 0; b = in.next_batch(4099)) parts.push_back(b);
  EXPECT_TRUE(at::equal(at::cat(parts).nan_to_num(), ref.nan_to_num()));
  EXPECT_EQ(in.bytes_read(), int64_t(f.text.size()));
  const int64_t lines = std::count(f.text.begin(), f.text.end(), '\n');
  EXPECT_EQ(in.line(), lines);
}

TEST(csv, an_error_deep_in_a_parallel_piece_names_its_line) {
  large_file f = make_large_file(30000);
  // A row about two thirds into the file gets a cell that is not a number.
  size_t at = 0;
  for (int newlines = 0; newlines < 20000 || f.text[at] == '\n'; ++newlines) at = f.text.find('\n', at) + 1;
  const size_t comma = f.text.find(',', at);
  f.text.replace(at, comma - at, "oops");
  const std::string p = fixture("large_bad.csv", f.text);
  const int64_t expected_line = std::count(f.text.begin(), f.text.begin() + at, '\n') + 1;
  const std::string msg = error_of([&] { nanguard::read_csv(p); });
  EXPECT_NE(msg.find("line " + std::to_string(expected_line) + ", column 1 ('a'): 'oops' is not a number"),
            std::string::npos) << msg;
}
