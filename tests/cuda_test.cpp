// The CUDA paths against the CPU ones: census, has_nonfinite and
// nonfinite_record on CUDA tensors, the tracer's findings on CUDA (with no
// host sync per op), autocast, the loss scaler against GradScaler, the
// precision advisor, and the distributed helpers on CUDA tensors. Every
// case skips, saying why, where no CUDA device is found (bench/gpu/run.sh
// runs them on the GPU machine).
#include "nanguard/census.h"
#include "nanguard/distributed.h"
#include "nanguard/loss_scaler.h"
#include "nanguard/nonfinite_record.h"
#include "nanguard/precision.h"
#include "nanguard/scope.h"
#include "nanguard/snapshot.h"
#include "nanguard/training_host.h"
#include "nanguard/tracer.h"

#include "detail/value_range.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <thread>

namespace {

using nanguard::tensor_stats;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

#define REQUIRE_CUDA()                                                                  \
  if (!at::hasCUDA())                                                                   \
  GTEST_SKIP() << "no CUDA device found: this case compares the CUDA path with the CPU " \
                  "one (bench/gpu/run.sh runs it on the GPU machine)"

void expect_same_value(double want, double got, const char* what) {
  if (std::isnan(want))
    EXPECT_TRUE(std::isnan(got)) << what << ": expected NaN, got " << got;
  else
    EXPECT_EQ(want, got) << what;
}

// Counts, extremes and the first bad element exactly; sums to rounding (the
// GPU adds in another order, and takes the std from sums of squares).
void expect_same_census(const tensor_stats& cpu, const tensor_stats& gpu) {
  EXPECT_EQ(cpu.numel, gpu.numel);
  EXPECT_EQ(cpu.nan, gpu.nan);
  EXPECT_EQ(cpu.pos_inf, gpu.pos_inf);
  EXPECT_EQ(cpu.neg_inf, gpu.neg_inf);
  EXPECT_EQ(cpu.finite, gpu.finite);
  EXPECT_EQ(cpu.zeros, gpu.zeros);
  EXPECT_EQ(cpu.subnormal, gpu.subnormal);
  EXPECT_EQ(cpu.fp16_overflow, gpu.fp16_overflow);
  EXPECT_EQ(cpu.fp16_underflow, gpu.fp16_underflow);
  EXPECT_EQ(cpu.bf16_overflow, gpu.bf16_overflow);
  EXPECT_EQ(cpu.first_nonfinite_index, gpu.first_nonfinite_index);
  expect_same_value(cpu.first_nonfinite_value, gpu.first_nonfinite_value, "first_nonfinite_value");
  expect_same_value(cpu.min, gpu.min, "min");
  expect_same_value(cpu.max, gpu.max, "max");
  expect_same_value(cpu.absmax, gpu.absmax, "absmax");
  for (auto [want, got, what] : {std::tuple{cpu.mean, gpu.mean, "mean"}, std::tuple{cpu.std, gpu.std, "std"},
                                 std::tuple{cpu.l2_norm, gpu.l2_norm, "l2_norm"}}) {
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got)) << what;
    else
      EXPECT_NEAR(want, got, 1e-6 * std::max(1.0, std::fabs(want))) << what;
  }
}

// Normal data with NaN, Infs, zeros, subnormals and huge values planted.
at::Tensor planted(int64_t n, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn({n}, at::kDouble) * 3;
  const std::vector<double> specials = {kNaN, kInf, -kInf, 0.0, -0.0, 1e-39, 7e5, -1e-5, 3e-6};
  for (int64_t k = 0; k < std::min<int64_t>(n / 7, 40); ++k)
    x[(k * 7919 + int64_t(seed)) % n] = specials[k % specials.size()];
  return x.to(dtype);
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};
// Empty, under one chunk, one chunk plus a tail, many chunks.
const std::vector<int64_t> kSizes = {0, 1, 7, 8195, (int64_t(1) << 20) + 5};

TEST(cuda_census, equals_the_cpu_census_for_every_dtype_and_size) {
  REQUIRE_CUDA();
  for (const auto dtype : kDtypes)
    for (const int64_t n : kSizes) {
      SCOPED_TRACE(testing::Message() << dtype << " n=" << n);
      const at::Tensor x = planted(n, dtype, uint64_t(n) + 3);
      expect_same_census(nanguard::census(x), nanguard::census(x.cuda()));
      EXPECT_EQ(nanguard::has_nonfinite(x), nanguard::has_nonfinite(x.cuda()));
    }
}

TEST(cuda_census, reads_views_and_unaligned_tensors_in_logical_order) {
  REQUIRE_CUDA();
  const at::Tensor x = planted(3 * 5000, at::kFloat, 11).view({3, 5000});
  for (const at::Tensor& v : {x.t(), x.slice(1, 1, 4999), x.view({-1}).slice(0, 3), x.expand({2, 3, 5000})}) {
    SCOPED_TRACE(testing::Message() << v.sizes() << " offset " << v.storage_offset());
    expect_same_census(nanguard::census(v), nanguard::census(v.cuda()));
  }
}

// A negative view (at::_neg_view, z.conj().imag) holds its values negated
// in memory: the CUDA census, census_many and the record's verdict read
// them with their sign, as the CPU census does.
TEST(cuda_census, reads_a_negative_view_with_its_sign) {
  REQUIRE_CUDA();
  for (const auto dtype : kDtypes) {
    SCOPED_TRACE(testing::Message() << dtype);
    const at::Tensor x = planted(8195, dtype, 21) + 1;  // +1: not symmetric about 0
    const at::Tensor negative = at::_neg_view(x.cuda());
    ASSERT_TRUE(negative.is_neg());
    const tensor_stats want = nanguard::census(x.neg());
    ASSERT_GT(want.pos_inf, 0);
    expect_same_census(want, nanguard::census(negative));
    expect_same_census(want, nanguard::census_many({negative})[0]);
    const nanguard::record_verdict v = nanguard::check_many({negative});
    EXPECT_EQ(want.pos_inf, v.pos_inf);
    EXPECT_EQ(want.neg_inf, v.neg_inf);
    expect_same_value(want.first_nonfinite_value, v.first_value, "first_value");
  }
  const at::Tensor z = at::complex(at::randn({1000}), at::rand({1000}) + 1).cuda();
  const at::Tensor imag = at::imag(z.conj());
  ASSERT_TRUE(imag.is_neg());
  const tensor_stats s = nanguard::census(imag);
  EXPECT_LT(s.max, -1.0) << "every imaginary part of z.conj() is below -1";
  expect_same_census(nanguard::census(at::imag(z).cpu().neg()), s);
}

TEST(cuda_census, a_finite_tensor_has_no_nonfinite_and_its_range) {
  REQUIRE_CUDA();
  const at::Tensor x = at::randn({1 << 20}).cuda();
  EXPECT_FALSE(nanguard::has_nonfinite(x));
  const auto r = nanguard::detail::value_range_on_this_thread(x);
  const auto want = nanguard::detail::value_range_on_this_thread(x.cpu());
  EXPECT_EQ(want.lo, r.lo);
  EXPECT_EQ(want.hi, r.hi);
  x[12345] = kNaN;
  EXPECT_TRUE(nanguard::has_nonfinite(x));
  EXPECT_TRUE(std::isnan(nanguard::detail::value_range_on_this_thread(x).lo));
}

TEST(cuda_record, names_the_first_bad_tensor_and_element_over_many_launches) {
  REQUIRE_CUDA();
  std::vector<at::Tensor> xs;
  for (int i = 0; i < 200; ++i) xs.push_back(at::randn({1000 + i * 37}, at::kCUDA));
  xs[150].view({-1})[777] = -kInf;  // later launches than 64 tensors each
  xs[190].view({-1})[3] = kNaN;
  nanguard::nonfinite_record r;
  r.add(at::TensorList(xs).slice(0, 100));
  r.add(at::TensorList(xs).slice(100));
  const auto v = r.verdict();
  EXPECT_EQ(200, v.tensors);
  EXPECT_EQ(150, v.first_tensor);
  EXPECT_EQ(777, v.first_index);
  EXPECT_EQ(-kInf, v.first_value);
  EXPECT_EQ(1, v.nan);
  EXPECT_EQ(1, v.neg_inf);
}

TEST(cuda_record, orders_cpu_and_cuda_tensors_by_position) {
  REQUIRE_CUDA();
  const at::Tensor cpu_bad = at::full({4}, kInf), gpu_bad = at::full({4}, kNaN, at::kCUDA);
  nanguard::nonfinite_record r;
  r.add({at::ones({2}, at::kCUDA), gpu_bad, cpu_bad});
  EXPECT_EQ(1, r.verdict().first_tensor);
  nanguard::nonfinite_record s;
  s.add({cpu_bad, gpu_bad});
  EXPECT_EQ(0, s.verdict().first_tensor);
  EXPECT_EQ(4, s.verdict().pos_inf);
}

TEST(cuda_record, census_many_equals_the_cpu_census_of_each) {
  REQUIRE_CUDA();
  std::vector<at::Tensor> cpu, gpu;
  for (const auto dtype : kDtypes)
    for (const int64_t n : kSizes) {
      cpu.push_back(planted(n, dtype, uint64_t(n) * 5 + 1));
      gpu.push_back(cpu.back().cuda());
    }
  const auto got = nanguard::census_many(gpu);
  ASSERT_EQ(cpu.size(), got.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "tensor " << i);
    expect_same_census(nanguard::census(cpu[i]), got[i]);
  }
}

TEST(cuda_record, clear_zeroes_the_device_record) {
  REQUIRE_CUDA();
  nanguard::nonfinite_record r(nanguard::record_options().stats(true));
  r.add(at::full({3}, kNaN, at::kCUDA));
  EXPECT_FALSE(r.verdict().all_finite());
  r.clear();
  r.add(at::ones({3}, at::kCUDA));
  EXPECT_TRUE(r.verdict().all_finite());
  EXPECT_EQ(3, r.stats().at(0).finite);
}

// What the tracer found, in the words that must not depend on the device.
std::string summary(const nanguard::tracer& t) {
  if (!t.found()) return "no finding";
  const nanguard::finding& f = t.findings().front();
  return std::string(nanguard::to_string(f.direction)) + " " + f.op + " node=" + f.node + " forward_op=" + f.forward_op +
         " role=" + nanguard::to_string(f.role) + " module=" + f.module + " index=" + std::to_string(f.index) +
         " value=" + (std::isnan(f.value) ? std::string("nan") : std::to_string(f.value));
}

std::string traced(const std::function<void(at::Device)>& scenario, at::Device device) {
  nanguard::tracer t;
  scenario(device);
  return summary(t);
}

// Standardisation without epsilon, scoped as "norm".
struct norm_impl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    NANGUARD_SCOPE("norm");
    return (x - x.mean(-1, true)) / x.std(-1, true, true);
  }
};
TORCH_MODULE_IMPL(norm, norm_impl);

// The cases (#23): forward producers, and backward producers, which
// autograd runs on its device thread on CUDA.
const std::vector<std::pair<const char*, std::function<void(at::Device)>>> kScenarios = {
    {"log of zero", [](at::Device d) { at::log(at::zeros({4}, d)).sum(); }},
    {"zero over zero", [](at::Device d) { at::div(at::zeros({4}, d), at::zeros({4}, d)); }},
    {"exp overflow", [](at::Device d) { at::exp(at::full({3}, 100.0, d)); }},
    {"sqrt backward at zero",
     [](at::Device d) { at::sqrt(torch::zeros({5}, torch::device(d).requires_grad(true))).sum().backward(); }},
    {"acos backward at -1",
     [](at::Device d) { at::acos(torch::full({3}, -1.0, torch::device(d).requires_grad(true))).sum().backward(); }},
    {"normalising a constant row in a module",
     [](at::Device d) {
       norm n;
       n(torch::ones({2, 4}, torch::device(d).requires_grad(true))).sum().backward();
     }},
    {"bmm backward overflow",
     [](at::Device d) {
       const auto a = torch::full({2, 3, 3}, 1e20, torch::device(d).requires_grad(true));
       const auto b = torch::full({2, 3, 3}, 1e-20, torch::device(d).requires_grad(true));
       (at::bmm(a, b) * 1e30).sum().backward();
     }},
};

TEST(cuda_tracer, finds_on_cuda_what_it_finds_on_the_cpu) {
  REQUIRE_CUDA();
  for (const auto& [name, scenario] : kScenarios) {
    SCOPED_TRACE(name);
    const std::string cpu = traced(scenario, at::kCPU);
    EXPECT_NE("no finding", cpu);
    EXPECT_EQ(cpu, traced(scenario, at::kCUDA));
  }
}

// Sync warnings (torch.cuda.set_sync_debug_mode("warn")) raised on this
// thread while it lives.
class sync_warnings : public c10::WarningHandler {
 public:
  sync_warnings() : guard_(this) { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN); }
  ~sync_warnings() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  void process(const c10::Warning& w) override { seen.push_back(w.msg()); }
  std::vector<std::string> seen;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

// The point (#23): the tracer reads nothing per op on CUDA. A forward
// pass and an optimiser step (on this thread) run with no host sync; the
// record is read once, when the finding is asked for.
TEST(cuda_tracer, checks_every_op_without_a_host_sync) {
  REQUIRE_CUDA();
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 8));
  net->to(at::kCUDA);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  const at::Tensor x = at::randn({32, 64}, at::kCUDA);
  nanguard::tracer t;
  t.name_parameters(*net);
  at::Tensor loss = net->forward(x).pow(2).mean();
  loss.backward();
  std::vector<std::string> syncs;
  {
    sync_warnings warnings;
    for (int i = 0; i < 3; ++i) {
      opt.step();
      at::log(net->forward(x) * 0).sum();  // -inf: found, but not read here
    }
    syncs = warnings.seen;
  }
  EXPECT_TRUE(syncs.empty()) << syncs.size() << " syncs, the first: " << syncs.front();
  ASSERT_TRUE(t.found());
  EXPECT_EQ("aten::log", t.findings().front().op);
  EXPECT_EQ(nanguard::role::producer, t.findings().front().role);
}

// Each finding in full (ops, roles, modules, element, value, the census of
// every input and output) on CUDA as on the CPU, apart from sums the GPU
// adds in another order: the JSON without its mean, std and l2_norm.
TEST(cuda_tracer, the_deferred_findings_equal_the_cpu_ones_field_by_field) {
  REQUIRE_CUDA();
  const auto findings_on = [](const std::function<void(at::Device)>& scenario, at::Device device) {
    nanguard::tracer t(nanguard::tracer_options().max_findings(4));
    scenario(device);
    std::vector<nanguard::finding> out = t.findings();
    for (nanguard::finding& f : out) {
      f.thread = 0;
      for (auto* records : {&f.inputs, &f.outputs})
        for (nanguard::tensor_record& r : *records) r.stats.mean = r.stats.std = r.stats.l2_norm = 0;
    }
    return out;
  };
  for (const auto& [name, scenario] : kScenarios) {
    SCOPED_TRACE(name);
    const auto cpu = findings_on(scenario, at::kCPU), gpu = findings_on(scenario, at::kCUDA);
    ASSERT_EQ(cpu.size(), gpu.size());
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_EQ(nanguard::to_json(cpu[i]), nanguard::to_json(gpu[i]));
  }
}

TEST(cuda_autocast, runs_cuda_ops_in_float16_and_bfloat16_and_restores_the_state) {
  REQUIRE_CUDA();
  torch::nn::Linear lin(8, 4);
  lin->to(at::kCUDA);
  const at::Tensor x = at::randn({2, 8}, at::kCUDA);
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    {
      nanguard::autocast on(at::kCUDA, dtype);
      EXPECT_EQ(dtype, lin->forward(x).scalar_type());
    }
    EXPECT_EQ(at::kFloat, lin->forward(x).scalar_type());
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
  }
}

// The loss scaler's update equals GradScaler's kernel run on CUDA tensors,
// and a float16 overflow under real CUDA autocast backs it off.
TEST(cuda_loss_scaler, updates_as_grad_scaler_does_on_cuda) {
  REQUIRE_CUDA();
  const auto o = nanguard::loss_scaler_options().init_scale(1024).growth_interval(3).min_scale(1.0 / 1024).max_scale(1e30);
  at::Tensor scale = at::full({1}, o.init_scale(), at::TensorOptions(at::kCUDA).dtype(at::kFloat));
  at::Tensor tracker = at::zeros({1}, at::TensorOptions(at::kCUDA).dtype(at::kInt));
  nanguard::loss_scaler s(o);
  for (int step = 0; step < 100; ++step) {
    const bool inf = (step * 7919 + step / 13) % 5 == 0;
    at::_amp_update_scale_(scale, tracker, at::full({1}, inf ? 1.0 : 0.0, scale.options()), o.growth_factor(),
                           o.backoff_factor(), o.growth_interval());
    s.update(inf);
    ASSERT_EQ(scale.item<double>(), s.get_scale()) << "step " << step;
  }
}

TEST(cuda_loss_scaler, backs_off_on_a_float16_overflow_under_cuda_autocast) {
  REQUIRE_CUDA();
  torch::nn::Linear lin(4, 1);
  lin->to(at::kCUDA);
  nanguard::loss_scaler scaler(nanguard::loss_scaler_options().init_scale(65536));
  const at::Tensor x = at::full({8, 4}, 1000.0, at::kCUDA);
  {
    nanguard::autocast fp16(at::kCUDA, at::kHalf);
    scaler.scale(lin->forward(x).pow(2).mean()).backward();  // 65536 * 1e6: Inf in float16
  }
  const bool overflow = nanguard::has_nonfinite(lin->weight.grad());
  EXPECT_TRUE(overflow);
  EXPECT_TRUE(scaler.update(overflow));
  EXPECT_EQ(32768.0, scaler.get_scale());
}

TEST(cuda_precision_advisor, measures_a_model_under_cuda_autocast) {
  REQUIRE_CUDA();
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  net->to(at::kCUDA);
  nanguard::precision_advisor advisor;
  advisor.name_parameters(*net);
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    {
      nanguard::autocast on(at::kCUDA, dtype);
      net->forward(at::randn({4, 8}, at::kCUDA)).to(at::kFloat).pow(2).mean().backward();
    }
    advisor.end_step();
    net->zero_grad();
  }
  const nanguard::precision_report r = advisor.report();
  EXPECT_EQ(2, r.steps);
  EXPECT_GT(r.forward.values, 0);
  EXPECT_GT(r.gradient.values, 0);
  EXPECT_FALSE(r.fp32_nonfinite);
}

// Two ranks on two threads, their gradients on CUDA: Gloo averages them, and
// the consistency check reads them.
TEST(cuda_distributed, averages_and_checks_cuda_gradients) {
  REQUIRE_CUDA();
  const std::string store = (std::filesystem::temp_directory_path() /
                             ("nanguard_cuda_distributed_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(store);
  std::vector<at::Tensor> averaged(2);
  std::vector<std::vector<int64_t>> differ(2);
  const auto rank_main = [&](int64_t rank) {
    nanguard::distributed d(nanguard::init_process_group(store, rank, 2));
    const at::Tensor w = torch::ones({5}, torch::device(at::kCUDA).requires_grad(true));
    (w * double(rank + 1)).sum().backward();  // gradients 1 and 2
    d.average_gradients_({w}, 0);
    averaged[size_t(rank)] = w.grad().cpu();
    differ[size_t(rank)] = d.check_consistency({w});
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  for (int64_t rank : {0, 1}) {
    EXPECT_TRUE(at::allclose(averaged[size_t(rank)], at::full({5}, 1.5))) << averaged[size_t(rank)];
    EXPECT_TRUE(differ[size_t(rank)].empty());
  }
}

TEST(cuda_tracer, the_scenarios_have_findings_on_the_cpu) {
  for (const auto& [name, scenario] : kScenarios) EXPECT_NE("no finding", traced(scenario, at::kCPU)) << name;
}

}  // namespace

namespace {

// A snapshot of a CUDA model is in pinned host memory, not on the device;
// restoring it brings back the parameters and the optimizer's state on the
// device, and the ring's diff compares them there.
TEST(cuda_snapshot, is_held_in_pinned_host_memory_and_restored_on_the_device) {
  REQUIRE_CUDA();
  torch::nn::Linear model(16, 4);
  model->to(torch::kCUDA);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  const auto train_step = [&] {
    optimizer.zero_grad();
    model->forward(torch::randn({8, 16}, torch::kCUDA)).pow(2).mean().backward();
    optimizer.step();
  };
  train_step();
  nanguard::module_host host(*model, optimizer);
  const auto saved = host.save();
  for (const auto& [name, t] : saved->parameters) {
    EXPECT_TRUE(t.is_cpu()) << name;
    EXPECT_TRUE(t.is_pinned()) << name;
  }
  const at::Tensor weight = model->weight.detach().clone();
  nanguard::snapshot_ring ring(host, 1);
  ASSERT_TRUE(ring.take(1));
  train_step();
  EXPECT_GT(ring.diff().front().absolute, 0);
  EXPECT_EQ(ring.restore(), 1);
  EXPECT_TRUE(torch::equal(model->weight, weight));
  EXPECT_TRUE(model->weight.is_cuda());
  train_step();  // Adam's restored state is on the device: the step runs
  EXPECT_TRUE(torch::isfinite(model->weight).all().item<bool>());
}

}  // namespace
