// Known failure signatures and what to do about them.
#include "agent/common/exit_hints.h"

namespace accel {

std::optional<std::string> exit_hint(const std::vector<std::string>& stderr_tail,
                                     const std::string& program) {
  for (const auto& line : stderr_tail) {
    // A script started with the first python3 on PATH, which is not the environment with torch
    // (a virtualenv or conda that the shell did not activate for accel-launch).
    if (line.find("No module named 'torch'") != std::string::npos) {
      const std::string which =
          program.empty() ? std::string("the worker's Python") : "the worker's Python, " + program;
      return "hint: " + which +
             ", has no torch. accel-launch runs a .py script with $PYTHON_EXEC, else the first "
             "python3 on PATH;\n"
             "      PYTHON_EXEC=/path/to/python accel-launch ... chooses one that has it (check: "
             "/path/to/python -c 'import torch')";
    }
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
