// The login-node tools as a person uses them: the `accel config` wizard through a real
// pseudo-terminal (questions read, answers typed, a wrong answer re-asked), `accel test` and
// `accel env`.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>

#include "tests/integration/harness.h"

namespace accel::testing {
namespace {

using namespace std::chrono_literals;

// A program on the slave side of a pseudo-terminal: it sees a terminal on stdin/stdout, as in
// an interactive shell. The test reads what it prints and types lines as a person would.
class Terminal {
 public:
  Terminal(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
    std::vector<std::string> argv = args;
    std::vector<std::string> envs;
    for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
    pid_ = ::forkpty(&fd_, nullptr, nullptr, nullptr);
    if (pid_ == 0) {
      std::vector<char*> cargv, cenv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      for (auto& e : envs) cenv.push_back(e.data());
      cenv.push_back(nullptr);
      ::execve(cargv[0], cargv.data(), cenv.data());
      std::_Exit(127);
    }
  }
  ~Terminal() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }

  // Reads until `text` appears after what earlier calls consumed; false after `timeout`.
  bool expect(const std::string& text, std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto at = screen_.find(text, consumed_);
      if (at != std::string::npos) {
        consumed_ = at + text.size();
        return true;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left <= 0ms || !read_some(left)) return false;
    }
  }
  // Types `line` and presses Enter.
  void type(const std::string& line) {
    std::string keys = line + "\r";
    ASSERT_EQ(::write(fd_, keys.data(), keys.size()), static_cast<ssize_t>(keys.size()));
  }
  // Waits for the program to exit; its exit code, or -1.
  int wait(std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) return -1;
      read_some(50ms);
    }
    reaped_ = true;
    while (read_some(50ms)) {
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  const std::string& screen() const { return screen_; }

 private:
  bool read_some(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
    char buf[4096];
    ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n <= 0) return false;
    screen_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string screen_;
  size_t consumed_ = 0;
};

std::map<std::string, std::string> user_env(const TempDir& dir) {
  return {{"HOME", dir.path().string()}, {"PATH", "/usr/bin:/bin"}, {"TERM", "dumb"}};
}

bool gpus_here() { return fs::exists("/proc/driver/nvidia/gpus"); }

#define EXPECT_SCREEN(term, text) \
  ASSERT_TRUE((term).expect(text)) << "waiting for: " << (text) << "\nscreen:\n" << (term).screen()

// A person with no config answers the questions (one wrong answer, re-asked); the file lands
// at the default location and accel-launch then runs with those settings.
TEST(AccelConfigWizard, AnswersTypedInATerminalWriteTheConfigTheLauncherUses) {
  TempDir dir;
  const std::string file = dir / ".config/accel/config.yaml";
  {
    Terminal t({ACCEL_BIN, "config"}, user_env(dir));
    EXPECT_SCREEN(t, "Where will the job run?");
    EXPECT_SCREEN(t, "Choice [1]: ");
    t.type("3");
    EXPECT_SCREEN(t, "answer a number from 1 to 2; try again.");
    EXPECT_SCREEN(t, "Choice [1]: ");
    t.type("1");
    EXPECT_SCREEN(t, "Worker processes per machine");
    EXPECT_SCREEN(t, "]: ");
    t.type("0");
    EXPECT_SCREEN(t,
                  "expected an integer from 1 to 4096, or auto, gpu or cpu, got '0'; try again.");
    t.type("3");
    EXPECT_SCREEN(t, "Mixed precision (no, bf16, fp16) [no]: ");
    if (!gpus_here()) {
      t.type("fp16");
      EXPECT_SCREEN(t, "fp16 needs CUDA GPUs; on CPUs choose bf16 or no; try again.");
    }
    t.type("bf16");
    EXPECT_SCREEN(t, "Checkpoint folder");
    t.type(dir / "ck");
    EXPECT_SCREEN(t, "Save a checkpoint every how many optimizer steps?");
    t.type("50");
    EXPECT_SCREEN(t, "Restarts of the whole group after a failure [0]: ");
    t.type("2");
    EXPECT_SCREEN(t, "Hang timeout");
    t.type("");  // Enter: the default
    EXPECT_SCREEN(t, "Collective timeout: the longest any one collective may take [30m]: ");
    t.type("5m");
    EXPECT_SCREEN(t, "num_processes: 3");
    EXPECT_SCREEN(t, "Write it to " + file + "? [Y/n]: ");
    t.type("");
    EXPECT_SCREEN(t, "wrote " + file);
    EXPECT_EQ(t.wait(), 0) << t.screen();
  }
  std::string text = read_file(file);
  for (const char* line : {"num_processes: 3\n", "max_restarts: 2\n", "mixed_precision: bf16\n",
                           "checkpoint_interval: 50\n", "collective_timeout: 5m\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in:\n" << text;
  }
  EXPECT_NE(text.find("checkpoint_dir: " + (dir / "ck")), std::string::npos) << text;
  EXPECT_EQ(text.find("hang_timeout"), std::string::npos) << text;  // left at its default

  auto run = run_launcher(dir, {"--", "sh", "-c", "echo ws=$WORLD_SIZE mp=$ACCEL_MIXED_PRECISION"});
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("[rank 2] ws=3 mp=bf16"), std::string::npos) << run.out;

  // Run again: the file's values are the defaults, and it is not replaced without a yes.
  Terminal t({ACCEL_BIN, "config"}, user_env(dir));
  EXPECT_SCREEN(t, "Editing " + file + ": its values are the defaults.");
  EXPECT_SCREEN(t, "Choice [1]: ");
  t.type("");
  EXPECT_SCREEN(t, "Worker processes per machine");
  EXPECT_SCREEN(t, "[3]: ");
  // Every question at its default: processes, precision, checkpoint folder and interval,
  // restarts, two timeouts (and CPU-only where there are GPUs).
  for (int i = 0; i < (gpus_here() ? 8 : 7); ++i) t.type("");
  EXPECT_SCREEN(t, "Replace " + file + " with this? [y/N]: ");
  t.type("");  // No, the default
  EXPECT_SCREEN(t, "Nothing was written.");
  EXPECT_EQ(t.wait(), 0) << t.screen();
  EXPECT_EQ(read_file(file), text);
}

// Several machines, each running accel-launch: the rank is checked against the machine count,
// and the token file is generated, readable by its owner only.
TEST(AccelConfigWizard, SeveralMachinesWithAGeneratedToken) {
  TempDir dir;
  const std::string file = dir / "cluster.yaml";
  const std::string token = dir / "secret/token";
  Terminal t({ACCEL_BIN, "config", "--config-file", file}, user_env(dir));
  EXPECT_SCREEN(t, "Choice [1]: ");
  t.type("2");
  EXPECT_SCREEN(t, "How do the machines meet?");
  EXPECT_SCREEN(t, "Choice [1]: ");
  t.type("1");
  EXPECT_SCREEN(t, "How many machines? (N, or MIN:MAX for an elastic job) [1]: ");
  t.type("1");
  EXPECT_SCREEN(t, "a multi-machine job has at least 2 machines; try again.");
  t.type("2");
  EXPECT_SCREEN(t, "Address of machine rank 0");
  t.type("10.0.0.1");
  EXPECT_SCREEN(t, "Coordinator port on machine rank 0 [29400]: ");
  t.type("");
  EXPECT_SCREEN(t, "This machine's rank, 0 to 1 (0 hosts the coordinator) [0]: ");
  t.type("2");
  EXPECT_SCREEN(t,
                "2 is not below the number of nodes (2); machine ranks run from 0 to nodes - 1; "
                "try again.");
  t.type("1");
  EXPECT_SCREEN(t, "Token file");
  t.type(token);
  EXPECT_SCREEN(t, "Generate a random token there");
  t.type("y");
  EXPECT_SCREEN(t, "Use your own TLS certificates (no: one derived from the token)? [y/N]: ");
  t.type("n");
  // processes, precision, checkpoint folder (none), restarts, two timeouts (and CPU-only where
  // there are GPUs): the defaults
  EXPECT_SCREEN(t, "Worker processes per machine");
  for (int i = 0; i < (gpus_here() ? 7 : 6); ++i) t.type("");  // the terminal queues them
  EXPECT_SCREEN(t, "Write it to " + file + "? [Y/n]: ");
  t.type("y");
  EXPECT_SCREEN(t, "wrote " + token);
  EXPECT_SCREEN(t, "Next: accel-launch --config " + file);
  ASSERT_EQ(t.wait(), 0) << t.screen();

  std::string text = read_file(file);
  for (const std::string& line :
       std::vector<std::string>{"nodes: 2\n", "machine_rank: 1\n", "main_process_ip: 10.0.0.1\n",
                                "token_file: " + token + "\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in:\n" << text;
  }
  struct stat st {};
  ASSERT_EQ(::stat(token.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::string secret = read_file(token);
  EXPECT_EQ(secret.size(), 49u) << secret;  // 48 hex digits and a newline
  auto show = run_launcher(dir, {"--config", file, "--print-config"});
  EXPECT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find("machine_rank: 1"), std::string::npos) << show.out;
}

// Without a terminal it never waits for a person: answers come one per line, and input that
// ends (or a wrong answer) stops it with a message, writing nothing.
TEST(AccelConfigWizard, WithoutATerminalItReadsLinesOrStops) {
  TempDir dir;
  const std::string file = dir / "piped.yaml";
  Launched none(dir, ACCEL_BIN, {"config", "--config-file", file}, {}, "none");
  auto r = none.wait(10s);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(
      r.err.find(
          "input ended before the question 'Where will the job run?' was answered; nothing was "
          "written. Without a terminal, accel config reads one answer per line"),
      std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(file));

  auto piped = [&](const std::string& answers, const std::string& name) {
    std::ofstream(dir / (name + ".in")) << answers;
    Launched l(dir, "/bin/sh",
               {"-c", std::string(ACCEL_BIN) + " config --config-file " + file + " < " +
                          (dir / (name + ".in"))},
               {}, name);
    return l.wait(10s);
  };
  auto wrong = piped("1\nmany\n", "wrong");
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_NE(wrong.err.find("answer 'many' to 'Worker processes per machine"), std::string::npos)
      << wrong.err;
  EXPECT_FALSE(fs::exists(file));

  if (gpus_here()) GTEST_SKIP() << "the answers below are this machine's questions: no GPU";
  auto good = piped("1\n2\nno\n\n\n\n\ny\n", "good");
  EXPECT_EQ(good.exit_code, 0) << good.err << good.out;
  EXPECT_NE(read_file(file).find("num_processes: 2\n"), std::string::npos) << read_file(file);

  // Several machines meeting in a Slurm allocation: nothing about nodes, ranks or addresses is
  // asked or written (Slurm says them), and the answer says how to start it.
  fs::remove(file);
  auto slurm = piped("2\n3\n2\nno\n\n\n\n\ny\n", "slurm");
  EXPECT_EQ(slurm.exit_code, 0) << slurm.err << slurm.out;
  EXPECT_NE(slurm.out.find("srun --ntasks-per-node=1 accel-launch"), std::string::npos)
      << slurm.out;
  std::string written = read_file(file);
  EXPECT_NE(written.find("num_processes: 2\n"), std::string::npos) << written;
  for (const char* absent : {"nodes:", "machine_rank:", "main_process_ip:", "coordinator:"}) {
    EXPECT_EQ(written.find(absent), std::string::npos) << absent << "\n" << written;
  }
}

TEST(AccelTest, PassesOnTwoProcessesWithTheRestartCheck) {
  TempDir dir;
  Launched l(dir, ACCEL_BIN, {"test", "-n", "2"}, {}, "accel-test");
  auto r = l.wait(120s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* row : {"environment contract", "collectives", "training matches 1 process",
                          "checkpoint round trip", "worker failure restarted"}) {
    EXPECT_NE(r.out.find(std::string(row)), std::string::npos) << r.out;
  }
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("accel test: PASS (5 of 5 checks passed, 2 attempts"), std::string::npos)
      << r.out;
}

TEST(AccelTest, FailsWhenACollectiveGivesAWrongValue) {
  TempDir dir;
  Launched l(dir, ACCEL_BIN, {"test", "-n", "2", "--inject-collective-fault"}, {}, "accel-test");
  auto r = l.wait(120s);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("collectives                  FAIL   all-reduce sum gave 1003, expected 3"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("accel test: FAIL"), std::string::npos) << r.out;
}

TEST(AccelEnv, ReportsTheBuildAndHidesSecrets) {
  TempDir dir;
  Launched l(dir, ACCEL_BIN, {"env"}, {{"ACCEL_TOKEN", "hunter2secret"}, {"NCCL_DEBUG", "INFO"}},
             "accel-env");
  auto r = l.wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* part :
       {"## accel\n", "- version: ", "(commit ", "## system\n", "- CPU features: ", "## libtorch\n",
        "- CUDA: ", "- NCCL: ", "## configuration\n", "num_processes: 1", "NCCL_DEBUG=INFO",
        "ACCEL_TOKEN=(set, hidden)"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in:\n" << r.out;
  }
  EXPECT_EQ(r.out.find("hunter2secret"), std::string::npos) << r.out;
}

// `accel env` says what glibc's malloc does in the workers accel-launch would start from this
// environment, shows the variables that set it, and how many threads OpenBLAS runs products on.
TEST(AccelEnv, SaysWhatMallocWorkersGetAndOpenBlasThreads) {
  for (const char* name : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                           "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "ACCEL_KEEP_FREED_MEMORY"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << "this test's environment sets " << name;
  }
  auto env = [](const std::map<std::string, std::string>& extra) {
    TempDir dir;
    Launched l(dir, ACCEL_BIN, {"env"}, extra, "accel-env");
    auto r = l.wait(60s);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.out;
  };
  // Why 1: OpenBLAS takes no more threads than the machine has CPUs.
  std::string out = env({{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}});
  EXPECT_NE(out.find("- workers' malloc: accel-launch adds glibc.malloc.mmap_threshold=33554432:"
                     "glibc.malloc.trim_threshold=1073741824 to GLIBC_TUNABLES (libaccel's "
                     "thresholds: allocations below 32 MiB from the heap, up to 1 GiB free at its "
                     "top kept; ACCEL_KEEP_FREED_MEMORY=0 leaves glibc's own)\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("- workers' large CPU tensors: libaccel's workers reuse the blocks of freed "
                     "CPU tensors of 32 MiB or more (a block kept for 60 s without reuse goes "
                     "back; ACCEL_KEEP_FREED_MEMORY=0 maps each afresh); Python workers' are "
                     "mapped afresh, as glibc does\n"),
            std::string::npos)
      << out;
  void* libblas = ::dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  const bool openblas = libblas && ::dlsym(libblas, "openblas_get_num_threads");
  if (libblas) ::dlclose(libblas);
  if (openblas) {
    EXPECT_NE(out.find("- OpenBLAS threads: 1 (ATen's intra-op threads: 1; "), std::string::npos)
        << out;
  }
  out = env({{"ACCEL_KEEP_FREED_MEMORY", "0"}});
  EXPECT_NE(out.find("- workers' malloc: glibc's own moving thresholds "
                     "(ACCEL_KEEP_FREED_MEMORY=0)\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("- workers' large CPU tensors: each tensor of 32 MiB or more mapped afresh "
                     "and unmapped when freed (ACCEL_KEEP_FREED_MEMORY=0)\n"),
            std::string::npos)
      << out;
  out = env({{"ACCEL_KEEP_FREED_MEMORY", "ture"}, {"MALLOC_ARENA_MAX", "2"}});
  EXPECT_NE(
      out.find("- workers' malloc: none: accel-launch refuses ACCEL_KEEP_FREED_MEMORY=\"ture\" "
               "for its workers: expected true or false"),
      std::string::npos)
      << out;
  EXPECT_EQ(out.find("- workers' large CPU tensors:"), std::string::npos) << out;
  EXPECT_NE(out.find("\nMALLOC_ARENA_MAX=2\n"), std::string::npos) << out;
  out = env({{"MALLOC_TRIM_THRESHOLD_", ""}});
  EXPECT_NE(out.find("\nMALLOC_TRIM_THRESHOLD_=\n"), std::string::npos) << out;
  EXPECT_NE(out.find("- workers' malloc: this environment's MALLOC_TRIM_THRESHOLD_, left as it "
                     "is\n"),
            std::string::npos)
      << out;
}

// A safetensors file of float tensors, written byte by byte as the format says.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, int>>& tensors) {
  std::string json = "{";
  std::string data;
  for (const auto& [name, count] : tensors) {
    size_t begin = data.size();
    for (int i = 0; i < count; ++i) {
      float v = static_cast<float>(i) + 0.5f;
      data.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
    json += (json.size() > 1 ? "," : "") + std::string("\"") + name +
            "\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(count) + "],\"data_offsets\":[" +
            std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << out << json << data;
}

// Through the accel command line: the parameter count and AdamW's 16 bytes per fp32 parameter,
// then a split into shards and a merge back that gives the same bytes.
TEST(AccelWeights, EstimateMemoryAndASplitMergedBackIsTheSameFile) {
  TempDir dir;
  const std::string model = dir / "model.safetensors";
  write_safetensors(model, {{"a.weight", 1000}, {"b.weight", 3000}, {"b.bias", 10}});
  auto accel = [&](std::vector<std::string> args, const std::string& name) {
    Launched l(dir, ACCEL_BIN, std::move(args), {}, name);
    return l.wait(30s);
  };
  auto est = accel(
      {"estimate-memory", model, "--world-size", "2", "--dtypes", "fp32", "--optimizers", "adamw"},
      "estimate");
  EXPECT_EQ(est.exit_code, 0) << est.err;
  EXPECT_NE(est.out.find("(4010)"), std::string::npos) << est.out;
  EXPECT_NE(est.out.find(" 64160\n"), std::string::npos) << "16 bytes x 4010:\n" << est.out;
  EXPECT_NE(est.out.find(" 48120\n"), std::string::npos) << "ZeRO-1 over 2:\n" << est.out;

  auto split = accel({"merge-weights", model, dir / "split", "--max-shard-size", "8KB"}, "split");
  EXPECT_EQ(split.exit_code, 0) << split.err;
  EXPECT_TRUE(fs::exists(dir / "split/model.safetensors.index.json")) << split.out;
  auto merged = accel({"merge-weights", dir / "split", dir / "merged.safetensors"}, "merge");
  EXPECT_EQ(merged.exit_code, 0) << merged.err;
  EXPECT_EQ(read_file(dir / "merged.safetensors"), read_file(model));
  auto again = accel({"merge-weights", dir / "split", dir / "merged.safetensors"}, "again");
  EXPECT_EQ(again.exit_code, 1) << again.err;

  auto bad = accel({"merge-weights", model, dir / "x", "--max-shard-size", "lots"}, "bad");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--max-shard-size lots: expected a size such as 500MB"), std::string::npos)
      << bad.err;
  std::ofstream(dir / "junk.safetensors") << "not a model";
  auto junk = accel({"estimate-memory", dir / "junk.safetensors"}, "junk");
  EXPECT_EQ(junk.exit_code, 2);
  EXPECT_NE(junk.err.find("junk.safetensors"), std::string::npos) << junk.err;
}

}  // namespace
}  // namespace accel::testing
