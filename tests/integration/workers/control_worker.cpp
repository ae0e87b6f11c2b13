// A worker for control-plane tests (no libtorch, starts in a millisecond). It records who it
// is in <dir>/w_<pid> ("rank world restart group_rank"), then behaves as told:
//   control_worker DIR [--fail-rank R] [--fail-restart C] [--exit-code N]
//                      [--until-file F] [--run-ms T] [--print-lines N --line-bytes B]
// A rank R at restart count C (default: any) exits with code N (default 3) after 50 ms; the
// others wait until file F exists (bounded 120 s) or T ms pass, then exit 0. With --print-lines,
// each rank first prints N lines "line <rank> <i> " padded with 'x' to B bytes (default 20).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  if (argc < 2) {
    std::fprintf(stderr, "usage: control_worker DIR [options]\n");
    return 2;
  }
  std::string dir = argv[1];
  int fail_rank = -1, fail_restart = -1, exit_code = 3, run_ms = -1, print_lines = 0,
      line_bytes = 20;
  std::string until_file;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    std::string v = argv[i + 1];
    if (k == "--fail-rank")
      fail_rank = std::atoi(v.c_str());
    else if (k == "--fail-restart")
      fail_restart = std::atoi(v.c_str());
    else if (k == "--exit-code")
      exit_code = std::atoi(v.c_str());
    else if (k == "--until-file")
      until_file = v;
    else if (k == "--run-ms")
      run_ms = std::atoi(v.c_str());
    else if (k == "--print-lines")
      print_lines = std::atoi(v.c_str());
    else if (k == "--line-bytes")
      line_bytes = std::atoi(v.c_str());
  }
  int rank = env_int("RANK");
  int world = env_int("WORLD_SIZE");
  int restart = env_int("TORCHELASTIC_RESTART_COUNT");
  {
    std::string name = dir + "/w_" + std::to_string(::getpid());
    {
      std::ofstream out(name + ".tmp");
      out << rank << " " << world << " " << restart << " " << env_int("GROUP_RANK") << "\n";
    }
    std::filesystem::rename(name + ".tmp", name);  // readers never see half a line
  }
  std::printf("control_worker rank %d of %d restart %d pid %d\n", rank, world, restart, ::getpid());
  std::fflush(stdout);
  for (int i = 0; i < print_lines; ++i) {
    std::string line = "line " + std::to_string(rank) + " " + std::to_string(i) + " ";
    if (static_cast<int>(line.size()) < line_bytes)
      line.append(static_cast<size_t>(line_bytes) - line.size(), 'x');
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
  }
  std::fflush(stdout);
  if (rank == fail_rank && (fail_restart < 0 || restart == fail_restart)) {
    std::this_thread::sleep_for(50ms);
    std::fprintf(stderr, "control_worker rank %d failing with exit code %d\n", rank, exit_code);
    return exit_code;
  }
  auto deadline =
      std::chrono::steady_clock::now() + (run_ms >= 0 ? std::chrono::milliseconds(run_ms) : 120s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!until_file.empty() && std::filesystem::exists(until_file)) break;
    std::this_thread::sleep_for(20ms);
  }
  return 0;
}
