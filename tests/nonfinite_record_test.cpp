#include "nanguard/nonfinite_record.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace {

using nanguard::nonfinite_record;
using nanguard::record_options;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

at::Tensor with_value_at(at::Tensor x, int64_t index, double value) {
  x.view({-1})[index] = value;
  return x;
}

TEST(nonfinite_record, an_empty_record_is_all_finite) {
  nonfinite_record r;
  const auto v = r.verdict();
  EXPECT_TRUE(v.all_finite());
  EXPECT_EQ(0, v.tensors);
  EXPECT_EQ(-1, v.first_tensor);
  EXPECT_EQ(-1, v.first_index);
}

TEST(nonfinite_record, names_the_first_bad_tensor_and_element_in_the_order_added) {
  nonfinite_record r;
  EXPECT_EQ(0, r.add(at::ones({3, 4})));
  EXPECT_EQ(1, r.add({at::ones({5}), with_value_at(at::ones({2, 3}, at::kDouble), 4, -kInf)}));
  EXPECT_EQ(3, r.add(with_value_at(at::zeros({7}, at::kHalf), 1, kNaN)));
  EXPECT_EQ(4, r.size());
  const auto v = r.verdict();
  EXPECT_EQ(4, v.tensors);
  EXPECT_EQ(2, v.first_tensor);
  EXPECT_EQ(4, v.first_index);
  EXPECT_EQ(-kInf, v.first_value);
  EXPECT_EQ(1, v.nan);
  EXPECT_EQ(0, v.pos_inf);
  EXPECT_EQ(1, v.neg_inf);
  EXPECT_EQ(2, v.nonfinite());
}

TEST(nonfinite_record, gathers_the_census_of_each_tensor_in_order) {
  const at::Tensor a = at::randn({64, 33});
  const at::Tensor b = with_value_at(at::randn({100}, at::kDouble), 17, kInf);
  const at::Tensor c = at::randn({8, 8}, at::kBFloat16).t();  // a view
  nonfinite_record r(record_options().stats(true));
  r.add({a, b, c});
  const auto s = r.stats();
  ASSERT_EQ(3u, s.size());
  EXPECT_EQ(nanguard::to_string(nanguard::census(a)), nanguard::to_string(s[0]));
  EXPECT_EQ(nanguard::to_string(nanguard::census(b)), nanguard::to_string(s[1]));
  EXPECT_EQ(nanguard::to_string(nanguard::census(c)), nanguard::to_string(s[2]));
  EXPECT_EQ(17, s[1].first_nonfinite_index);
  EXPECT_EQ(1, r.verdict().first_tensor);
}

TEST(nonfinite_record, census_many_and_check_many_read_lists_at_once) {
  const std::vector<at::Tensor> xs = {at::ones({4}), at::full({3}, kNaN), at::full({2}, kInf)};
  const auto s = nanguard::census_many(xs);
  ASSERT_EQ(3u, s.size());
  EXPECT_EQ(3, s[1].nan);
  EXPECT_EQ(2, s[2].pos_inf);
  const auto v = nanguard::check_many(xs);
  EXPECT_EQ(1, v.first_tensor);
  EXPECT_EQ(0, v.first_index);
  EXPECT_TRUE(std::isnan(v.first_value));
  EXPECT_EQ(5, v.nonfinite());
}

TEST(nonfinite_record, clear_forgets_what_was_added) {
  nonfinite_record r(record_options().stats(true));
  r.add(at::full({2}, kNaN));
  r.clear();
  EXPECT_EQ(0, r.size());
  EXPECT_TRUE(r.verdict().all_finite());
  EXPECT_TRUE(r.stats().empty());
  EXPECT_EQ(0, r.add(at::ones({2})));
}

TEST(nonfinite_record, stats_without_the_option_says_how_to_ask_for_them) {
  nonfinite_record r;
  r.add(at::ones({2}));
  try {
    r.stats();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("record_options().stats(true)")) << e.what();
  }
}

TEST(nonfinite_record, rejects_integer_and_undefined_tensors_with_what_to_do) {
  nonfinite_record r;
  try {
    r.add(at::ones({2}, at::kInt));
    FAIL() << "expected an error";
  } catch (const c10::TypeError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("got Int with shape [2]")) << e.what();
  }
  EXPECT_THROW(r.add(at::Tensor()), c10::Error);
  EXPECT_EQ(0, r.size()) << "a rejected list adds nothing";
}

}  // namespace
