// The batch script accel-launch writes for Slurm, and its submission.
#include "launcher/slurm_submit.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "accel_version.h"
#include "agent/common/safe_file.h"
#include "agent/supervisor/line_sink.h"

extern char** environ;  // NOLINT: POSIX

namespace accel::launcher {
namespace fs = std::filesystem;

std::string shell_quote(const std::string& s) {
  bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return std::isalnum(c) || std::strchr("@%+=:,./_-", c) != nullptr;
  });
  if (plain) return s;
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string sbatch_script(const LaunchCommand& cmd, const config::ClusterConfig& cfg,
                          const std::vector<std::string>& program_argv, const SubmitScript& where) {
  std::ostringstream s;
  s << "#!/bin/bash\n"
    << "# Written by accel-launch " << ACCEL_VERSION
    << " --slurm-submit. Submit it again with: sbatch THIS_FILE\n"
    << "# Inside the allocation, each node's accel-launch reads the number of nodes, its rank,\n"
    << "# the first node (the rendezvous) and the job id from Slurm.\n";
  s << "#SBATCH --job-name=" << where.job_name << "\n";
  if (cfg.nodes.min == cfg.nodes.max) {
    s << "#SBATCH --nodes=" << cfg.nodes.max << "\n";
  } else {
    s << "#SBATCH --nodes=" << cfg.nodes.min << "-" << cfg.nodes.max << "\n";
  }
  int threads = std::max(1, cfg.num_cpu_threads_per_process);
  s << "#SBATCH --ntasks-per-node=1\n"
    << "# The launcher's workers share its CPUs.\n"
    << "#SBATCH --cpus-per-task=" << cfg.num_processes * threads << "\n"
    << "# 60 s before the time limit (or on scancel --signal=USR1): save a checkpoint and stop\n"
    << "#SBATCH --signal=USR1@60\n"
    << "#SBATCH --requeue\n"
    << "#SBATCH --open-mode=append\n"
    << "#SBATCH --output=accel-%x-%j.out\n";
  for (const auto& a : cmd.sbatch_args) s << "#SBATCH " << a << "\n";
  s << "\ncd " << shell_quote(where.workdir) << " || exit 1\n";
  if (cfg.token_file.empty()) {
    s << "# The nodes' shared secret, handed to every node by srun.\n"
      << "export ACCEL_TOKEN=${ACCEL_TOKEN:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' "
         "\\n')}\n";
  }
  s << "srun --ntasks-per-node=1 --ntasks=\"$SLURM_NNODES\" --kill-on-bad-exit=1 "
    << shell_quote(where.accel_launch);
  for (const auto& o : cmd.resubmit) s << " " << shell_quote(o);
  s << " --";
  for (const auto& a : program_argv) s << " " << shell_quote(a);
  s << " &\n"
    << "srun_pid=$!\n"
    << "# With --signal=B:USR1@... only this script gets the signal: srun passes it on.\n"
    << "trap 'kill -USR1 \"$srun_pid\" 2>/dev/null' USR1\n"
    << "while :; do\n"
    << "  wait \"$srun_pid\"\n"
    << "  rc=$?\n"
    << "  kill -0 \"$srun_pid\" 2>/dev/null || break\n"
    << "done\n"
    << "if [ \"$rc\" -eq " << kStoppedByUsr1 << " ]; then\n"
    << "  # Stopped on SIGUSR1 after saving a checkpoint: run again from there.\n"
    << "  scontrol requeue \"$SLURM_JOB_ID\" && exit 0\n"
    << "fi\n"
    << "exit \"$rc\"\n";
  return s.str();
}

int slurm_submit(const LaunchCommand& cmd, const config::ClusterConfig& cfg,
                 const std::vector<std::string>& program_argv) {
  std::error_code ec;
  SubmitScript where;
  where.accel_launch = fs::read_symlink("/proc/self/exe", ec).string();
  if (ec || where.accel_launch.empty()) where.accel_launch = "accel-launch";
  where.workdir = fs::current_path(ec).string();
  // The job's name: the script of `python3 -u train.py`, the module of `-m pkg.train`, else the
  // program.
  std::string base = program_argv.empty() ? "job" : fs::path(program_argv.front()).filename();
  const bool python = base.rfind("python", 0) == 0;
  for (std::size_t i = 1; python && i < program_argv.size(); ++i) {
    const std::string& a = program_argv[i];
    if (a.size() > 3 && a.compare(a.size() - 3, 3, ".py") == 0) {
      base = fs::path(a).stem();
      break;
    }
    if (a == "-m" && i + 1 < program_argv.size()) {
      base = program_argv[i + 1];
      break;
    }
  }
  std::string name;
  for (char c : base)
    name += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') ? c : '_';
  if (name.empty()) name = "job";
  where.job_name = name;

  std::string path = cmd.slurm_script.empty() ? "accel-" + name + ".sbatch" : cmd.slurm_script;
  std::string text = sbatch_script(cmd, cfg, program_argv, where);
  {
    std::string tmp;
    int fd = create_temp_beside(path, 0755, tmp);
    bool ok = fd >= 0 && supervisor::write_all(fd, text) && ::fchmod(fd, 0755) == 0 &&
              std::rename(tmp.c_str(), path.c_str()) == 0;
    const int saved = errno;
    if (fd >= 0) ::close(fd);
    if (!ok) {
      std::cerr << "accel-launch: cannot write the batch script " << path << ": "
                << std::strerror(saved) << "\n";
      // Why only when made: a name create_temp_beside could not take is someone else's file.
      if (fd >= 0) ::unlink(tmp.c_str());
      return 1;
    }
  }
  if (!cmd.slurm_submit) {
    std::cerr << "accel-launch: wrote " << path << " (submit it with: sbatch " << path << ")\n";
    return 0;
  }
  std::cerr << "accel-launch: wrote " << path << "; submitting it with sbatch\n";
  std::vector<std::string> argv = {"sbatch", path};
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, "sbatch", nullptr, nullptr, cargv.data(), environ);
  if (rc != 0) {
    std::cerr << "accel-launch: cannot run sbatch (" << std::strerror(rc)
              << "): is this a Slurm login node? The script is " << path << "\n";
    return 127;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace accel::launcher
