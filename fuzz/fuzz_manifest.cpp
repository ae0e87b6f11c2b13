// Fuzz target: the checkpoint manifest reader (a checkpoint folder may be damaged or foreign).
// Any bytes must give a CheckedManifest whose file names are plain, or a CheckpointError.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "accel/error.h"
#include "runtime/checkpoint_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto checked = accel::ckpt::parse_manifest(
        std::string_view(reinterpret_cast<const char*>(data), size), "/ckpt/manifest.json");
    for (const auto& [name, entry] : checked.files) {
      if (!accel::ckpt::is_plain_file_name(name)) __builtin_trap();
    }
  } catch (const accel::CheckpointError&) {
  }
  return 0;
}
