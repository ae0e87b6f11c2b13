// The `accel config` wizard: questions over the key table.
#include "launcher/config_wizard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <istream>
#include <ostream>

#include "agent/common/hardware.h"
#include "agent/config/hf_config.h"
#include "launcher/config_cmd.h"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;

// Thrown to end the wizard without writing anything.
struct Stop {
  int code;
  std::string message;
};

// What the machine running the wizard has, for defaults and checks.
struct Machine {
  int cpus = hardware::usable_cpus();
  int gpus = hardware::visible_gpus();
};

class Asker {
 public:
  Asker(std::istream& in, std::ostream& out, bool interactive)
      : in_(in), out_(out), interactive_(interactive) {}

  // One line of input; an empty line is `def`. On a terminal the answer is echoed by the
  // terminal; from a pipe it is echoed here, so a transcript reads the same.
  // `label` names the question in messages (the prompt of a numbered list is only "Choice").
  std::string line(const std::string& question, const std::string& def,
                   const std::string& label = {}) {
    const std::string& name = label.empty() ? question : label;
    out_ << question << (def.empty() ? "" : " [" + def + "]") << ": " << std::flush;
    std::string answer;
    if (!std::getline(in_, answer)) {
      out_ << "\n";
      if (interactive_) throw Stop{1, "input ended; nothing was written"};
      throw Stop{2, "input ended before the question '" + name +
                        "' was answered; nothing was written. Without a terminal, accel config "
                        "reads one answer per line (an empty line takes the default); `accel "
                        "config default` writes a file without questions"};
    }
    if (!interactive_) out_ << answer << "\n";
    while (!answer.empty() && (answer.back() == '\r' || answer.back() == ' ')) answer.pop_back();
    answer.erase(0, answer.find_first_not_of(" \t"));
    return answer.empty() ? def : answer;
  }

  // Asks until `check` accepts the answer (returns an empty string); without a terminal the
  // first rejected answer ends the wizard.
  std::string until_valid(const std::string& question, const std::string& def,
                          const std::function<std::string(const std::string&)>& check,
                          const std::string& label = {}) {
    for (;;) {
      std::string answer = line(question, def, label);
      std::string problem = check(answer);
      if (problem.empty()) return answer;
      if (!interactive_) {
        throw Stop{2, "answer '" + answer + "' to '" + (label.empty() ? question : label) +
                          "': " + problem + "; nothing was written"};
      }
      out_ << "  " << problem << "; try again.\n";
    }
  }

  bool yes_no(const std::string& question, bool def) {
    std::string answer;
    until_valid(question + (def ? " [Y/n]" : " [y/N]"), "", [&](const std::string& a) {
      answer = a.empty() ? (def ? "y" : "n") : a;
      for (auto& c : answer) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return answer == "y" || answer == "yes" || answer == "n" || answer == "no" ? std::string()
                                                                                 : "answer y or n";
    });
    return answer[0] == 'y';
  }

  // A numbered list; returns the index chosen.
  size_t choose(const std::string& question, const std::vector<std::string>& options, size_t def) {
    out_ << question << "\n";
    for (size_t i = 0; i < options.size(); ++i) out_ << "  " << i + 1 << ") " << options[i] << "\n";
    size_t chosen = def;
    until_valid(
        "Choice", std::to_string(def + 1),
        [&](const std::string& a) {
          if (a.size() == 1 && a[0] >= '1' && a[0] < static_cast<char>('1' + options.size())) {
            chosen = static_cast<size_t>(a[0] - '1');
            return std::string();
          }
          return "answer a number from 1 to " + std::to_string(options.size());
        },
        question);
    return chosen;
  }

  std::ostream& out() { return out_; }

 private:
  std::istream& in_;
  std::ostream& out_;
  bool interactive_;
};

// Asks for `key`'s value, checked by the key's own parser, then by `extra` (which sees the
// config with the new value in it); the default is the key's current value.
void ask_key(Asker& ask, config::ClusterConfig& cfg, std::string_view key,
             const std::string& question,
             const std::function<std::string(const config::ClusterConfig&)>& extra = {}) {
  const config::KeySpec* spec = config::find_key(key);
  ask.until_valid(question, spec->get(cfg), [&](const std::string& answer) {
    config::ClusterConfig trial = cfg;
    if (Status s = spec->set(trial, answer); !s) return s.message();
    if (extra) {
      if (std::string problem = extra(trial); !problem.empty()) return problem;
    }
    trial.origins[std::string(key)] = {config::Source::kFile, "accel config"};
    cfg = std::move(trial);
    return std::string();
  });
}

void set(config::ClusterConfig& cfg, std::string_view key, const std::string& value) {
  (void)config::find_key(key)->set(cfg, value);
  cfg.origins[std::string(key)] = {config::Source::kFile, "accel config"};
}

std::string machine_text(const Machine& m) {
  std::string gpus = m.gpus == 0   ? "no GPU"
                     : m.gpus == 1 ? "1 GPU"
                                   : std::to_string(m.gpus) + " GPUs";
  return std::to_string(m.cpus) + " usable CPU core" + (m.cpus == 1 ? "" : "s") + ", " + gpus;
}

void ask_multi_node(Asker& ask, config::ClusterConfig& cfg, bool& make_token) {
  bool standing = !cfg.coordinator.empty();
  size_t how = ask.choose("How do the machines meet?",
                          {"every machine runs accel-launch; machine rank 0 hosts the coordinator",
                           "standing accel-agent daemons and a coordinator; accel-launch "
                           "--coordinator submits the job",
                           "a Slurm allocation: srun starts one accel-launch per node"},
                          standing ? 1 : 0);
  if (how == 2) {
    // Why ask nothing more: inside the allocation Slurm says how many nodes, which one this is
    // and where the first one is; the batch script makes the token.
    set(cfg, "coordinator", "");
    for (const char* k : {"nodes", "machine_rank", "main_process_ip"}) {
      cfg.origins.erase(k);
    }
    cfg.nodes = {};
    cfg.machine_rank = 0;
    cfg.main_process_ip = config::ClusterConfig{}.main_process_ip;
    ask.out() << "  note: inside the allocation accel-launch reads the nodes, this node's rank and "
                 "the first node from Slurm; start it with\n"
                 "        srun --ntasks-per-node=1 accel-launch ... (configs/slurm/train.sbatch, "
                 "or accel-launch --slurm-submit)\n";
    make_token = false;
    return;
  }
  ask_key(ask, cfg, "nodes", "How many machines? (N, or MIN:MAX for an elastic job)",
          [](const config::ClusterConfig& c) {
            return c.nodes.max < 2 ? std::string("a multi-machine job has at least 2 machines")
                                   : std::string();
          });
  if (how == 0) {
    set(cfg, "coordinator", "");
    ask_key(ask, cfg, "main_process_ip",
            "Address of machine rank 0, reachable from every machine (main_process_ip)",
            [](const config::ClusterConfig& c) {
              return c.main_process_ip.empty() ? std::string("give a host name or address")
                                               : std::string();
            });
    if (cfg.main_process_ip == "127.0.0.1" || cfg.main_process_ip == "localhost") {
      ask.out() << "  note: " << cfg.main_process_ip
                << " reaches only this machine; other machines cannot join through it.\n";
    }
    ask_key(ask, cfg, "coordinator_port", "Coordinator port on machine rank 0");
    ask_key(ask, cfg, "machine_rank",
            "This machine's rank, 0 to " + std::to_string(cfg.nodes.max - 1) +
                " (0 hosts the coordinator)",
            [](const config::ClusterConfig& c) {
              Status s = config::validate(c);
              return s ? std::string() : s.message().substr(s.message().find(": ") + 2);
            });
  } else {
    set(cfg, "machine_rank", "0");
    ask_key(ask, cfg, "coordinator", "Coordinator address (HOST:PORT)",
            [](const config::ClusterConfig& c) {
              return c.coordinator.empty() ? std::string("give HOST:PORT, such as 10.0.0.1:29400")
                                           : std::string();
            });
  }
  ask_key(ask, cfg, "token_file",
          "Token file, the shared secret every machine reads (empty: $ACCEL_TOKEN instead)");
  make_token = false;
  std::error_code ec;
  if (!cfg.token_file.empty() && !fs::exists(cfg.token_file, ec)) {
    make_token = ask.yes_no(cfg.token_file +
                                " does not exist. Generate a random token there "
                                "(readable by you only) when the config is written?",
                            true);
  }
  bool tls = !cfg.tls_cert.empty() || !cfg.tls_ca.empty();
  if (ask.yes_no("Use your own TLS certificates (no: one derived from the token)?", tls)) {
    auto file_note = [&](const std::string& path) {
      if (!path.empty() && !fs::exists(path, ec)) {
        ask.out() << "  note: " << path
                  << " is not on this machine; it must be where accel runs.\n";
      }
    };
    ask_key(ask, cfg, "tls_cert", "TLS certificate (PEM) of this machine");
    file_note(cfg.tls_cert);
    ask_key(ask, cfg, "tls_key", "Its private key (PEM)", [](const config::ClusterConfig& c) {
      return c.tls_cert.empty() == c.tls_key.empty()
                 ? std::string()
                 : std::string("TLS needs both a certificate and its key");
    });
    file_note(cfg.tls_key);
    ask_key(ask, cfg, "tls_ca", "CA certificate (PEM) that signed the peers' certificates");
    file_note(cfg.tls_ca);
  } else {
    for (const char* k : {"tls_cert", "tls_key", "tls_ca"}) set(cfg, k, "");
  }
}

// A random token in a new file only its owner can read; never replaces a file.
std::string write_token(const std::string& path) {
  std::error_code ec;
  fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  unsigned char bytes[24];
  int rnd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  bool ok = rnd >= 0 && ::read(rnd, bytes, sizeof bytes) == static_cast<ssize_t>(sizeof bytes);
  if (rnd >= 0) ::close(rnd);
  if (!ok) return "cannot read /dev/urandom";
  std::string token;
  static constexpr char kHex[] = "0123456789abcdef";
  for (unsigned char b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  token += "\n";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return std::string("cannot create it: ") + std::strerror(errno);
  bool written = ::write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size()) &&
                 ::fsync(fd) == 0;
  ::close(fd);
  return written ? std::string() : "cannot write it";
}

}  // namespace

int config_wizard(const config::EnvMap& env, const WizardOptions& options, std::istream& in,
                  std::ostream& out) {
  std::string path = options.path ? *options.path : config::default_config_path(env);
  if (path.empty()) {
    out.flush();
    std::fprintf(stderr,
                 "accel config: error: no default location (HOME is not set): give "
                 "--config-file PATH\n");
    return 2;
  }
  Asker ask(in, out, options.interactive);
  Machine machine;
  config::ClusterConfig cfg;
  std::vector<std::string> warnings;
  std::error_code ec;
  bool exists = fs::exists(path, ec);
  out << "accel config: a few questions; Enter takes the value in brackets. Nothing is written "
         "until the end.\n";
  if (exists) {
    if (Status s = config::load_yaml_file(cfg, path, &warnings); !s) {
      out << "note: " << s.message() << "\n  (starting from the defaults instead)\n";
      cfg = {};
    } else {
      out << "Editing " << path << ": its values are the defaults.\n";
    }
  } else if (std::string hf = config::hf_default_config_path(env);
             !options.path && !hf.empty() && fs::is_regular_file(hf, ec)) {
    if (config::load_yaml_file(cfg, hf, &warnings)) {
      out << "Starting from HF Accelerate's config " << hf << ": its values are the defaults.\n";
    } else {
      cfg = {};
    }
  }
  out << "This machine: " << machine_text(machine) << ".\n\n";

  bool make_token = false;
  try {
    bool several = cfg.nodes.max > 1 || !cfg.coordinator.empty();
    size_t where = ask.choose("Where will the job run?", {"this machine only", "several machines"},
                              several ? 1 : 0);
    if (where == 1) {
      ask_multi_node(ask, cfg, make_token);
    } else {
      set(cfg, "nodes", "1");
      set(cfg, "machine_rank", "0");
      set(cfg, "coordinator", "");
    }
    if (machine.gpus > 0) {
      ask_key(ask, cfg, "use_cpu", "Train on the CPU only, even with GPUs? (yes/no)");
    }
    bool on_gpus = machine.gpus > 0 && !cfg.use_cpu;
    if (cfg.origins.count("num_processes") == 0) {
      cfg.num_processes = on_gpus ? machine.gpus : machine.cpus;
    }
    ask_key(ask, cfg, "num_processes",
            std::string("Worker processes per machine (a number, or auto: one per ") +
                (on_gpus ? "GPU)" : "GPU, else one per CPU core)"));
    ask_key(ask, cfg, "mixed_precision", "Mixed precision (no, bf16, fp16)",
            [&](const config::ClusterConfig& c) {
              return c.mixed_precision == config::MixedPrecision::kFp16 && !on_gpus
                         ? std::string("fp16 needs CUDA GPUs; on CPUs choose bf16 or no")
                         : std::string();
            });
    ask_key(ask, cfg, "checkpoint_dir",
            "Checkpoint folder, on storage every machine shares (empty: no automatic "
            "checkpoints)");
    if (cfg.checkpoint_dir.empty()) {
      set(cfg, "checkpoint_interval", "0");
    } else {
      ask_key(ask, cfg, "checkpoint_interval",
              "Save a checkpoint every how many optimizer steps? (0: only when the program calls "
              "save_state)");
    }
    ask_key(ask, cfg, "max_restarts", "Restarts of the whole group after a failure");
    ask_key(ask, cfg, "hang_timeout",
            "Hang timeout: a collective in flight this long is a hang and restarts the group "
            "(0: off)");
    ask_key(ask, cfg, "collective_timeout",
            "Collective timeout: the longest any one collective may take");
    if (Status s = config::validate(cfg); !s) throw Stop{2, s.message()};

    std::string yaml = minimal_yaml(
        cfg,
        "# accel configuration, written by `accel config` (docs/configuration.md); a key "
        "not here has its default\n");
    out << "\n" << yaml << "\n";
    bool write = exists ? ask.yes_no("Replace " + path + " with this?", false)
                        : ask.yes_no("Write it to " + path + "?", true);
    if (!write) {
      out << "Nothing was written.\n";
      return 0;
    }
    if (make_token) {
      if (std::string problem = write_token(cfg.token_file); !problem.empty()) {
        throw Stop{1, "token file " + cfg.token_file + ": " + problem + "; nothing was written"};
      }
      out << "wrote " << cfg.token_file << " (a new random token, mode 0600): copy it to every "
          << "machine\n";
    }
    out.flush();
    if (int rc = write_config(path, yaml, /*force=*/true); rc != 0) return rc;
    std::string launch = options.path ? "accel-launch --config " + path : "accel-launch";
    out << "Next: " << launch << " ./train runs with it; " << launch
        << " --print-config shows each value and where it came from.\n";
    if (cfg.nodes.max > 1 && cfg.coordinator.empty()) {
      std::string others = cfg.nodes.max == 2 ? std::string("--machine-rank 1")
                                              : "--machine-rank K (K from 1 to " +
                                                    std::to_string(cfg.nodes.max - 1) + ")";
      out << "On the other machine" << (cfg.nodes.max == 2 ? "" : "s") << ": the same file with "
          << others << ", or accel config there.\n";
    }
    return 0;
  } catch (const Stop& stop) {
    out.flush();
    std::fprintf(stderr, "accel config: %s\n", stop.message.c_str());
    return stop.code;
  }
}

}  // namespace accel::launcher
