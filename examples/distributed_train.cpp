// distributed_train — data-parallel training of a small classifier under the
// nanguard guard, one process per rank on torch.distributed's c10d (Gloo).
//
//   nanguard launch -n 4 -- ./distributed_train --steps 30 --policy rollback \
//       --nan-rank 2 --nan-step 12 --log runs/
//
// Every rank trains on its own shard of the data; the guard averages the
// gradients, and when rank 2's batch makes a NaN at step 12 every rank skips
// (or rolls back at) that step, and every rank's event log names rank 2 and
// the op that made the NaN. At the end each rank prints a checksum of its
// parameters: they are bit-identical across ranks.
//
// Fault injection (for tests and demos):
//   --nan-rank R --nan-step K      rank R's batch at step K has an all-zero
//                                  sample: the row normalisation divides 0/0
//   --kill-rank R --kill-step K    rank R dies (SIGKILL) at step K
//   --loss-scale S                 dynamic loss scaling from S (it must stay
//                                  the same on every rank)
//   --corrupt-rank R --corrupt-step K
//                                  after averaging at step K, rank R's gradient
//                                  is changed (silent data corruption); the
//                                  consistency check (--check-every) names R
#include <nanguard/distributed.h>
#include <nanguard/guard.h>

#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

namespace {

struct args {
  int64_t steps = 20;
  std::string policy = "skip";
  int64_t nan_rank = -1, nan_step = -1;
  int64_t kill_rank = -1, kill_step = -1;
  int64_t corrupt_rank = -1, corrupt_step = -1;
  int64_t check_every = 0;
  int64_t snapshot_every = 5;
  double timeout = 30;
  double loss_scale = 0;
  std::string log_dir;
};

int64_t to_int(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (!end || *end) throw std::invalid_argument(flag + " needs an integer, got '" + v + "'");
  return x;
}

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(f + " needs a value");
    const char* v = argv[++i];
    if (f == "--steps") a.steps = to_int(f, v);
    else if (f == "--policy") a.policy = v;
    else if (f == "--nan-rank") a.nan_rank = to_int(f, v);
    else if (f == "--nan-step") a.nan_step = to_int(f, v);
    else if (f == "--kill-rank") a.kill_rank = to_int(f, v);
    else if (f == "--kill-step") a.kill_step = to_int(f, v);
    else if (f == "--corrupt-rank") a.corrupt_rank = to_int(f, v);
    else if (f == "--corrupt-step") a.corrupt_step = to_int(f, v);
    else if (f == "--check-every") a.check_every = to_int(f, v);
    else if (f == "--snapshot-every") a.snapshot_every = to_int(f, v);
    else if (f == "--timeout") a.timeout = std::atof(v);
    else if (f == "--loss-scale") a.loss_scale = std::atof(v);
    else if (f == "--log") a.log_dir = v;
    else throw std::invalid_argument("unknown option " + f);
  }
  return a;
}

// Rows scaled to unit length, then a two-layer MLP.
struct net_impl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  net_impl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(at::Tensor x) {
    x = x / x.norm(2, {1}, /*keepdim=*/true);
    return fc2(torch::tanh(fc1(x)));
  }
};
TORCH_MODULE_IMPL(net, net_impl);

}  // namespace

int main(int argc, char** argv) {
  int64_t rank = -1;
  try {
    const args a = parse(argc, argv);
    auto pg = nanguard::init_process_group_from_env(nanguard::process_group_options().timeout(a.timeout));
    nanguard::distributed_options dopts;
    dopts.check_every(a.check_every);
    auto dist = std::make_shared<nanguard::distributed>(pg, dopts);
    rank = dist->rank();
    if (a.corrupt_rank == rank)
      dist->on_averaged([&](int64_t step, const std::vector<at::Tensor>& params) {
        if (step == a.corrupt_step) params[0].grad().view(-1)[0].add_(1e-3);  // a flipped bit, in effect
      });

    torch::manual_seed(0);  // the same initial parameters on every rank
    net model;
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    nanguard::guard_options o;
    o.policy(nanguard::policy_from_string(a.policy)).max_norm(1.0).distributed(dist).snapshot_every(a.snapshot_every);
    if (a.loss_scale > 0)  // dynamic loss scaling (growth every 3 good steps), as in fp16 training
      o.scaler(nanguard::loss_scaler_options().init_scale(a.loss_scale).growth_interval(3));
    if (!a.log_dir.empty()) std::filesystem::create_directories(a.log_dir);
    if (!a.log_dir.empty()) o.event_log(a.log_dir + "/rank-" + std::to_string(rank) + ".jsonl");
    o.bundle_dir(a.log_dir.empty() ? "nanguard-bundles" : a.log_dir + "/bundles");
    nanguard::guard g(model, optimizer, o);

    const auto loss_fn = [&](const std::vector<at::Tensor>& b) {
      return torch::nn::functional::cross_entropy(model->forward(b[0]), b[1]);
    };
    for (int64_t step = 1; step <= a.steps; ++step) {
      if (rank == a.kill_rank && step == a.kill_step) {
        std::printf("dying at step %lld\n", static_cast<long long>(step));
        std::fflush(stdout);
        std::raise(SIGKILL);
      }
      // This rank's shard: its own samples at every step.
      torch::manual_seed(1000 + 7919 * rank + step);
      at::Tensor x = torch::randn({8, 16});
      at::Tensor y = (x.narrow(1, 0, 4).argmax(1));
      if (rank == a.nan_rank && step == a.nan_step) x[0].zero_();  // an empty sample
      const nanguard::step_event e = g.step({x, y}, loss_fn);
      if (e.skipped) {
        std::string ranks;
        for (int64_t r : e.nonfinite_ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
        std::printf("step %lld: %s, non-finite on rank(s) [%s]%s%s\n", static_cast<long long>(e.step),
                    nanguard::to_string(e.action), ranks.c_str(), e.note.empty() ? "" : ": ", e.note.c_str());
        for (const nanguard::finding& f : e.findings) std::printf("  %s\n", nanguard::to_string(f).c_str());
      }
    }
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : model->parameters()) params.push_back(p.detach());
    std::printf("steps %lld skipped %lld rollbacks %lld scale %g\n", static_cast<long long>(g.steps()),
                static_cast<long long>(g.skipped()), static_cast<long long>(g.rollbacks()), g.scaler().get_scale());
    std::printf("params_checksum: %016llx\n", static_cast<unsigned long long>(nanguard::checksum(params)));
    return 0;
  } catch (const nanguard::nonfinite_error& e) {
    std::fprintf(stderr, "rank %lld: stopped on a non-finite value: %s\n", static_cast<long long>(rank), e.what());
    return 3;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "rank %lld: error: %s\n", static_cast<long long>(rank), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %lld: error: %s\n", static_cast<long long>(rank), e.what());
    return 1;
  }
}
