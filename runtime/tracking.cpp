// Experiment trackers: TensorBoard event files, JSON lines, CSV (tracking.h).
#include "runtime/tracking.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>
#include <sstream>

#include "accel/error.h"

#ifdef ACCEL_WITH_TENSORBOARD
#include <boost/crc.hpp>

#include "runtime/tensorboard/event.pb.h"
#endif

namespace accel::tracking {

namespace fs = std::filesystem;

namespace {

constexpr const char* kKinds[] = {"tensorboard", "jsonl", "csv"};
constexpr const char* kEventsPrefix = "events.out.tfevents.";

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

[[noreturn]] void fail_io(const fs::path& path, const std::string& what, int err) {
  throw CheckpointError("accel: tracker file " + path.string() + ": " + what + ": " +
                        std::strerror(err));
}

// A CSV field: quoted when it holds a separator, a quote or a line break.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream out;
  out.precision(17);
  out << v;
  return out.str();
}

#ifdef ACCEL_WITH_TENSORBOARD
uint32_t masked_crc32c(const char* data, std::size_t size) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, size);
  uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// One TFRecord: length, masked CRC of the length, data, masked CRC of the data (little endian).
std::string tfrecord(const std::string& data) {
  std::string out(8 + 4 + data.size() + 4, '\0');
  uint64_t length = data.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  uint32_t length_crc = masked_crc32c(out.data(), 8);
  for (int i = 0; i < 4; ++i) out[8 + i] = static_cast<char>((length_crc >> (8 * i)) & 0xff);
  std::copy(data.begin(), data.end(), out.begin() + 12);
  uint32_t data_crc = masked_crc32c(data.data(), data.size());
  for (int i = 0; i < 4; ++i)
    out[12 + data.size() + i] = static_cast<char>((data_crc >> (8 * i)) & 0xff);
  return out;
}
#endif

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  std::string out(name);
  std::replace(out.begin(), out.end(), '/', '_');
  return out.empty() ? "localhost" : out;
}

}  // namespace

bool is_tracker_file(const std::string& name) {
  return name == "metrics.jsonl" || name == "metrics.csv" || name == "config.json" ||
         name.rfind(kEventsPrefix, 0) == 0;
}

std::vector<std::string> parse_log_with(const std::vector<std::string>& items,
                                        const std::string& where) {
  std::vector<bool> wanted(std::size(kKinds), false);
  for (const auto& item : items) {
    std::stringstream in(item);
    for (std::string part; std::getline(in, part, ',');) {
      std::string name = trim(part);
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (name.empty() || name == "none") continue;
      if (name == "all") {
        std::fill(wanted.begin(), wanted.end(), true);
        continue;
      }
      auto it = std::find(std::begin(kKinds), std::end(kKinds), name);
      if (it == std::end(kKinds)) {
        throw ConfigError("accel: " + where + "=\"" + item + "\": unknown tracker \"" + name +
                          "\"; expected tensorboard, jsonl, csv or all (several separated by "
                          "commas)");
      }
      wanted[static_cast<std::size_t>(it - std::begin(kKinds))] = true;
    }
  }
  std::vector<std::string> out;
  for (std::size_t i = 0; i < wanted.size(); ++i) {
    if (wanted[i]) out.emplace_back(kKinds[i]);
  }
  return out;
}

bool tensorboard_available() {
#ifdef ACCEL_WITH_TENSORBOARD
  return true;
#else
  return false;
#endif
}

// One append-only file.
struct Trackers::File {
  std::string kind;
  std::string name;
  fs::path path;
  int fd = -1;
  uint64_t size = 0;

  ~File() {
    if (fd >= 0) ::close(fd);
  }
  void open_at(std::optional<uint64_t> cut) {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) fail_io(path, "cannot open", errno);
    if (cut && ::ftruncate(fd, static_cast<off_t>(*cut)) != 0)
      fail_io(path, "cannot cut back", errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail_io(path, "cannot stat", errno);
    size = static_cast<uint64_t>(st.st_size);
  }
  void append(const std::string& bytes) {
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        int err = errno;
        // Why: half a record would sit inside the sizes later checkpoints record.
        if (done > 0) {
          [[maybe_unused]] int cut = ::ftruncate(fd, static_cast<off_t>(size));
        }
        fail_io(path, "cannot write", err);
      }
      done += static_cast<std::size_t>(n);
    }
    size += bytes.size();
  }
};

Trackers::Trackers(std::vector<std::string> kinds, fs::path dir, std::string run,
                   std::string config_json)
    : kinds_(std::move(kinds)),
      dir_(std::move(dir)),
      run_(std::move(run)),
      config_json_(std::move(config_json)) {}

Trackers::~Trackers() = default;

std::string Trackers::open(const std::optional<Position>& resume) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    throw CheckpointError("accel: cannot create the tracker folder " + dir_.string() + ": " +
                          ec.message());
  }
  std::string note;
  // Resume only if every file the checkpoint knew is still there and long enough.
  bool resuming = resume && resume->run == run_ && !resume->files.empty();
  if (resuming) {
    for (const auto& [name, size] : resume->files) {
      auto on_disk = fs::file_size(dir_ / name, ec);
      if (ec || on_disk < size) {
        note = "the tracker file " + (dir_ / name).string() +
               (ec ? std::string(" is gone") : " is shorter than when the checkpoint was saved") +
               "; this run's logs start anew. ";
        resuming = false;
        break;
      }
    }
  }
  std::vector<std::string> names;
  for (const auto& kind : kinds_) {
    std::string name = kind == "jsonl" ? "metrics.jsonl" : kind == "csv" ? "metrics.csv" : "";
    if (kind == "tensorboard") {
      if (resuming) {
        for (const auto& [n, size] : resume->files) {
          if (n.rfind(kEventsPrefix, 0) == 0) name = n;
        }
      }
      if (name.empty()) {
        name = std::string(kEventsPrefix) + std::to_string(::time(nullptr)) + "." + hostname() +
               "." + std::to_string(::getpid()) + ".accel";
      }
    }
    names.push_back(name);
  }
  // Files an earlier run left here (all of them when starting anew; those this run does not
  // continue when resuming) move aside, so no record is appended to another run's file.
  std::vector<fs::path> leftovers;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    std::string name = entry.path().filename().string();
    if (!entry.is_regular_file(ec) || !is_tracker_file(name) || name == "config.json") continue;
    if (resuming && resume->files.count(name)) continue;
    leftovers.push_back(entry.path());
  }
  if (!leftovers.empty()) {
    int n = 1;
    while (fs::exists(dir_ / ("previous-" + std::to_string(n)), ec)) ++n;
    fs::path aside = dir_ / ("previous-" + std::to_string(n));
    fs::create_directories(aside, ec);
    for (const auto& p : leftovers) {
      fs::rename(p, aside / p.filename(), ec);
      if (ec) {
        throw CheckpointError("accel: cannot move the earlier run's tracker file " + p.string() +
                              " to " + aside.string() + ": " + ec.message());
      }
    }
    if (fs::exists(dir_ / "config.json", ec))
      fs::rename(dir_ / "config.json", aside / "config.json", ec);
    note += "moved an earlier run's tracker files to " + aside.string() + ". ";
  }
  files_.clear();
  for (std::size_t i = 0; i < kinds_.size(); ++i) {
    auto f = std::make_unique<File>();
    f->kind = kinds_[i];
    f->name = names[i];
    f->path = dir_ / names[i];
    std::optional<uint64_t> cut;
    if (resuming && resume->files.count(names[i])) cut = resume->files.at(names[i]);
    f->open_at(cut);
    if (!cut) {
      if (f->kind == "csv") f->append("step,wall_time,name,value\n");
#ifdef ACCEL_WITH_TENSORBOARD
      if (f->kind == "tensorboard") {
        tensorboard::Event event;
        event.set_wall_time(static_cast<double>(::time(nullptr)));
        event.set_file_version("brain.Event:2");
        f->append(tfrecord(event.SerializeAsString()));
      }
#endif
    }
    files_.push_back(std::move(f));
  }
  {
    File config;
    config.path = dir_ / "config.json";
    config.fd =
        ::open(config.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (config.fd < 0) fail_io(config.path, "cannot open", errno);
    config.append(config_json_ + "\n");
  }
  open_ = true;
  if (resuming) note += "continuing the tracker files in " + dir_.string();
  return note;
}

void check_value_names(const std::map<std::string, double>& values) {
  for (const auto& [name, v] : values) {
    if (name == "step" || name == "wall_time" || name.empty()) {
      throw UsageError("accel: log(): \"" + name +
                       "\" cannot be a value's name (step and wall_time are every record's own)");
    }
  }
}

void Trackers::log(const std::vector<std::pair<std::string, double>>& values, int64_t step,
                   double wall_time, const std::string& only) {
  for (auto& f : files_) {
    if (!only.empty() && f->kind != only) continue;
    if (f->kind == "jsonl") {
      nlohmann::ordered_json line = {{"step", step}, {"wall_time", wall_time}};
      for (const auto& [name, v] : values) line[name] = v;  // NaN and inf become null
      f->append(line.dump() + "\n");
    } else if (f->kind == "csv") {
      std::string rows;
      for (const auto& [name, v] : values) {
        rows += std::to_string(step) + "," + number(wall_time) + "," + csv_field(name) + "," +
                number(v) + "\n";
      }
      f->append(rows);
    } else {
#ifdef ACCEL_WITH_TENSORBOARD
      tensorboard::Event event;
      event.set_wall_time(wall_time);
      event.set_step(step);
      auto* summary = event.mutable_summary();
      for (const auto& [name, v] : values) {
        auto* value = summary->add_value();
        value->set_tag(name);
        value->set_simple_value(static_cast<float>(v));
      }
      f->append(tfrecord(event.SerializeAsString()));
#endif
    }
  }
}

fs::path Trackers::file_of(const std::string& kind) const {
  for (const auto& f : files_) {
    if (f->kind == kind) return f->path;
  }
  return {};
}

Position Trackers::position() const {
  Position p;
  p.run = run_;
  for (const auto& f : files_) p.files[f->name] = f->size;
  return p;
}

void Trackers::close() {
  files_.clear();
  open_ = false;
}

}  // namespace accel::tracking
