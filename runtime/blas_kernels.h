// Which kernels OpenBLAS runs, and switching them when it picked kernels older than the CPU.
// OpenBLAS built for many CPUs (DYNAMIC_ARCH, as Debian builds it) chooses its kernels when it
// loads, from the CPU's model number; a model it does not know (a CPU newer than that OpenBLAS)
// gets its generic "Prescott" kernels, which use SSE3 only. Debian 12's OpenBLAS 0.3.21 does
// that on 5th-generation Xeons (model 207), where an fp32 matmul then runs about 4x slower than
// with the AVX-512 kernels the CPU has. libaccel notices at start and switches OpenBLAS to the
// kernels the CPU's flags allow, as newer OpenBLAS releases do on CPUs they do not know.
// Why from the flags alone and not from a timed matmul: the kernels decide the last bits of every
// product, and a timing taken while other processes load the machine could pick other kernels in
// a restarted run than in the first one, so that a resumed job would no longer match, bit for
// bit, the run that was not interrupted.
#pragma once

#include <string>
#include <vector>

namespace accel::blas_kernels {

// The instruction set a kernel set of OpenBLAS (a name openblas_get_corename() returns) needs:
// 3 AVX-512, 2 AVX2 and FMA, 1 AVX, 0 older or unknown.
int tier_of_core(const std::string& core);

// The best kernel set of OpenBLAS for a CPU with these /proc/cpuinfo flags: "Cooperlake"
// (AVX-512 with BF16), "SkylakeX" (AVX-512 F, CD, BW, DQ, VL), "Haswell" (AVX2 and FMA), else
// "" (nothing above what every x86-64 kernel set uses).
std::string best_core_for(const std::vector<std::string>& cpu_flags);

// The flags of this machine's first CPU in /proc/cpuinfo; empty where there is none (not x86).
std::vector<std::string> cpu_flags();

// This process's OpenBLAS kernel set ("Prescott", "SkylakeX", ...), or "" when the process has
// no OpenBLAS that says (another BLAS, or an OpenBLAS built for one CPU only).
std::string current_core();

struct Outcome {
  std::string from;   // the kernels OpenBLAS ran before; "" when there is no OpenBLAS
  std::string to;     // the kernels it runs now, when switched; "" when nothing changed
  std::string tried;  // what was tried, also when OpenBLAS could not run it
  [[nodiscard]] bool switched() const { return !to.empty(); }
};

// Switches OpenBLAS to `core` and sets OPENBLAS_CORETYPE to it, so that programs this process
// starts inherit the kernels; where OpenBLAS cannot run them, leaves its kernels and the variable
// as they were. Call it while no other thread runs BLAS.
Outcome switch_to(const std::string& core);

// Whether this process's OpenBLAS can switch kernels at all (a DYNAMIC_ARCH build, as Debian's).
bool can_switch_kernels();

// Switches OpenBLAS to `core` (and sets OPENBLAS_CORETYPE to it); whether OpenBLAS now runs it.
// switch_to() and tests use it.
bool set_kernels(const std::string& core);

// What upgrade_if_behind() tries: nothing ("") when the user chose the kernels (`user_choice`,
// OPENBLAS_CORETYPE's value, not null), when there is no OpenBLAS (`now` ""), or when `now` needs
// as new an instruction set as the best kernels for `cpu_flags`; else those best kernels.
std::string upgrade_target(const char* user_choice, const std::string& now,
                           const std::vector<std::string>& cpu_flags);

// At start: when OpenBLAS runs kernels for an older instruction set than this CPU has, and the
// user did not choose them (OPENBLAS_CORETYPE unset), switch_to() the best the CPU allows. Once
// per process; later calls return the first call's outcome.
const Outcome& upgrade_if_behind();

// The line libaccel logs about an outcome that tried something, naming the CPU; "" otherwise.
std::string describe(const Outcome& outcome, const std::string& cpu);

}  // namespace accel::blas_kernels
