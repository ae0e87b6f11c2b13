// Spawning (Boost.Process), exit watching (pidfd) and stopping of one attempt's workers.
#include "agent/supervisor/worker_group.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <array>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/process/args.hpp>
#include <boost/process/child.hpp>
#include <boost/process/env.hpp>
#include <boost/process/environment.hpp>
#include <boost/process/exe.hpp>
#include <boost/process/extend.hpp>
#include <boost/process/io.hpp>
#include <boost/process/pipe.hpp>
#include <boost/process/start_dir.hpp>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "agent/supervisor/line_sink.h"
#include "agent/supervisor/shm_names.h"
#include "contract/worker_contract.h"

namespace accel::supervisor {

namespace asio = boost::asio;
namespace bp = boost::process;
using stream_descriptor = asio::posix::stream_descriptor;

std::string signal_name(int signal) {
  const char* abbrev = ::sigabbrev_np(signal);
  if (abbrev == nullptr) return "signal " + std::to_string(signal);
  return std::string("SIG") + abbrev;
}

std::string WorkerExit::describe() const {
  if (!signaled) return "exit code " + std::to_string(exit_code);
  return signal_name(signal) + " (signal " + std::to_string(signal) + ")";
}

namespace {

struct Stream {
  std::unique_ptr<stream_descriptor> pipe;  // our read end
  std::unique_ptr<LineSink> sink;
  bool open = false;
};

}  // namespace

struct WorkerGroup::State {
  struct Worker {
    WorkerSpec spec;
    pid_t pid = -1;
    int log_fd = -1;
    Stream out;
    Stream err;
    std::unique_ptr<stream_descriptor> pidfd;
    bool exited = false;
  };

  State(asio::io_context& io_context, WorkerGroupOptions opts)
      : io(io_context), options(opts), timer(io_context) {}

  asio::io_context& io;
  WorkerGroupOptions options;
  std::vector<std::unique_ptr<Worker>> workers;
  ExitHandler on_exit;
  asio::steady_timer timer;
  bool stopping = false;
  bool stopped = false;
  bool escalated = false;
  std::vector<StopHandler> stop_handlers;

  size_t running() const {
    size_t n = 0;
    for (const auto& w : workers) n += w->exited ? 0 : 1;
    return n;
  }
};

namespace {

using State = WorkerGroup::State;
using Worker = State::Worker;

void close_stream(Stream& s) {
  if (!s.open) return;
  s.open = false;
  s.sink->finish();
  boost::system::error_code ignored;
  s.pipe->close(ignored);
}

// Takes the read end out of a Boost.Process pipe (the write end went to the child).
std::unique_ptr<stream_descriptor> adopt_read_end(asio::io_context& io, bp::pipe& p) {
  int fd = p.native_source();
  p.assign_source(-1);
  auto sd = std::make_unique<stream_descriptor>(io, fd);
  sd->non_blocking(true);
  return sd;
}

// Reads everything the pipe holds now. Why raw read(2) and async_wait rather than
// async_read_some: the exit handler drains the same pipe, and only one reader keeps order.
void drain(Stream& s) {
  std::array<char, 65536> buf{};
  while (s.open) {
    ssize_t n = ::read(s.pipe->native_handle(), buf.data(), buf.size());
    if (n > 0) {
      s.sink->feed(std::string_view(buf.data(), static_cast<size_t>(n)));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      close_stream(s);  // EOF or a read error
    }
  }
}

void arm_read(const std::shared_ptr<State>& state, Worker* w, Stream Worker::*which) {
  Stream& s = w->*which;
  if (!s.open) return;
  std::weak_ptr<State> weak = state;
  s.pipe->async_wait(stream_descriptor::wait_read,
                     [weak, w, which](const boost::system::error_code& ec) {
                       auto st = weak.lock();
                       if (!st || ec) return;
                       drain(w->*which);
                       arm_read(st, w, which);
                     });
}

void signal_groups(State& st, int sig, bool include_exited) {
  for (auto& w : st.workers) {
    if (w->pid <= 0 || (w->exited && !include_exited)) continue;
    // Why the group: a worker's own children (a shell's, a data loader's) go too. An exited
    // leader's group may still hold such children; ESRCH just means none are left.
    ::killpg(w->pid, sig);
  }
}

void finish_stop(const std::shared_ptr<State>& st) {
  if (!st->stopping) return;
  st->stopping = false;
  st->stopped = true;
  st->timer.cancel();
  signal_groups(*st, SIGKILL, /*include_exited=*/true);  // leftover grandchildren
  StopReport report;
  report.escalated_to_sigkill = st->escalated;
  for (auto& w : st->workers) {
    if (!w->exited) report.unkillable.push_back(w->pid);
  }
  for (auto& handler : st->stop_handlers) {
    asio::post(st->io, [handler, report] { handler(report); });
  }
  st->stop_handlers.clear();
}

void escalate(const std::shared_ptr<State>& st) {
  if (st->escalated) return;
  st->escalated = true;
  signal_groups(*st, SIGKILL, /*include_exited=*/false);
  st->timer.expires_after(st->options.kill_timeout);
  std::weak_ptr<State> weak = st;
  st->timer.async_wait([weak](const boost::system::error_code& ec) {
    auto s = weak.lock();
    if (s && !ec) finish_stop(s);
  });
}

void on_pidfd_readable(const std::shared_ptr<State>& st, Worker* w) {
  int status = 0;
  pid_t r = ::waitpid(w->pid, &status, WNOHANG);
  if (r == 0) return;  // spurious; the caller re-arms
  WorkerExit exit;
  exit.rank = w->spec.rank;
  exit.local_rank = w->spec.local_rank;
  exit.pid = w->pid;
  exit.time = std::chrono::system_clock::now();
  exit.during_stop = st->stopping || st->stopped;
  if (r < 0) {
    exit.signaled = true;  // reaped elsewhere: the status is lost
    exit.signal = SIGKILL;
  } else if (WIFSIGNALED(status)) {
    exit.signaled = true;
    exit.signal = WTERMSIG(status);
  } else {
    exit.exit_code = WEXITSTATUS(status);
  }
  w->exited = true;
  remove_shm_names_of(w->pid);
  boost::system::error_code ignored;
  w->pidfd->close(ignored);
  // Everything the worker wrote is in the pipes now; read it before reporting the exit.
  drain(w->out);
  drain(w->err);
  const auto& tail = w->err.sink->last_lines();
  exit.stderr_tail.assign(tail.begin(), tail.end());
  if (st->running() == 0) {
    // The last worker is gone: what the workers left behind in their groups goes too, however
    // they ended (success included), before anyone is told the group is done.
    signal_groups(*st, SIGKILL, /*include_exited=*/true);
  }
  if (st->on_exit) st->on_exit(exit);
  if (st->stopping && st->running() == 0) finish_stop(st);
}

void arm_exit(const std::shared_ptr<State>& st, Worker* w) {
  std::weak_ptr<State> weak = st;
  w->pidfd->async_wait(stream_descriptor::wait_read,
                       [weak, w](const boost::system::error_code& ec) {
                         auto s = weak.lock();
                         if (!s || ec || w->exited) return;
                         on_pidfd_readable(s, w);
                         if (!w->exited) arm_exit(s, w);
                       });
}

Status spawn(const std::shared_ptr<State>& st, Worker& w) {
  const WorkerSpec& spec = w.spec;
  if (spec.argv.empty()) return Status::error("empty command line");
  if (!spec.log_path.empty()) {
    // Why O_NOFOLLOW: log_dir may be shared (a project folder); a link planted at a rank's log
    // name must not make the agent truncate the file it points to.
    w.log_fd =
        ::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (w.log_fd < 0) {
      int err = errno;
      return Status::error("cannot open log file " + spec.log_path + ": " +
                           (err == ELOOP ? std::string("it is a symbolic link (refused)")
                                         : std::string(std::strerror(err))));
    }
  }
  auto log_failed = std::make_shared<bool>(false);  // shared by the rank's two streams
  auto make_stream = [&](bool to_console, int console_fd, size_t keep, bool is_stderr) {
    Stream s;
    LineSink::Options o{
        .prefix = spec.prefix,
        .console_fd = to_console ? console_fd : -1,
        .log_fd = w.log_fd,
        .keep_last = keep,
    };
    o.log_path = spec.log_path;
    o.on_log_error = st->options.on_warning;
    o.log_failed = log_failed;
    if (spec.forward) {
      o.on_line = [f = spec.forward, is_stderr](std::string_view line) { f(is_stderr, line); };
    }
    s.sink = std::make_unique<LineSink>(std::move(o));
    s.open = true;
    return s;
  };
  w.out = make_stream(spec.stdout_to_console, st->options.console_stdout_fd, 0, false);
  w.err = make_stream(spec.stderr_to_console, st->options.console_stderr_fd,
                      st->options.stderr_tail_lines, true);

  bp::environment env;
  for (const auto& [k, v] : spec.env) env[k] = v;
  std::vector<std::string> args(spec.argv.begin() + 1, spec.argv.end());
  std::string dir =
      spec.working_dir.empty() ? std::filesystem::current_path().string() : spec.working_dir;
  bp::pipe out_pipe;
  bp::pipe err_pipe;
  // Why CLOEXEC on both ends: no other worker may inherit them (dup2 onto 1/2 clears it).
  for (int fd : {out_pipe.native_source(), out_pipe.native_sink(), err_pipe.native_source(),
                 err_pipe.native_sink()}) {
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  const pid_t parent = ::getpid();
  std::error_code ec;
  bp::child child(
      bp::exe = spec.argv[0], bp::args = args, env, bp::start_dir = dir,
      bp::std_in<bp::null, bp::std_out> out_pipe, bp::std_err > err_pipe,
      bp::extend::on_exec_setup =
          [parent](auto&) {
            // In the child, between fork and exec: async-signal-safe calls only.
            ::setpgid(0, 0);
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (::getppid() != parent) ::_exit(127);  // the spawner died before prctl
            sigset_t none;
            ::sigemptyset(&none);
            ::sigprocmask(SIG_SETMASK, &none, nullptr);
            ::signal(SIGPIPE, SIG_DFL);
            // Only stdin, stdout and stderr reach the program, as torchrun's workers get them
            // (Python's close_fds): not what the launcher's caller left open (a CI runner's
            // pipe, which a worker's leftover child would then hold open) nor the launcher's
            // own. Why CLOEXEC rather than close: Boost.Process reports a failed exec through
            // a pipe of its own until the exec. Linux < 5.11 lacks the flag: fds then pass.
            ::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
          },
      ec);
  if (ec) return Status::error("cannot start " + spec.argv[0] + ": " + ec.message());
  w.pid = child.id();
  child.detach();  // Why: the pidfd below watches and reaps it, not bp::child.
  w.out.pipe = adopt_read_end(st->io, out_pipe);
  w.err.pipe = adopt_read_end(st->io, err_pipe);

  // Why syscall(): glibc 2.36's <sys/pidfd.h> lacks extern "C", so C++ cannot link it.
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, w.pid, 0));
  if (pidfd < 0) {
    int err = errno;
    ::killpg(w.pid, SIGKILL);
    ::waitpid(w.pid, nullptr, 0);
    w.exited = true;
    remove_shm_names_of(w.pid);
    return Status::error(std::string("pidfd_open failed (needs Linux >= 5.3): ") +
                         std::strerror(err));
  }
  w.pidfd = std::make_unique<stream_descriptor>(st->io, pidfd);
  return Status::ok();
}

}  // namespace

WorkerGroup::WorkerGroup(asio::io_context& io, WorkerGroupOptions options)
    : state_(std::make_shared<State>(io, options)) {}

WorkerGroup::~WorkerGroup() {
  for (auto& w : state_->workers) {
    if (w->pid > 0 && !w->exited) {
      ::killpg(w->pid, SIGKILL);
      ::waitpid(w->pid, nullptr, WNOHANG);
    }
    if (w->log_fd >= 0) ::close(w->log_fd);
  }
}

Status WorkerGroup::start(std::vector<WorkerSpec> specs, ExitHandler on_exit) {
  sweep_dead_shm_names();
  auto& st = state_;
  st->on_exit = std::move(on_exit);
  for (auto& spec : specs) {
    auto w = std::make_unique<Worker>();
    w->spec = std::move(spec);
    Status s = spawn(st, *w);
    st->workers.push_back(std::move(w));
    if (!s) {
      Worker& failed = *st->workers.back();
      failed.exited = true;
      for (auto& other : st->workers) {
        if (other->pid > 0 && !other->exited) {
          ::killpg(other->pid, SIGKILL);
          ::waitpid(other->pid, nullptr, 0);  // just spawned and SIGKILLed: returns at once
          other->exited = true;
        }
      }
      st->on_exit = nullptr;
      return Status::error("rank " + std::to_string(failed.spec.rank) + ": " + s.message());
    }
  }
  for (auto& w : st->workers) {
    arm_read(st, w.get(), &Worker::out);
    arm_read(st, w.get(), &Worker::err);
    arm_exit(st, w.get());
  }
  return Status::ok();
}

void WorkerGroup::stop(int signal, StopHandler done) {
  auto& st = state_;
  if (done) st->stop_handlers.push_back(std::move(done));
  if (st->stopped) {
    st->stopping = true;  // report again
    finish_stop(st);
    return;
  }
  if (st->stopping) {
    if (signal == SIGKILL) escalate(st);
    return;
  }
  st->stopping = true;
  if (st->running() == 0) {
    finish_stop(st);
    return;
  }
  if (signal == SIGKILL) {
    escalate(st);
    return;
  }
  signal_groups(*st, signal, /*include_exited=*/true);
  // Why: a stopped process (SIGSTOP, Ctrl-Z, a debugger detached) does not act on the signal
  // until it runs again; it would cost the whole stop_timeout. systemd does the same.
  if (signal != SIGCONT) signal_groups(*st, SIGCONT, /*include_exited=*/true);
  st->timer.expires_after(st->options.stop_timeout);
  std::weak_ptr<State> weak = st;
  st->timer.async_wait([weak](const boost::system::error_code& ec) {
    auto s = weak.lock();
    if (s && !ec && s->stopping) escalate(s);
  });
}

size_t WorkerGroup::running() const { return state_->running(); }

std::vector<std::pair<int, pid_t>> WorkerGroup::running_workers() const {
  std::vector<std::pair<int, pid_t>> out;
  for (const auto& w : state_->workers)
    if (!w->exited) out.emplace_back(w->spec.rank, w->pid);
  return out;
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> out;
  for (const auto& w : state_->workers) out.push_back(w->pid);
  return out;
}

}  // namespace accel::supervisor
