// Fuzz target: the safetensors reader (a checkpoint's files may be damaged or foreign). A bad file
// must be a CheckpointError naming it, never a crash, a hang or another exception.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "accel/error.h"
#include "runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    auto decoded =
        accel::safetensors::decode(bytes, "fuzz.safetensors", accel::safetensors::Memory::kBorrow);
    for (const auto& [name, tensor] : decoded.tensors) (void)tensor.sum();  // touch every byte
  } catch (const accel::Error&) {
  }
  return 0;
}
