// bench_crash_worker: a worker for measuring crash-to-respawn time under any launcher.
// Attempt 0 (TORCHELASTIC_RESTART_COUNT=0): rank 0 records the time and exits 1 at once; the
// other ranks wait to be stopped. Later attempts: every rank records its start time and exits 0.
// Times are CLOCK_REALTIME nanoseconds written to $BENCH_OUT/{crash,start_<rank>}.
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

long long now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1'000'000'000LL + ts.tv_nsec;
}

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

void record(const std::string& path, long long t) {
  if (std::FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "%lld\n", t);
    std::fclose(f);
  }
}

}  // namespace

int main() {
  const long long started = now_ns();
  const std::string out = env_or("BENCH_OUT", "/tmp");
  const int restart = std::atoi(env_or("TORCHELASTIC_RESTART_COUNT", "0"));
  const std::string rank = env_or("RANK", "0");
  if (restart == 0) {
    if (rank == "0") {
      record(out + "/crash", now_ns());
      return 1;
    }
    for (int i = 0; i < 600; ++i) ::usleep(100'000);  // stopped by the launcher long before
    return 0;
  }
  record(out + "/start_" + rank, started);
  return 0;
}
