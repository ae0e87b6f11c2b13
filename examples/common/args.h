// A small flag parser for the example programs (--name VALUE, --name=VALUE, --help) and their
// main's error handling.
#pragma once

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "accel/error.h"

namespace accel::examples {

class Args {
 public:
  Args(std::string program, std::string about)
      : program_(std::move(program)), about_(std::move(about)) {}

  // Declares a flag with its default (as text) and help.
  Args& flag(const std::string& name, const std::string& fallback, const std::string& help) {
    order_.push_back(name);
    values_[name] = fallback;
    defaults_[name] = fallback;
    help_[name] = help;
    return *this;
  }

  // Parses argv; prints help and exits 0 for --help, prints an error and exits 2 otherwise.
  void parse(int argc, char** argv) {
    // Why: the help's launch line should be one a reader can paste ("./build/bin/train_mlp").
    if (argc > 0 && std::string(argv[0]).find('/') != std::string::npos) invoked_ = argv[0];
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        usage(std::cout);
        std::exit(0);
      }
      if (arg.rfind("--", 0) != 0) fail("unexpected argument '" + arg + "'");
      std::string name = arg.substr(2), value;
      auto eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else {
        if (i + 1 >= argc) fail("--" + name + " needs a value");
        value = argv[++i];
      }
      for (auto& c : name)
        if (c == '_') c = '-';
      if (!values_.count(name)) fail("unknown flag --" + name);
      values_[name] = value;
    }
    // A flag whose default is a number takes only numbers: say so now, before any work starts.
    for (const auto& name : order_) {
      if (is_integer(defaults_.at(name)))
        (void)integer(name);
      else if (is_real(defaults_.at(name)))
        (void)real(name);
    }
  }

  std::string str(const std::string& name) const { return values_.at(name); }
  long integer(const std::string& name) const {
    char* end = nullptr;
    long v = std::strtol(values_.at(name).c_str(), &end, 10);
    if (*end != '\0' || values_.at(name).empty())
      fail("--" + name + " expects an integer, got '" + values_.at(name) + "'");
    return v;
  }
  double real(const std::string& name) const {
    char* end = nullptr;
    double v = std::strtod(values_.at(name).c_str(), &end);
    if (*end != '\0' || values_.at(name).empty())
      fail("--" + name + " expects a number, got '" + values_.at(name) + "'");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    std::cerr << program_ << ": " << message << " (see --help)\n";
    std::exit(2);
  }
  void usage(std::ostream& out) const {
    out << "usage: " << program_ << " [flags]\n\n" << about_ << "\n\nflags:\n";
    for (const auto& name : order_) {
      out << "  --" << name << " (default " << values_.at(name) << ")\n      " << help_.at(name)
          << "\n";
    }
    out << "\nRun it on N processes with: accel-launch -n N "
        << (invoked_.empty() ? program_ : invoked_) << " [flags]\n";
  }

  std::string program_, about_, invoked_;
  std::vector<std::string> order_;
  static bool is_integer(const std::string& v) {
    char* end = nullptr;
    std::strtol(v.c_str(), &end, 10);
    return !v.empty() && *end == '\0';
  }
  static bool is_real(const std::string& v) {
    char* end = nullptr;
    std::strtod(v.c_str(), &end);
    return !v.empty() && *end == '\0';
  }

  std::map<std::string, std::string> values_, help_, defaults_;
};

// Runs an example's `run_training(argc, argv)`: an accel::Error (no intact checkpoint to resume
// from, a bad configuration) is printed and the process exits 1, instead of ending in
// std::terminate and SIGABRT with the same message buried in a crash report.
inline int run_example(int (*train)(int, char**), int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const accel::Error& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

}  // namespace accel::examples
