// Known failure signatures and what to do about them.
#include "agent/common/exit_hints.h"

namespace accel {

std::optional<std::string> exit_hint(const std::vector<std::string>& stderr_tail) {
  for (const auto& line : stderr_tail) {
    // PyTorch (1.13 and, as of 2026, current): a Gloo worker thread that still holds the last
    // reference to a tensor of a finished collective frees it after the interpreter began to
    // shut down; taking the GIL then ends the thread inside a noexcept destructor, and
    // std::terminate aborts the process. Timing-dependent: rarer with nothing reading the
    // workers' output, and gone when the process group is destroyed before the program ends.
    if (line.find("terminate called without an active exception") != std::string::npos) {
      return "hint: if this rank had finished its work, this is PyTorch's known abort at "
             "interpreter exit "
             "when a Gloo process group is still alive;\n"
             "      call torch.distributed.destroy_process_group() (HF Accelerate: "
             "accelerator.end_training()) "
             "before the program ends";
    }
  }
  return std::nullopt;
}

}  // namespace accel
