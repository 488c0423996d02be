// The training problems of `nanguard demo` (see demo_scenarios.h). Each is a
// real run: a tiny model, a data set made here from a fixed seed, a real
// optimizer; the bug and its remedy differ in one place only.
#include "demo_scenarios.h"

#include <nanguard/safe_ops.h>
#include <nanguard/schedule.h>
#include <nanguard/scope.h>

#include <torch/torch.h>

#include <cmath>

namespace nanguard::cli {
namespace {

// Rows of the batch of 1-based `step`, cycling through `data` in order.
at::Tensor rows(const at::Tensor& data, int64_t step, int64_t batch) {
  const int64_t batches = data.size(0) / batch;
  return data.narrow(0, ((step - 1) % batches) * batch, batch);
}

// A batch source cycling through inputs and targets.
std::function<std::vector<at::Tensor>(int64_t)> batches(std::vector<at::Tensor> data, int64_t batch) {
  return [data = std::move(data), batch](int64_t step) {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : data) out.push_back(rows(t, step, batch));
    return out;
  };
}

// Mean squared error, named "loss" in findings.
at::Tensor mse(const at::Tensor& prediction, const at::Tensor& target) {
  NANGUARD_SCOPE("loss");
  return torch::mse_loss(prediction, target);
}

// fc1 → relu → fc2: the tiny model most scenarios train.
struct mlp : torch::nn::Module {
  mlp(int64_t in, int64_t hidden, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

// ---- 1. normalisation with std = 0

// Standardises every input feature over the batch (a hand-written batch
// norm), then an MLP.
struct norm_mlp : torch::nn::Module {
  explicit norm_mlp(bool safe) : safe(safe), net(register_module("net", std::make_shared<mlp>(6, 32, 1))) {}
  at::Tensor forward(at::Tensor x) {
    {
      NANGUARD_SCOPE("norm");
      x = safe ? nanguard::standardize(x, 0) : (x - x.mean(0, true)) / x.std(0, /*unbiased=*/true, true);
    }
    return net->forward(x);
  }
  bool safe;
  std::shared_ptr<mlp> net;
};

demo_setup zero_std(bool remedy) {
  torch::manual_seed(1);
  at::Tensor x = torch::randn({512, 6});
  x.select(1, 5).fill_(1.0);  // a sensor stuck at 1: that feature's std is 0
  const at::Tensor w = torch::randn({5, 1}), noise = torch::randn({512, 1});  // in this order
  const at::Tensor y = x.narrow(1, 0, 5).matmul(w) + 0.1 * noise;
  auto model = std::make_shared<norm_mlp>(remedy);
  demo_setup s;
  s.model = model;
  s.optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  s.steps = 40;
  s.batch = batches({x, y}, 64);
  s.loss = [model](const std::vector<at::Tensor>& b) { return mse(model->forward(b[0]), b[1]); };
  return s;
}

// ---- 2. learning rate too high

struct regression_data {
  at::Tensor x, y;
};

regression_data linear_regression(int64_t n, int64_t features) {
  regression_data d;
  d.x = torch::randn({n, features});
  const at::Tensor w = torch::randn({features, 1}), noise = torch::randn({n, 1});  // in this order
  d.y = d.x.matmul(w) + 0.1 * noise;
  return d;
}

constexpr double kHighLr = 0.5;
constexpr int64_t kLrSteps = 60;

// Plain SGD at a learning rate that makes the MLP diverge after a few steps.
demo_setup high_lr_run() {
  torch::manual_seed(2);
  const regression_data d = linear_regression(256, 8);
  auto model = std::make_shared<mlp>(8, 32, 1);
  demo_setup s;
  s.model = model;
  s.optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(kHighLr));
  s.steps = kLrSteps;
  s.batch = batches({d.x, d.y}, 32);
  s.loss = [model](const std::vector<at::Tensor>& b) { return mse(model->forward(b[0]), b[1]); };
  return s;
}

demo_setup lr_too_high(bool remedy) {
  demo_setup s = high_lr_run();
  if (remedy)
    s.options = guard_options().max_norm(1.0).schedule(
        schedule_options(kHighLr).warmup_steps(10).total_steps(kLrSteps).min_lr(kHighLr / 100));
  return s;
}

// The same run under the guard's rollback policy, without clipping: every
// explosion restores the last good snapshot and halves the learning rate.
demo_setup lr_rollback() {
  demo_setup s = high_lr_run();
  s.options = guard_options().policy(policy::rollback).snapshot_every(20).rollback_lr_factor(0.5);
  return s;
}

// ---- 3. NaN and extreme outliers in the data

demo_setup bad_data(bool remedy) {
  torch::manual_seed(3);
  regression_data d = linear_regression(512, 8);
  // Corrupt samples, as a broken sensor or a parsing bug leaves them.
  d.x[70][2] = NAN;     // batch 3
  d.x[100][1] = 1e8;    // batch 4: a unit bug
  d.x[230][5] = NAN;    // batch 8
  d.x[300][6] = -1e8;   // batch 10
  auto model = std::make_shared<mlp>(8, 32, 1);
  demo_setup s;
  s.model = model;
  s.optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  s.steps = 32;
  s.batch = batches({d.x, d.y}, 32);
  s.loss = [model](const std::vector<at::Tensor>& b) { return mse(model->forward(b[0]), b[1]); };
  if (remedy) {
    // Fitted on the training data itself: the robust z-score ignores the few bad values.
    s.data_firewall.emplace(firewall_options()
                                .nonfinite(nonfinite_policy::drop)
                                .outliers(outlier_policy::clip)
                                .rule(outlier_rule::robust_z)
                                .robust_z(6.0));
    s.data_firewall->fit(d.x);
  }
  return s;
}

// ---- 4. hand-written log(softmax(x))

demo_setup log_of_softmax(bool remedy) {
  torch::manual_seed(4);
  const int64_t n = 512, classes = 4, features = 16;
  const at::Tensor centers = torch::randn({classes, features}) * 3;
  const at::Tensor labels = torch::randint(classes, {n});
  // Well separated, large-valued features: the logits grow far apart quickly.
  const at::Tensor spread = torch::randn({n, features});
  const at::Tensor x = (centers.index_select(0, labels) + spread) * 8;
  auto model = std::make_shared<mlp>(features, 32, classes);
  demo_setup s;
  s.model = model;
  s.optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05));
  s.steps = 40;
  s.batch = batches({x, labels}, 64);
  s.loss = [model, remedy](const std::vector<at::Tensor>& b) {
    const at::Tensor logits = model->forward(b[0]);
    NANGUARD_SCOPE("loss");
    if (remedy) return nanguard::cross_entropy(logits, b[1]);
    // softmax underflows to exactly 0 once a logit trails the max by ~104: log(0) = -inf.
    return -at::log(at::softmax(logits, 1)).gather(1, b[1].unsqueeze(1)).mean();
  };
  return s;
}

// ---- 5. float16 overflow

// Emulated float16 training: each layer's output is rounded to float16, so
// its gradient is too (the backward of the cast casts back).
at::Tensor fp16(const at::Tensor& x) { return x.to(at::kHalf).to(at::kFloat); }

struct fp16_mlp : torch::nn::Module {
  fp16_mlp()
      : fc1(register_module("fc1", torch::nn::Linear(16, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 1))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h;
    {
      NANGUARD_SCOPE("fc1");
      h = fp16(torch::relu(fc1(x)));
    }
    NANGUARD_SCOPE("fc2");
    return fp16(fc2(h));
  }
  torch::nn::Linear fc1, fc2;
};

demo_setup fp16_overflow(bool remedy) {
  torch::manual_seed(5);
  regression_data d = linear_regression(512, 16);
  d.y = d.y * 2;  // large targets: large output gradients
  auto model = std::make_shared<fp16_mlp>();
  demo_setup s;
  s.model = model;
  s.optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(3e-2));
  s.steps = 60;
  s.batch = batches({d.x, d.y}, 32);
  s.loss = [model](const std::vector<at::Tensor>& b) { return mse(model->forward(b[0]), b[1]); };
  // Unguarded: the usual fixed loss scale, 2^16, keeps small float16 gradients
  // from underflowing but makes large ones overflow 65504.
  s.loss_scale = 65536;
  if (remedy)
    s.options = guard_options().policy(policy::backoff).scaler(loss_scaler_options().init_scale(65536));
  return s;
}

// ---- 6. attention whose mask blanks a whole row

// One causal self-attention layer over left-padded sequences, read out at
// the last position. A padding query sees no key at all: its row of scores
// is all -inf.
struct attention_net : torch::nn::Module {
  explicit attention_net(bool safe, int64_t d)
      : safe(safe),
        q(register_module("q", torch::nn::Linear(d, d))),
        k(register_module("k", torch::nn::Linear(d, d))),
        v(register_module("v", torch::nn::Linear(d, d))),
        out(register_module("out", torch::nn::Linear(d, 1))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& padding) {
    const int64_t t = x.size(1);
    at::Tensor context;
    {
      NANGUARD_SCOPE("attn");
      const at::Tensor scores = q(x).matmul(k(x).transpose(1, 2)) / std::sqrt(double(x.size(2)));
      const at::Tensor causal = torch::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
      const at::Tensor mask = causal.unsqueeze(0) | padding.unsqueeze(1);  // [batch, query, key]
      const at::Tensor p = safe ? nanguard::masked_softmax(scores, mask, -1)
                                : at::softmax(scores.masked_fill(mask, -INFINITY), -1);
      context = p.matmul(v(x));
    }
    return out(context.select(1, t - 1));
  }
  bool safe;
  torch::nn::Linear q, k, v, out;
};

demo_setup masked_attention(bool remedy) {
  torch::manual_seed(6);
  const int64_t n = 512, t = 8, d = 8;
  at::Tensor x = torch::randn({n, t, d});
  const at::Tensor lengths = torch::randint(1, t + 1, {n});
  const at::Tensor padding = torch::arange(t).unsqueeze(0) < (t - lengths).unsqueeze(1);  // left padding
  x.masked_fill_(padding.unsqueeze(2), 0.0);
  // The target: the mean of feature 0 over the real tokens.
  const at::Tensor y = (x.select(2, 0).sum(1) / lengths.to(at::kFloat)).unsqueeze(1);
  auto model = std::make_shared<attention_net>(remedy, d);
  demo_setup s;
  s.model = model;
  s.optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(2e-2));
  s.steps = 40;
  s.batch = batches({x, y, padding}, 32);
  s.loss = [model](const std::vector<at::Tensor>& b) { return mse(model->forward(b[0], b[2]), b[1]); };
  return s;
}

}  // namespace

std::vector<demo_scenario> demo_scenarios() {
  std::vector<demo_scenario> out(6);
  demo_scenario* s = out.data();
  s->name = "zero-std";
  s->title = "normalisation with std = 0";
  s->expected = cause::division_by_zero;
  s->remedy = "epsilon normalisation: nanguard::standardize, (x - mean) / sqrt(var + 1e-5)";
  s->remedy_short = "standardize (eps)";
  s->make = zero_std;

  ++s;
  s->name = "lr-too-high";
  s->title = "learning rate too high";
  s->expected = cause::divergence;
  s->remedy = "clipping + warmup: guard_options().max_norm(1.0).schedule(warmup 10 steps, then cosine)";
  s->remedy_short = "clip + warmup";
  s->mode = unguarded_mode::guard_abort;
  s->make = lr_too_high;
  s->extra_name = "rollback";
  s->extra_remedy = "the guard's rollback policy instead, no clipping: last good snapshot, LR halved";
  s->make_extra = lr_rollback;

  ++s;
  s->name = "bad-data";
  s->title = "NaN and extreme outliers in the data";
  s->expected = cause::bad_data;
  s->remedy = "the data firewall: drop samples with NaN/Inf, clip outliers to robust-z bounds (fitted)";
  s->remedy_short = "firewall";
  s->make = bad_data;

  ++s;
  s->name = "log-softmax";
  s->title = "hand-written log(softmax(x))";
  s->expected = cause::log_of_nonpositive;
  s->remedy = "stable cross-entropy: nanguard::cross_entropy (log_softmax with the max subtracted)";
  s->remedy_short = "cross_entropy";
  s->make = log_of_softmax;

  ++s;
  s->name = "fp16-overflow";
  s->title = "float16 overflow";
  s->expected = cause::precision_range;
  s->remedy = "dynamic loss scaling: guard with the loss scaler on, policy backoff (skip the step, halve the scale)";
  s->remedy_short = "loss scaling";
  s->make = fp16_overflow;

  ++s;
  s->name = "masked-attention";
  s->title = "attention whose mask blanks a whole row";
  s->expected = cause::fully_masked_softmax;
  s->remedy = "safe softmax: nanguard::masked_softmax (a fully masked row gives zeros)";
  s->remedy_short = "masked_softmax";
  s->make = masked_attention;
  return out;
}

}  // namespace nanguard::cli
