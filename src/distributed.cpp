#include "nanguard/distributed.h"

#include "detail/enum_from_string.h"
#include "detail/fnv1a.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <fstream>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>

namespace nanguard {

namespace {

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000.0)));
}

void check_options(const process_group_options& o, const char* where) {
  TORCH_CHECK(o.timeout() > 0 && std::isfinite(o.timeout()), where, ": timeout must be > 0 seconds but is ",
              o.timeout(), "; e.g. 60");
}

// The environment variable `name`, or an error that says how to set it.
std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v && *v, "nanguard::init_process_group_from_env: environment variable ", name,
              " is not set; start the program with `nanguard launch -n N -- PROGRAM` (or torchrun), or set RANK, "
              "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  return v;
}

int64_t env_int(const char* name, int64_t lo, int64_t hi) {
  const std::string v = env(name);
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end && *end == '\0' && x >= lo && x <= hi, "nanguard::init_process_group_from_env: ",
              name, "='", v, "' is not an integer in [", lo, ", ", hi, "]");
  return x;
}

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                 int64_t world, const std::string& hostname, double timeout) {
  auto o = c10d::ProcessGroupGloo::Options::create(to_ms(timeout));
  o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(world), o);
  // A c10d ProcessGroup dispatches each collective to the backend of the
  // tensors' device (as torch.distributed.new_group does): Gloo for CPU
  // tensors, and for CUDA tensors too (it stages them through the host).
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank), static_cast<int>(world));
  constexpr auto kGloo = c10d::ProcessGroup::BackendType::GLOO;
  pg->setDefaultBackend(kGloo);
  pg->setBackend(c10::DeviceType::CPU, kGloo, gloo);
  pg->setBackend(c10::DeviceType::CUDA, kGloo, gloo);
  return pg;
}

// This host's name, as the other ranks' records compare it.
std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

// Whether process `pid` of this host has exited (a zombie not yet reaped
// by its parent, as a launcher's dead rank is, has exited too).
bool process_exited(long pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');  // "pid (comm) state ..."
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// A killed rank's connections close while the kernel is still tearing its
// process down, before it shows as exited: the survivor's collective can fail
// on that reset first. So a failure looks again for this long before it says
// that no rank has exited (under load, as in make test-sanitize, the first
// look came too early now and then).
constexpr std::chrono::seconds kExitGrace{1};
constexpr std::chrono::milliseconds kExitPoll{10};

// The store key a rank records its host and process id under.
std::string identity_key(int64_t rank) { return "nanguard/rank/" + std::to_string(rank); }

// Where a rank runs, as it recorded it in the store ("HOST PID").
struct identity {
  std::string host;
  long pid = 0;
  static identity parse(const std::string& record) {
    const size_t space = record.rfind(' ');
    if (space == std::string::npos) return {};
    return {record.substr(0, space), std::strtol(record.c_str() + space + 1, nullptr, 10)};
  }
  // " (host h, pid 42)", or "" when the rank recorded nothing.
  std::string in_parentheses() const { return host.empty() ? "" : fmt::format(" (host {}, pid {})", host, pid); }
};

// Records this rank's host and process id in `store`, which a rank whose
// collective fails reads to name the rank that exited. Best effort: returns
// whether it could (without a record, errors name no host).
bool record_identity(c10d::Store& store, int64_t rank, const std::string& host) {
  try {
    const std::string who = fmt::format("{} {}", host, static_cast<long>(getpid()));
    store.set(identity_key(rank), std::vector<uint8_t>(who.begin(), who.end()));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// What each of the `world` ranks recorded (empty: nothing), or nullopt when
// the store cannot be read.
std::optional<std::vector<identity>> identities(c10d::Store* store, int64_t world) {
  std::vector<identity> who(static_cast<size_t>(world));
  if (!store) return who;
  try {
    for (int64_t r = 0; r < world; ++r) {
      if (!store->check({identity_key(r)})) continue;
      const std::vector<uint8_t> v = store->get(identity_key(r));
      who[static_cast<size_t>(r)] = identity::parse(std::string(v.begin(), v.end()));
    }
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return who;
}

// Waits for a collective; a peer that died or timed out becomes a
// rank_failure naming it. (A live tracer saw the c10d op start and marked
// its tensors written, "received via" the collective.)
void wait_for(const distributed& d, const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  try {
    work->wait();
  } catch (const std::exception& ex) {
    d.raise_failure(what, ex);
  }
}

}  // namespace

const char* to_string(backward_collective c) {
  switch (c) {
    case backward_collective::none: return "none";
    case backward_collective::all_reduce: return "all-reduce";
    case backward_collective::reduce_scatter: return "reduce-scatter";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: backward_collective ", static_cast<int>(c), " has no name");
}

backward_collective backward_collective_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_backward_collectives, "backward_collective");
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group_from_env(process_group_options options) {
  check_options(options, "nanguard::init_process_group_from_env");
  const int64_t world = env_int("WORLD_SIZE", 1, 1 << 20);
  const int64_t rank = env_int("RANK", 0, world - 1);
  const std::string addr = env("MASTER_ADDR");
  const int64_t port = env_int("MASTER_PORT", 1, 65535);
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = rank == 0;
  so.numWorkers = static_cast<std::size_t>(world);
  so.waitWorkers = true;
  so.timeout = to_ms(options.timeout());
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(addr, so);
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, "nanguard::init_process_group_from_env: rank ", rank, " cannot reach the TCPStore at ", addr,
                ":", port, " within ", options.timeout(), " s: ", ex.what(),
                "; check MASTER_ADDR/MASTER_PORT and that every rank started");
  }
  const std::string host =
      !options.hostname().empty() ? options.hostname() : (addr == "localhost" ? std::string("127.0.0.1") : addr);
  return make_gloo(store, rank, world, host, options.timeout());
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const std::string& store_path, int64_t rank,
                                                          int64_t world_size, process_group_options options) {
  check_options(options, "nanguard::init_process_group");
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "nanguard::init_process_group: rank ", rank,
              " is not in [0, world_size=", world_size, ")");
  TORCH_CHECK(!store_path.empty(), "nanguard::init_process_group: the store path is empty; pass a file every rank "
              "can reach, e.g. /tmp/run.store");
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, static_cast<int>(world_size));
  store->setTimeout(to_ms(options.timeout()));
  return make_gloo(store, rank, world_size, options.hostname().empty() ? "127.0.0.1" : options.hostname(),
                   options.timeout());
}

struct distributed::impl {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Store> store;  // where the ranks record where they run (null: nowhere)
  std::string host = host_name();
  distributed_options options;
  int64_t rank = 0;
  int64_t world = 1;
  at::Tensor consensus_buffer;
  std::function<void(int64_t, const std::vector<at::Tensor>&)> hook;
};

distributed::distributed(c10::intrusive_ptr<c10d::ProcessGroup> process_group, distributed_options options)
    : impl_(std::make_unique<impl>()) {
  TORCH_CHECK(process_group, "nanguard::distributed: the process group is null; make one with "
              "nanguard::init_process_group_from_env()");
  TORCH_CHECK(options.bucket_mb() > 0 && std::isfinite(options.bucket_mb()),
              "nanguard::distributed_options: bucket_mb must be > 0 but is ", options.bucket_mb(), "; e.g. 25");
  TORCH_CHECK(options.check_every() >= 0, "nanguard::distributed_options: check_every must be >= 0 but is ",
              options.check_every(), "; 0 disables the gradient-consistency check");
  impl_->pg = std::move(process_group);
  impl_->options = options;
  impl_->rank = impl_->pg->getRank();
  impl_->world = impl_->pg->getSize();
  impl_->consensus_buffer = at::zeros({impl_->world + 3}, at::kDouble);
  impl_->store = impl_->pg->getStore();
  if (impl_->store && !record_identity(*impl_->store, impl_->rank, impl_->host)) impl_->store.reset();
}

distributed::~distributed() = default;

std::string distributed::exited_ranks() const {
  const impl& s = *impl_;
  const auto who = identities(s.store.get(), s.world);
  if (!who) return "";
  std::vector<int64_t> neighbours;  // the other ranks on this host, whose processes can be looked at
  for (int64_t r = 0; r < s.world; ++r)
    if (r != s.rank && (*who)[static_cast<size_t>(r)].host == s.host) neighbours.push_back(r);
  const auto deadline = std::chrono::steady_clock::now() + kExitGrace;
  std::vector<std::string> exited;
  while (!neighbours.empty()) {
    for (const int64_t r : neighbours) {
      const identity& w = (*who)[static_cast<size_t>(r)];
      if (process_exited(w.pid)) exited.push_back(fmt::format("rank {}{} has exited", r, w.in_parentheses()));
    }
    if (!exited.empty() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(kExitPoll);
  }
  return fmt::format("{}", fmt::join(exited, ", "));
}

void distributed::raise_failure(const std::string& what, const std::exception& cause) const {
  const impl& s = *impl_;
  const auto* ce = dynamic_cast<const c10::Error*>(&cause);
  const std::string backend = ce ? ce->what_without_backtrace() : cause.what();
  std::string why = exited_ranks();
  const auto who = why.empty() ? identities(s.store.get(), s.world) : std::nullopt;
  if (why.empty() && !who) {
    why = "the process group's store cannot be read either: what serves it (rank 0, or torchrun's agent) may "
          "have died";
  } else if (why.empty()) {
    std::vector<std::string> others;
    for (int64_t r = 0; r < s.world; ++r)
      if (r != s.rank) others.push_back(fmt::format("rank {}{}", r, (*who)[static_cast<size_t>(r)].in_parentheses()));
    why = fmt::format("no rank has exited on this host; {} did not answer within the timeout: it hangs, runs "
                      "other work (every rank must call the guard at every step) or died on another host",
                      fmt::join(others, ", "));
  }
  throw rank_failure({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     fmt::format("nanguard::distributed: rank {}: {} failed: {}; its own log/stderr says why ({})",
                                 s.rank, what, why, backend));
}

int64_t distributed::rank() const { return impl_->rank; }
int64_t distributed::world_size() const { return impl_->world; }
const distributed_options& distributed::options() const { return impl_->options; }
const c10::intrusive_ptr<c10d::ProcessGroup>& distributed::process_group() const { return impl_->pg; }

consensus distributed::agree(bool nonfinite, double grad_norm, double loss, int64_t step) {
  // Squares of norms up to float64's largest stay finite scaled by 2^-600.
  constexpr int kScaleExponent = 600;
  impl& s = *impl_;
  at::Tensor& buf = s.consensus_buffer;
  double* p = buf.data_ptr<double>();
  std::fill(p, p + s.world + 3, 0.0);
  const double scaled = std::ldexp(grad_norm, -kScaleExponent);
  p[s.rank] = nonfinite ? 1.0 : 0.0;
  p[s.world] = nonfinite ? 0.0 : grad_norm * grad_norm;
  p[s.world + 1] = nonfinite ? 0.0 : scaled * scaled;
  p[s.world + 2] = nonfinite ? 0.0 : loss;
  std::vector<at::Tensor> tensors{buf};
  wait_for(*this, s.pg->allreduce(tensors, c10d::AllreduceOptions{}),
           step >= 0 ? fmt::format("the consensus all-reduce of step {}", step) : "the consensus all-reduce");
  consensus c;
  for (int64_t r = 0; r < s.world; ++r)
    if (p[r] != 0) c.nonfinite_ranks.push_back(r);
  c.grad_norm = std::isinf(p[s.world]) ? std::ldexp(std::sqrt(p[s.world + 1]), kScaleExponent) : std::sqrt(p[s.world]);
  c.loss_sum = p[s.world + 2];
  return c;
}

void distributed::average_gradients_(const std::vector<at::Tensor>& parameters, int64_t step) {
  impl& s = *impl_;
  // Buckets of one dtype each, in parameter order (the same on every rank).
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters) {
    if (!p.requires_grad()) continue;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    TORCH_CHECK(!p.grad().is_sparse(), "nanguard::distributed::average_gradients_: sparse gradients are not "
                "supported; use a dense embedding (sparse=false)");
    grads.push_back(p.grad());
  }
  if (s.world == 1) {
    if (s.hook) s.hook(step, parameters);
    return;
  }
  const int64_t bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(s.options.bucket_mb() * 1e6));
  struct bucket {
    std::vector<at::Tensor> grads;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<bucket> buckets;
  std::map<at::ScalarType, size_t> open;  // dtype -> its bucket being filled
  std::map<at::ScalarType, int64_t> open_bytes;
  const auto launch = [&](bucket& b) {
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& g : b.grads) flat_parts.push_back(g.reshape({-1}));
    b.flat = at::cat(flat_parts);
    std::vector<at::Tensor> tensors{b.flat};
    b.work = s.pg->allreduce(tensors, c10d::AllreduceOptions{});
  };
  for (const at::Tensor& g : grads) {
    const at::ScalarType t = g.scalar_type();
    auto it = open.find(t);
    if (it == open.end()) {
      buckets.push_back({});
      it = open.emplace(t, buckets.size() - 1).first;
      open_bytes[t] = 0;
    }
    buckets[it->second].grads.push_back(g);
    open_bytes[t] += g.numel() * static_cast<int64_t>(g.element_size());
    if (open_bytes[t] >= bucket_bytes) {
      launch(buckets[it->second]);  // full: on the wire while the next fills
      open.erase(it);
    }
  }
  for (auto& [t, i] : open) launch(buckets[i]);
  const double inv_world = 1.0 / static_cast<double>(s.world);
  for (bucket& b : buckets) {
    wait_for(*this, b.work,
             step >= 0 ? fmt::format("the gradient all-reduce of step {}", step) : "the gradient all-reduce");
    b.flat.mul_(inv_world);
    int64_t offset = 0;
    for (const at::Tensor& g : b.grads) {
      const int64_t n = g.numel();
      g.copy_(b.flat.narrow(0, offset, n).view(g.sizes()));
      offset += n;
    }
  }
  if (s.hook) s.hook(step, parameters);
}

std::vector<int64_t> distributed::check_consistency(const std::vector<at::Tensor>& parameters) {
  impl& s = *impl_;
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters)
    if (p.grad().defined()) grads.push_back(p.grad());
  const uint64_t mine = checksum(grads);
  // Slot r holds rank r's checksum, the others 0: SUM gathers them exactly.
  at::Tensor buf = at::zeros({s.world}, at::kLong);
  int64_t v;
  std::memcpy(&v, &mine, sizeof v);
  buf.data_ptr<int64_t>()[s.rank] = v;
  std::vector<at::Tensor> tensors{buf};
  wait_for(*this, s.pg->allreduce(tensors, c10d::AllreduceOptions{}), "the gradient-checksum all-reduce");
  const int64_t* all = buf.data_ptr<int64_t>();
  std::map<int64_t, int64_t> votes;
  for (int64_t r = 0; r < s.world; ++r) ++votes[all[r]];
  if (votes.size() == 1) return {};
  int64_t majority = 0, best = 0;
  for (const auto& [value, n] : votes)
    if (n > best) best = n, majority = value;
  std::vector<int64_t> differ;
  for (int64_t r = 0; r < s.world; ++r)
    if (2 * best <= s.world || all[r] != majority) differ.push_back(r);
  return differ;
}

void distributed::check_same_parameters(const std::vector<at::Tensor>& parameters, bool same_sizes) {
  impl& s = *impl_;
  int64_t numel = 0;
  for (const at::Tensor& p : parameters) numel += p.numel();
  // Slots 2r and 2r + 1 hold rank r's counts, the others 0: SUM gathers them exactly.
  at::Tensor buf = at::zeros({2 * s.world}, at::kLong);
  int64_t* all = buf.data_ptr<int64_t>();
  all[2 * s.rank] = static_cast<int64_t>(parameters.size());
  all[2 * s.rank + 1] = same_sizes ? numel : 0;
  std::vector<at::Tensor> tensors{buf};
  wait_for(*this, s.pg->allreduce(tensors, c10d::AllreduceOptions{}),
           "the parameter-count all-reduce (the guard's construction)");
  std::string differ;
  for (int64_t r = 1; r < s.world; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
      differ += fmt::format("; rank {} has {} parameters{}", r, all[2 * r],
                            same_sizes ? fmt::format(" ({} elements)", all[2 * r + 1]) : std::string());
  TORCH_CHECK(differ.empty(), "nanguard::distributed: the ranks guard different models: rank 0 has ", all[0],
              " parameters", same_sizes ? fmt::format(" ({} elements)", all[1]) : std::string(), differ,
              "; build the same model on every rank (e.g. torch.manual_seed before building it)");
}

std::string distributed::broadcast(const std::string& text, int64_t root) {
  impl& s = *impl_;
  TORCH_CHECK(root >= 0 && root < s.world, "nanguard::distributed::broadcast: root ", root, " is not a rank in [0, ",
              s.world, ")");
  at::Tensor size = at::full({1}, s.rank == root ? static_cast<int64_t>(text.size()) : int64_t(0), at::kLong);
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  {
    std::vector<at::Tensor> tensors{size};
    wait_for(*this, s.pg->broadcast(tensors, bo), fmt::format("the broadcast from rank {}", root));
  }
  const int64_t n = size.item<int64_t>();
  if (n == 0) return "";
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (s.rank == root) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  std::vector<at::Tensor> tensors{bytes};
  wait_for(*this, s.pg->broadcast(tensors, bo), fmt::format("the broadcast from rank {}", root));
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(n));
}

void distributed::barrier() {
  wait_for(*this, impl_->pg->barrier(), "the barrier");
}

void distributed::on_averaged(std::function<void(int64_t, const std::vector<at::Tensor>&)> hook) {
  impl_->hook = std::move(hook);
}

uint64_t checksum(const std::vector<at::Tensor>& tensors) {
  // FNV-1a over 64-bit words (then the tail bytes): fast enough for every
  // parameter of a model at the end of a run or every K steps.
  detail::fnv1a h;
  for (const at::Tensor& t0 : tensors) {
    if (!t0.defined()) {
      h.add(0xffu);
      continue;
    }
    const at::Tensor t = t0.to(at::kCPU).contiguous();  // a GPU's tensor is hashed from a host copy
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, bytes + i, 8);
      h.add(w);
    }
    for (; i < n; ++i) h.add(bytes[i]);
    h.add(n);
  }
  return h.value();
}

}  // namespace nanguard
