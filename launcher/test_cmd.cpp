// accel test: accel-launch + accel-check, read through a pipe, summarized as a table.
#include "launcher/test_cmd.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iostream>
#include <map>

#include "agent/common/temp_dir.h"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMarker = "ACCEL-CHECK\t";
// The rows of the table, in order; the last one comes from the attempt after the forced failure.
const std::vector<std::string>& rows() {
  static const std::vector<std::string> kRows = {
      "environment contract", "collectives", "training matches 1 process", "checkpoint round trip",
      "worker failure restarted"};
  return kRows;
}

struct Row {
  int attempt = -1;
  bool ok = false;
  std::string detail;
};

fs::path self_dir() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : self.parent_path();
}

std::vector<std::string> split_tabs(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t tab = s.find('\t', start);
    out.push_back(s.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
    if (tab == std::string::npos) return out;
    start = tab + 1;
  }
}

std::string exit_text(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

}  // namespace

int run_test(const TestOptions& options) {
  fs::path dir = self_dir();
  fs::path launch = dir / "accel-launch";
  fs::path check = dir / "accel-check";
  std::error_code ec;
  for (const auto& p : {launch, check}) {
    if (!fs::exists(p, ec)) {
      std::cerr << "accel test: error: " << p.string()
                << " is missing: accel test needs accel-launch and accel-check beside accel\n";
      return 2;
    }
  }
  std::string work = make_temp_dir("accel-test-");
  if (work.empty()) {
    std::cerr << "accel test: error: cannot create a folder under " << temp_root() << ": "
              << std::strerror(errno) << "\n";
    return 2;
  }

  // The user's options first, then what the check needs: flags typed later win.
  std::vector<std::string> args = {launch.string()};
  args.insert(args.end(), options.launch_args.begin(), options.launch_args.end());
  for (const char* a :
       {"--max-restarts", "1", "--mixed-precision", "no", "--gradient-accumulation-steps", "1",
        "--checkpoint-dir=", "--checkpoint-interval", "0", "--tee", "3"}) {
    args.emplace_back(a);
  }
  args.push_back("--env");
  args.push_back("ACCEL_CHECK_DIR=" + (fs::path(work) / "checkpoints").string());
  // Why: so that `accel test -n 1` checks the collectives through the real backend (NCCL on a
  // GPU) instead of a single process's identity.
  args.push_back("--env");
  args.push_back("ACCEL_GROUP_OF_ONE=1");
  if (options.inject_collective_fault) {
    args.push_back("--env");
    args.push_back("ACCEL_CHECK_FAULT=collective");
  }
  args.push_back("--");
  args.push_back(check.string());

  std::string shown = "accel-launch";
  for (size_t i = 1; i < args.size(); ++i) {
    shown += " " + (i + 1 == args.size() ? std::string("accel-check") : args[i]);
  }
  std::cout << "accel test: " << shown << "\n" << std::flush;

  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) {
    std::cerr << "accel test: error: pipe: " << std::strerror(errno) << "\n";
    return 2;
  }
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  if (pid < 0) {
    std::cerr << "accel test: error: fork: " << std::strerror(errno) << "\n";
    return 2;
  }
  if (pid == 0) {
    ::dup2(pipefd[1], STDOUT_FILENO);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "accel test: cannot run %s: %s\n", argv[0], std::strerror(errno));
    std::_Exit(127);
  }
  ::close(pipefd[1]);
  // Ctrl-C reaches accel-launch too (same process group); it stops the job and prints its
  // summary, which this process must still read to the end.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  struct sigaction old_int {};
  ::sigaction(SIGINT, &ignore, &old_int);

  std::map<std::string, Row> results;
  std::deque<std::string> tail;  // the output, for a failure with no results
  int attempts_seen = -1;
  FILE* in = ::fdopen(pipefd[0], "r");
  char* line = nullptr;
  size_t cap = 0;
  ssize_t n;
  while ((n = ::getline(&line, &cap, in)) > 0) {
    std::string text(line, static_cast<size_t>(n));
    if (auto at = text.find(kMarker); at != std::string::npos) {
      if (!text.empty() && text.back() == '\n') text.pop_back();
      auto f = split_tabs(text.substr(at + std::strlen(kMarker)));
      if (f.size() >= 4) {
        Row row{std::atoi(f[0].c_str()), f[2] == "PASS", f[3]};
        attempts_seen = std::max(attempts_seen, row.attempt);
        if (row.attempt >= results[f[1]].attempt) results[f[1]] = row;
      }
      continue;
    }
    if (options.verbose) {
      std::cout << text << std::flush;
    } else {
      tail.push_back(text);
      if (tail.size() > 40) tail.pop_front();
    }
  }
  std::free(line);
  std::fclose(in);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::error_code rm;
  fs::remove_all(work, rm);

  if (results.empty()) {
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      std::cout << "accel test: rank 0 runs on another machine; the table is printed there\n";
      return 0;
    }
    std::cout << "accel test: the check reported nothing (accel-launch: " << exit_text(status)
              << "). Its last output:\n";
    for (const auto& t : tail) std::cout << "  " << t;
    std::cout << "accel test: FAIL\n";
    return 1;
  }
  if (results.count("worker failure restarted") == 0) {
    results["worker failure restarted"] = {
        0, false,
        "no attempt ran after the last rank's forced exit (code 3); accel-launch ended with " +
            exit_text(status)};
  }
  int failed = 0;
  std::printf("\n  %-28s %-6s %s\n", "CHECK", "RESULT", "DETAIL");
  for (const auto& name : rows()) {
    auto it = results.find(name);
    Row row = it == results.end() ? Row{-1, false, "not reported"} : it->second;
    if (!row.ok) ++failed;
    std::printf("  %-28s %-6s %s\n", name.c_str(), row.ok ? "PASS" : "FAIL", row.detail.c_str());
  }
  bool launcher_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!launcher_ok && failed == 0) {
    ++failed;
    std::printf("  %-28s %-6s %s\n", "launcher exit", "FAIL",
                ("accel-launch ended with " + exit_text(status)).c_str());
  }
  if (failed > 0 && !options.verbose && !tail.empty()) {
    std::cout << "\nThe launcher's last output (accel test --verbose shows all of it):\n";
    for (const auto& t : tail) std::cout << "  " << t;
  }
  std::printf("\naccel test: %s (%d of %zu checks passed, %d attempt%s, %.1f s)\n",
              failed == 0 ? "PASS" : "FAIL", static_cast<int>(rows().size()) - failed,
              rows().size(), attempts_seen + 1, attempts_seen == 0 ? "" : "s", seconds);
  std::fflush(stdout);
  return failed == 0 ? 0 : 1;
}

}  // namespace accel::launcher
