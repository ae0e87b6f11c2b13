// Fuzz target: `accel estimate-memory` / `merge-weights`' safetensors header reader (the files
// may be damaged or foreign). A bad file must be an error Result naming it, never a crash, a
// hang or an exception; a header it accepts must give a memory estimate without overflow traps.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "launcher/weights_cmd.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Why a memfd: the reader takes a path, and /proc/self/fd/N is one without touching a disk.
  static const int fd = ::memfd_create("fuzz.safetensors", 0);
  if (fd < 0) return 0;
  if (::ftruncate(fd, 0) != 0) return 0;
  if (size > 0 && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  auto header = accel::launcher::read_safetensors_header("/proc/self/fd/" + std::to_string(fd));
  if (header.is_ok()) {
    accel::launcher::EstimateMemoryOptions options;
    options.world_size = 3;
    options.dtypes = {"fp32", "bf16", "fp16"};
    (void)accel::launcher::estimate(header->tensors, options);
  }
  return 0;
}
