// accel config's subcommands.
#include "launcher/config_cmd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "agent/common/safe_file.h"
#include "agent/supervisor/line_sink.h"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;

int fail(const std::string& message, int code = 2) {
  supervisor::write_all(STDERR_FILENO, "accel config: error: " + message + "\n");
  return code;
}

}  // namespace

int write_config(const std::string& path, const std::string& text, bool force) {
  std::error_code ec;
  if (!force && fs::exists(path, ec)) {
    return fail(path + " exists; it was left as it is (--force replaces it)", 1);
  }
  fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  if (ec) return fail("cannot create " + target.parent_path().string() + ": " + ec.message(), 1);
  std::string tmp;
  int fd = create_temp_beside(path, 0644, tmp);
  if (fd < 0) return fail("cannot write " + tmp + ": " + std::strerror(errno), 1);
  bool ok = supervisor::write_all(fd, text) && ::fsync(fd) == 0;
  int saved = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) saved = errno;
    ::unlink(tmp.c_str());
    return fail("cannot write " + path + ": " + std::strerror(saved), 1);
  }
  std::cout << "wrote " << path << "\n";
  return 0;
}

namespace {

std::string target_path(const config::EnvMap& env, const std::optional<std::string>& path) {
  return path ? *path : config::default_config_path(env);
}

}  // namespace

std::string minimal_yaml(const config::ClusterConfig& cfg, const std::string& header) {
  std::string out = header;
  for (const auto& key : config::all_keys()) {
    std::string value = key.get(cfg);
    if (value == config::default_text(key)) continue;
    out += std::string(key.name) + ": " + config::yaml_scalar(value) + "\n";
  }
  return out;
}

int config_show(const config::ConfigSources& sources) {
  auto resolved = config::resolve_config(sources);
  if (!resolved) return fail(resolved.message());
  std::cout << config::render_config(*resolved) << std::flush;
  return 0;
}

int config_validate(const std::string& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return fail(file + ": no such file");
  config::ClusterConfig cfg;
  std::vector<std::string> warnings;
  if (Status s = config::load_yaml_file(cfg, file, &warnings); !s) return fail(s.message());
  if (Status s = config::validate(cfg); !s) return fail(s.message());
  for (const auto& w : warnings) std::cerr << "warning: " << w << "\n";
  std::cout << file << ": valid (" << cfg.origins.size() << " key"
            << (cfg.origins.size() == 1 ? "" : "s") << " set, " << warnings.size() << " ignored)\n";
  return 0;
}

int config_default(const std::vector<config::FlagValue>& flags, const config::EnvMap& env,
                   const std::optional<std::string>& path, bool force) {
  config::ClusterConfig cfg;
  for (const auto& f : flags) {
    if (Status s =
            config::set_value(cfg, f.key, f.value, {config::Source::kFlag, "flag " + f.flag});
        !s) {
      return fail(s.message());
    }
  }
  if (Status s = config::validate(cfg); !s) return fail(s.message());
  std::string out = target_path(env, path);
  if (out.empty()) return fail("no default location (HOME is not set): give --config-file PATH");
  return write_config(out,
                      minimal_yaml(cfg,
                                   "# accel configuration (docs/configuration.md); a key not "
                                   "here has its default (accel-launch --print-config)\n"),
                      force);
}

int config_import(const std::string& hf_file, const config::EnvMap& env,
                  const std::optional<std::string>& path, bool force) {
  std::error_code ec;
  if (!fs::is_regular_file(hf_file, ec)) return fail(hf_file + ": no such file");
  config::ClusterConfig cfg;
  std::vector<std::string> warnings;
  if (Status s = config::load_yaml_file(cfg, hf_file, &warnings); !s) return fail(s.message());
  if (Status s = config::validate(cfg); !s) return fail(s.message());
  std::string header = "# accel configuration imported from " + hf_file + "\n";
  for (const auto& w : warnings) {
    header += "# ignored: " + w + "\n";
    std::cerr << "warning: " << w << "\n";
  }
  std::string out = target_path(env, path);
  if (out.empty()) return fail("no default location (HOME is not set): give --config-file PATH");
  return write_config(out, minimal_yaml(cfg, header), force);
}

}  // namespace accel::launcher
