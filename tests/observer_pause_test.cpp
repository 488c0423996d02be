#include "nanguard/observer_pause.h"
#include "nanguard/precision.h"
#include "nanguard/tracer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <thread>

namespace {

TEST(observer_pause, hides_the_ops_of_its_thread_from_a_tracer) {
  nanguard::tracer t;
  const at::Tensor zero = at::zeros({4});
  {
    const nanguard::observer_pause paused;
    EXPECT_TRUE(nanguard::observers_paused());
    (zero / zero).sum();
  }
  EXPECT_FALSE(nanguard::observers_paused());
  EXPECT_FALSE(t.found());
  (zero / zero).sum();
  ASSERT_TRUE(t.found());
  EXPECT_EQ(t.findings()[0].op, "aten::div");
}

TEST(observer_pause, nests_and_ignores_a_resume_without_a_pause) {
  nanguard::resume_observers();  // none open: nothing to end
  EXPECT_FALSE(nanguard::observers_paused());
  nanguard::pause_observers();
  nanguard::pause_observers();
  nanguard::resume_observers();
  EXPECT_TRUE(nanguard::observers_paused());
  nanguard::resume_observers();
  EXPECT_FALSE(nanguard::observers_paused());
}

TEST(observer_pause, pauses_only_the_calling_thread) {
  nanguard::tracer t(nanguard::tracer_options().all_threads(true));
  const nanguard::observer_pause paused;
  std::thread other([] {
    const at::Tensor zero = at::zeros({4});
    (zero / zero).sum();
  });
  other.join();
  ASSERT_TRUE(t.found());
  EXPECT_EQ(t.findings()[0].op, "aten::div");
}

TEST(observer_pause, hides_the_ops_of_its_thread_from_the_precision_advisor) {
  nanguard::precision_advisor advisor;
  {
    const nanguard::observer_pause paused;
    (at::ones({4}) * 1e30).sum();  // would overflow float16
  }
  at::ones({4}) * 3;
  advisor.end_step();
  const auto r = advisor.report();
  ASSERT_FALSE(r.ops.empty());  // the op after the pause
  EXPECT_EQ(r.forward.fp16_overflow, 0);
  EXPECT_DOUBLE_EQ(r.forward.absmax, 3);
}

}  // namespace
