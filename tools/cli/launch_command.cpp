// `nanguard launch -n 4 [--timeout S] -- PROGRAM ARGS...`: runs PROGRAM as
// the ranks of one process group on this machine, like torchrun: each rank
// gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1
// and MASTER_PORT (a free port) in its environment, and
// nanguard::init_process_group_from_env() meets the others in a TCPStore
// there. Every output line is prefixed with `[rank k] `. When a rank fails
// (non-zero exit or a signal) the others are stopped and the launcher exits
// non-zero, naming the rank and how it ended; so it does after --timeout.
//
// Several machines (torchrun's static rendezvous): one launcher per node
// with `--nnodes M --node-rank K --master-addr ADDR --port P`, the same ADDR
// and P everywhere (node 0's address); node K's ranks are K*N .. K*N+N-1 of
// WORLD_SIZE=M*N.
#include "commands.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace nanguard::cli {
namespace {

struct launch_args {
  int ranks = 1;  // on this node
  int nodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  double timeout = 0;
  int port = 0;
  std::vector<std::string> argv;

  int world_size() const { return nodes * ranks; }
  int first_rank() const { return node_rank * ranks; }
};

// A port nobody listens on now (the kernel picks it).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("launch: cannot open a socket: {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error(fmt::format("launch: cannot find a free port on 127.0.0.1: {}", why));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// One rank: its process and the two pipes it writes.
struct rank_process {
  int rank = 0;
  pid_t pid = -1;
  int fd[2] = {-1, -1};       // stdout, stderr read ends
  std::string pending[2];     // a line not finished yet
  bool exited = false;
  int status = 0;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    return fmt::format("was killed by signal {} (SIG{})", sig, name ? name : "?");
  }
  return fmt::format("ended with wait status {}", status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Writes the complete lines of `buf` with the rank prefix; keeps the rest.
void emit(std::string& buf, int rank, std::FILE* to, bool flush_all) {
  size_t start = 0;
  for (size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1)
    std::fprintf(to, "[rank %d] %.*s\n", rank, static_cast<int>(nl - start), buf.data() + start);
  buf.erase(0, start);
  if (flush_all && !buf.empty()) {
    std::fprintf(to, "[rank %d] %s\n", rank, buf.c_str());
    buf.clear();
  }
  std::fflush(to);
}

pid_t spawn(const launch_args& a, int rank, int port, int out_fd, int err_fd) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(fmt::format("launch: fork failed: {}", std::strerror(errno)));
  if (pid > 0) return pid;
  // The child: dies with the launcher, writes into the pipes, runs PROGRAM.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  const std::string r = std::to_string(rank), local = std::to_string(rank - a.first_rank()),
                    world = std::to_string(a.world_size()), n = std::to_string(a.ranks), p = std::to_string(port),
                    node = std::to_string(a.node_rank);
  ::setenv("RANK", r.c_str(), 1);
  ::setenv("LOCAL_RANK", local.c_str(), 1);
  ::setenv("WORLD_SIZE", world.c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", n.c_str(), 1);
  ::setenv("GROUP_RANK", node.c_str(), 1);  // torchrun's name of the node's rank
  ::setenv("MASTER_ADDR", a.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", p.c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& s : a.argv) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "nanguard launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

void check_args(const launch_args& a) {
  if (a.ranks < 1 || a.ranks > 1024)
    throw usage_error(fmt::format("launch: -n must be in [1, 1024] but is {}", a.ranks));
  if (a.nodes < 1 || a.nodes > 1024)
    throw usage_error(fmt::format("launch: --nnodes must be in [1, 1024] but is {}", a.nodes));
  if (a.node_rank < 0 || a.node_rank >= a.nodes)
    throw usage_error(fmt::format("launch: --node-rank must be in [0, --nnodes={}) but is {}", a.nodes, a.node_rank));
  if (a.nodes > 1 && a.port == 0)
    throw usage_error("launch: with --nnodes > 1 every node needs the same --port (and --master-addr: node 0's "
                      "address), e.g. --port 29500");
  if (!(a.timeout >= 0)) throw usage_error(fmt::format("launch: --timeout must be >= 0 seconds but is {}", a.timeout));
  if (a.argv.empty()) throw usage_error("launch: no program given; usage: nanguard launch -n 2 -- ./train ARGS");
}

// Starts this node's ranks, each writing into two pipes the launcher reads.
std::vector<rank_process> start_ranks(const launch_args& a, int port) {
  std::vector<rank_process> ranks(static_cast<size_t>(a.ranks));
  for (int i = 0; i < a.ranks; ++i) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw std::runtime_error(fmt::format("launch: pipe failed: {}", std::strerror(errno)));
    rank_process& p = ranks[static_cast<size_t>(i)];
    p.rank = a.first_rank() + i;
    p.pid = spawn(a, p.rank, port, out[1], err[1]);
    ::close(out[1]);
    ::close(err[1]);
    p.fd[0] = out[0];
    p.fd[1] = err[0];
  }
  return ranks;
}

int run_launch(const launch_args& a) {
  check_args(a);
  const int port = a.port > 0 ? a.port : free_port();
  ::signal(SIGPIPE, SIG_IGN);
  std::vector<rank_process> ranks = start_ranks(a, port);

  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  int failed_rank = -1, failed_status = 0;
  std::string also;  // the other ranks that failed before they were stopped
  std::vector<int> running_at_timeout;  // the ranks --timeout stopped
  std::chrono::steady_clock::time_point kill_at{};
  bool stopping = false;
  const auto stop_all = [&] {
    if (stopping) return;
    stopping = true;
    for (rank_process& p : ranks)
      if (!p.exited) ::kill(p.pid, SIGTERM);
    kill_at = clock::now() + std::chrono::seconds(3);
  };

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<std::pair<size_t, int>> owner;
    for (size_t i = 0; i < ranks.size(); ++i)
      for (int k = 0; k < 2; ++k)
        if (ranks[i].fd[k] >= 0) {
          fds.push_back({ranks[i].fd[k], POLLIN, 0});
          owner.emplace_back(i, k);
        }
    bool all_exited = true;
    for (const rank_process& p : ranks) all_exited = all_exited && p.exited;
    if (fds.empty() && all_exited) break;

    int ready = 0;
    if (!fds.empty()) ready = ::poll(fds.data(), fds.size(), 100);
    else ::usleep(20000);
    // Every rank is gone and their pipes hold nothing more: a child one
    // left running in the background keeps them open, not launch waiting.
    if (all_exited && ready == 0) {
      for (rank_process& p : ranks)
        for (int k = 0; k < 2; ++k)
          if (p.fd[k] >= 0) emit(p.pending[k], p.rank, k == 0 ? stdout : stderr, true);
      break;
    }
    for (size_t j = 0; j < fds.size(); ++j) {
      if (!(fds[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      rank_process& p = ranks[owner[j].first];
      const int k = owner[j].second;
      char buf[65536];
      const ssize_t n = ::read(p.fd[k], buf, sizeof buf);
      if (n > 0) {
        p.pending[k].append(buf, static_cast<size_t>(n));
        emit(p.pending[k], p.rank, k == 0 ? stdout : stderr, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit(p.pending[k], p.rank, k == 0 ? stdout : stderr, true);
        ::close(p.fd[k]);
        p.fd[k] = -1;
      }
    }
    // Reap; of the ranks that failed in one sweep, blame one killed by a
    // signal first (the others' errors usually follow from its death).
    std::vector<rank_process*> newly_failed;
    for (rank_process& p : ranks) {
      if (p.exited) continue;
      int status = 0;
      if (::waitpid(p.pid, &status, WNOHANG) == p.pid) {
        p.exited = true;
        p.status = status;
        if (failed(status) && !stopping) newly_failed.push_back(&p);
      }
    }
    std::stable_sort(newly_failed.begin(), newly_failed.end(), [](const rank_process* x, const rank_process* y) {
      return WIFSIGNALED(x->status) && !WIFSIGNALED(y->status);
    });
    for (const rank_process* p : newly_failed) {
      if (failed_rank < 0) {
        failed_rank = p->rank;
        failed_status = p->status;
      } else {
        also += fmt::format("; rank {} {}", p->rank, describe(p->status));
      }
    }
    if (!newly_failed.empty()) stop_all();
    if (!stopping && a.timeout > 0 &&
        std::chrono::duration<double>(clock::now() - start).count() > a.timeout) {
      for (const rank_process& p : ranks)
        if (!p.exited) running_at_timeout.push_back(p.rank);
      stop_all();
    }
    if (stopping && clock::now() > kill_at) {
      for (rank_process& p : ranks)
        if (!p.exited) ::kill(p.pid, SIGKILL);
      kill_at = clock::now() + std::chrono::hours(1);
    }
  }

  if (failed_rank >= 0) {
    std::fprintf(stderr, "nanguard: error: launch: rank %d %s%s; stopped the other ranks\n", failed_rank,
                 describe(failed_status).c_str(), also.c_str());
    if (WIFEXITED(failed_status)) return WEXITSTATUS(failed_status);
    return 128 + WTERMSIG(failed_status);
  }
  if (!running_at_timeout.empty()) {
    std::fprintf(stderr, "nanguard: error: launch: the ranks did not finish within --timeout %g s (still running: "
                 "rank %s); stopped them\n", a.timeout, fmt::format("{}", fmt::join(running_at_timeout, ", ")).c_str());
    return 124;  // as timeout(1): 1 is kept for internal errors
  }
  return exit_ok;
}

}  // namespace

command add_launch_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "launch", "Run a program as N ranks of one process group on this machine, or on each of --nnodes machines "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set like torchrun)");
  auto a = std::make_shared<launch_args>();
  sub->add_option("-n,--nproc", a->ranks, "the number of ranks (processes)")->required();
  sub->add_option("--timeout", a->timeout, "stop every rank and fail after this many seconds (0: no limit)");
  sub->add_option("--port", a->port, "MASTER_PORT (default: a free port; required with --nnodes > 1)")
      ->check(CLI::Range(1, 65535));
  sub->add_option("--nnodes", a->nodes, "the number of nodes (one launcher on each; default 1)");
  sub->add_option("--node-rank", a->node_rank, "this node's index in [0, --nnodes) (default 0)");
  sub->add_option("--master-addr", a->master_addr, "MASTER_ADDR: node 0's address (default 127.0.0.1)");
  sub->add_option("command", a->argv, "the program and its arguments, after --")->required()->expected(-1);
  sub->footer(exit_codes("every rank exited 0") +
              "\nA rank that fails: its exit code (128+N when killed by signal N); --timeout reached: 124.");
  return {sub, [a] { return run_launch(*a); }};
}

}  // namespace nanguard::cli
