// Program and interpreter resolution for accel-launch.
#include "launcher/program.h"

#include <sys/stat.h>
#include <unistd.h>

namespace accel::launcher {
namespace {

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string get(const Env& env, const char* key) {
  auto it = env.find(key);
  return it == env.end() ? std::string() : it->second;
}

}  // namespace

Result<std::string> find_executable(const std::string& name, const Env& env) {
  if (name.empty()) return Status::error("empty program name");
  if (name.find('/') != std::string::npos) {
    struct stat st {};
    if (::stat(name.c_str(), &st) != 0) return Status::error(name + ": no such file");
    if (!S_ISREG(st.st_mode)) return Status::error(name + ": not a regular file");
    if (::access(name.c_str(), X_OK) != 0) {
      return Status::error(name +
                           ": not executable (chmod +x it, or run it through its "
                           "interpreter)");
    }
    return name;
  }
  std::string path = get(env, "PATH");
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(begin, end - begin);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (is_executable_file(candidate)) return candidate;
    begin = end + 1;
  }
  return Status::error("'" + name + "' not found on PATH (" + path + ")");
}

Result<std::vector<std::string>> resolve_command(const ProgramSpec& spec, const Env& env) {
  auto python = [&]() -> Result<std::string> {
    std::string exec = get(env, "PYTHON_EXEC");
    auto found = find_executable(exec.empty() ? "python3" : exec, env);
    if (!found) {
      return Status::error("cannot find the Python interpreter" +
                           std::string(exec.empty() ? "" : " ($PYTHON_EXEC)") + ": " +
                           found.message());
    }
    return found;
  };

  std::vector<std::string> argv;
  if (spec.module) {
    if (spec.no_python) return Status::error("--module and --no-python cannot be used together");
    if (spec.module->empty()) return Status::error("-m/--module needs a module name");
    auto py = python();
    if (!py) return py.status();
    argv = {*py, "-u", "-m", *spec.module};
  } else {
    if (spec.program.empty()) return Status::error("no PROGRAM given (see --help)");
    if (!spec.no_python && ends_with(spec.program, ".py")) {
      struct stat st {};
      if (::stat(spec.program.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return Status::error(spec.program + ": Python script not found");
      }
      auto py = python();
      if (!py) return py.status();
      argv = {*py, "-u", spec.program};
    } else {
      auto exe = find_executable(spec.program, env);
      if (!exe) return exe.status();
      argv = {*exe};
    }
  }
  argv.insert(argv.end(), spec.args.begin(), spec.args.end());
  return argv;
}

}  // namespace accel::launcher
