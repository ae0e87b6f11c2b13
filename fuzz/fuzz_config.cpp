// Fuzz target: the YAML config loader (a config file is user input: accel's or HF Accelerate's)
// and the cross-key checks.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "agent/config/config_loader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  accel::config::ClusterConfig cfg;
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> warnings;  // an HF Accelerate file's ignored keys
  if (accel::config::load_yaml_text(cfg, text, "fuzz.yaml", &warnings).is_ok())
    (void)accel::config::validate(cfg);
  return 0;
}
