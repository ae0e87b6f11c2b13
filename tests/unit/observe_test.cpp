// What operators see: the Prometheus text format, the HTTP listener behind it (over real
// sockets), step rates, the straggler and stall rules, and the coordinator's metrics and page.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/common/token_file.h"
#include "agent/coordinator/coordinator_core.h"
#include "agent/coordinator/stragglers.h"
#include "agent/metrics/exposition.h"
#include "agent/metrics/html.h"
#include "agent/metrics/http_server.h"
#include "agent/supervisor/step_rates.h"

namespace accel {
namespace {

namespace pb = ::accel::v1;
using std::chrono::milliseconds;
using namespace std::chrono_literals;

// ============================================================================ text format

TEST(Exposition, WritesHelpTypeAndEscapedLabels) {
  metrics::Exposition out;
  out.family("accel_x_total", metrics::Type::kCounter, "Lines with \\ and\nnewline.");
  out.sample("accel_x_total", {{"node", "a\"b\\c\nd"}, {"job", "j"}}, 3);
  out.sample("accel_x_total", 0.25);
  EXPECT_EQ(out.text(),
            "# HELP accel_x_total Lines with \\\\ and\\nnewline.\n"
            "# TYPE accel_x_total counter\n"
            "accel_x_total{node=\"a\\\"b\\\\c\\nd\",job=\"j\"} 3\n"
            "accel_x_total 0.25\n");
}

TEST(Exposition, FormatsSpecialValues) {
  EXPECT_EQ(metrics::format_value(1.0 / 0.0), "+Inf");
  EXPECT_EQ(metrics::format_value(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(metrics::format_value(std::nan("")), "NaN");
  EXPECT_EQ(metrics::format_value(1795900170.5), "1795900170.5");
  EXPECT_EQ(metrics::format_value(42), "42");
}

TEST(Exposition, HistogramBucketsAreCumulativeWithSumAndCount) {
  metrics::Histogram h({0.1, 1});
  h.observe(0.05);
  h.observe(0.1);  // on the bound: in its bucket (le)
  h.observe(0.5);
  h.observe(7);
  metrics::Exposition out;
  out.family("accel_d_seconds", metrics::Type::kHistogram, "d");
  h.write(out, "accel_d_seconds", {{"method", "Sync"}});
  EXPECT_NE(out.text().find("accel_d_seconds_bucket{method=\"Sync\",le=\"0.1\"} 2\n"),
            std::string::npos)
      << out.text();
  EXPECT_NE(out.text().find("accel_d_seconds_bucket{method=\"Sync\",le=\"1\"} 3\n"),
            std::string::npos);
  EXPECT_NE(out.text().find("accel_d_seconds_bucket{method=\"Sync\",le=\"+Inf\"} 4\n"),
            std::string::npos);
  EXPECT_NE(out.text().find("accel_d_seconds_sum{method=\"Sync\"} 7.65\n"), std::string::npos);
  EXPECT_NE(out.text().find("accel_d_seconds_count{method=\"Sync\"} 4\n"), std::string::npos);
}

TEST(Html, EscapesMarkupQuotesAndControlCharacters) {
  EXPECT_EQ(metrics::html_escape("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;");
  EXPECT_EQ(metrics::html_escape("a\x1b[31mb"), "a\xEF\xBF\xBD[31mb");
  EXPECT_EQ(metrics::sparkline({}, 100, 20).find("polyline"), std::string::npos);
  EXPECT_NE(metrics::sparkline({1, 2, 3}, 100, 20).find("<polyline"), std::string::npos);
}

// ============================================================================ the listener

TEST(ListenAddress, PortAloneIsLoopbackAndBadTextIsExplained) {
  auto a = metrics::parse_listen_address("9100");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 9100);
  auto b = metrics::parse_listen_address("0.0.0.0:0");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->host, "0.0.0.0");
  auto c = metrics::parse_listen_address("[::1]:9100");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->host, "::1");
  for (const char* bad : {"", "x", "70000", ":9100", "host.example:9100", "1.2.3.4:-1"}) {
    auto r = metrics::parse_listen_address(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_NE(r.message().find(bad), std::string::npos) << r.message();
    }
  }
}

// One raw HTTP exchange: sends `request`, returns everything until the server closes or 2 s.
std::string http_exchange(int port, const std::string& request) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return "connect failed";
  }
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  size_t sent = 0;
  while (sent < request.size()) {
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

struct ServerFixture {
  explicit ServerFixture(std::string token = "") {
    metrics::HttpServerOptions o;
    o.address = "127.0.0.1:0";
    o.token = std::move(token);
    o.timeout = 1s;
    o.max_connections = 4;
    auto s = metrics::HttpServer::start(io, o, [this](const metrics::HttpRequest& r) {
      ++handled;
      metrics::HttpResponse resp;
      if (r.path == "/metrics") {
        resp.body = "accel_up 1\n";
      } else if (r.path == "/boom") {
        throw std::runtime_error("exploded");
      } else {
        resp.status = 404;
        resp.body = "no";
      }
      return resp;
    });
    EXPECT_TRUE(s) << s.message();
    server = std::move(*s);
    thread = std::thread([this] {
      auto guard = boost::asio::make_work_guard(io);
      io.run();
    });
  }
  ~ServerFixture() {
    boost::asio::post(io, [this] {
      server->stop();
      io.stop();
    });
    thread.join();
  }
  boost::asio::io_context io;
  std::unique_ptr<metrics::HttpServer> server;
  std::thread thread;
  int handled = 0;
};

TEST(HttpServer, AnswersGetHeadAndRefusesTheRest) {
  ServerFixture f;
  int port = f.server->port();
  std::string ok =
      http_exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("\r\n\r\naccel_up 1\n"), std::string::npos) << ok;
  std::string head =
      http_exchange(port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_NE(head.find("Content-Length: 11"), std::string::npos) << head;
  EXPECT_EQ(head.find("accel_up"), std::string::npos) << head;
  EXPECT_EQ(http_exchange(
                port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .rfind("HTTP/1.1 405", 0),
            0u);
  EXPECT_EQ(http_exchange(port, "GET /other HTTP/1.1\r\nConnection: close\r\n\r\n")
                .rfind("HTTP/1.1 404", 0),
            0u);
  EXPECT_EQ(http_exchange(port, "GET /boom HTTP/1.1\r\nConnection: close\r\n\r\n")
                .rfind("HTTP/1.1 500", 0),
            0u);
  EXPECT_EQ(http_exchange(port, "NOT HTTP AT ALL\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  std::string huge = "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(20'000, 'a') + "\r\n\r\n";
  EXPECT_EQ(http_exchange(port, huge).rfind("HTTP/1.1 431", 0), 0u);
  // Two requests on one connection (Prometheus keeps its connections).
  std::string two = http_exchange(port,
                                  "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                                  "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(two.find("HTTP/1.1 200", 1) != std::string::npos, true) << two;
}

TEST(HttpServer, SilentConnectionsAreClosedAndDoNotBlockOthers) {
  ServerFixture f;
  int port = f.server->port();
  // More idle connections than the limit: the extra ones are closed at accept, and once the
  // timeout closes the idle ones a request is answered again.
  std::vector<int> idle;
  for (int i = 0; i < 6; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(1500ms);  // past the 1 s timeout
  std::string ok = http_exchange(port, "GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  for (int fd : idle) {
    char c;
    EXPECT_EQ(::recv(fd, &c, 1, 0), 0) << "an idle connection is still open";
    ::close(fd);
  }
}

TEST(HttpServer, TokenIsRequiredWhenSet) {
  ServerFixture f("s3cret-token");
  int port = f.server->port();
  std::string none = http_exchange(port, "GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(none.rfind("HTTP/1.1 401", 0), 0u) << none;
  EXPECT_NE(none.find("WWW-Authenticate: Bearer"), std::string::npos);
  for (const char* wrong : {"Bearer s3cret-tokeN", "Bearer s3cret-token-longer", "Bearer ",
                            "Basic czNjcmV0LXRva2Vu", "s3cret-token"}) {
    std::string r = http_exchange(port, std::string("GET /metrics HTTP/1.1\r\nAuthorization: ") +
                                            wrong + "\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(r.rfind("HTTP/1.1 401", 0), 0u) << wrong;
  }
  std::string ok = http_exchange(port,
                                 "GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret-token\r\n"
                                 "Connection: close\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
}

TEST(HttpServer, APortInUseIsAnErrorNamingTheAddress) {
  ServerFixture f;
  boost::asio::io_context io;
  metrics::HttpServerOptions o;
  o.address = "127.0.0.1:" + std::to_string(f.server->port());
  auto second = metrics::HttpServer::start(
      io, o, [](const metrics::HttpRequest&) { return metrics::HttpResponse{}; });
  ASSERT_FALSE(second);
  EXPECT_NE(second.message().find(o.address), std::string::npos) << second.message();
  EXPECT_NE(second.message().find("in use"), std::string::npos) << second.message();
}

// The token files of token_file and metrics_token_file: the first line, one word.
TEST(TokenFile, FirstLineOneWordAndEachProblemNamed) {
  char dir_template[] = "/tmp/accel-token-test-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  auto ok = read_token_file("metrics_token_file", write("ok", "s3cret \r\nignored\n"));
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(*ok, "s3cret");
  auto empty = read_token_file("metrics_token_file", write("empty", ""));
  ASSERT_FALSE(empty);
  EXPECT_EQ(empty.message(), "metrics_token_file " + dir + "/empty is empty");
  auto spaced = read_token_file("token_file", write("spaced", "two words\n"));
  ASSERT_FALSE(spaced);
  EXPECT_EQ(spaced.message(),
            "token_file " + dir + "/spaced: the token must be one word without spaces");
  auto missing = read_token_file("token_file", dir + "/missing");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.message(), "token_file " + dir + "/missing: cannot read it");
  std::filesystem::remove_all(dir);
}

// ============================================================================ step rates

TEST(StepRates, SplitsWallTimeIntoComputeAndWait) {
  supervisor::StepRates r;
  const uint64_t s = 1'000'000'000;
  EXPECT_FALSE(r.rate(0));
  r.add(0, 10 * s, 100, 0);
  EXPECT_FALSE(r.rate(0));  // one sample
  r.add(0, 12 * s, 120, s / 2);
  auto rate = r.rate(0);
  ASSERT_TRUE(rate);
  EXPECT_DOUBLE_EQ(rate->steps_per_second, 10);
  EXPECT_DOUBLE_EQ(rate->wait_seconds_per_step, 0.025);
  EXPECT_DOUBLE_EQ(rate->compute_seconds_per_step, 0.075);
  // A restarted worker (fewer steps) starts the window over.
  r.add(0, 13 * s, 5, 0);
  EXPECT_FALSE(r.rate(0));
  // Old samples leave the window.
  for (uint64_t t = 14; t < 60; ++t) r.add(0, t * s, 5 + (t - 13), 0);
  ASSERT_TRUE(r.rate(0));
  EXPECT_LE(r.rate(0)->window_seconds, 21);
}

// ============================================================================ the rules

pb::RankProgress rank(int r, double compute, double wait, uint64_t steps = 100,
                      int64_t step_age_ms = 10) {
  pb::RankProgress p;
  p.set_rank(r);
  p.set_steps(steps);
  p.set_step_age_ms(step_age_ms);
  p.set_has_rate(true);
  p.set_compute_seconds_per_step(compute);
  p.set_wait_seconds_per_step(wait);
  p.set_steps_per_second(1 / (compute + wait));
  return p;
}

std::vector<coordinator::RankReport> reports(const std::vector<pb::RankProgress>& ranks) {
  std::vector<coordinator::RankReport> out;
  for (const auto& p : ranks) out.push_back({&p, "n" + std::to_string(p.rank() / 2), 0ms});
  return out;
}

TEST(Stragglers, ASlowRankIsReportedOnceAfterTheWindow) {
  coordinator::StragglerWatch w;
  coordinator::StragglerOptions o{2.0, 10s, 0ms};
  std::vector<pb::RankProgress> ranks = {rank(0, 0.1, 0.3), rank(1, 0.1, 0.3), rank(2, 0.4, 0.01),
                                         rank(3, 0.11, 0.29)};
  auto t0 = Clock::time_point{} + 1000s;
  EXPECT_TRUE(w.update(reports(ranks), t0, o).empty());
  EXPECT_TRUE(w.update(reports(ranks), t0 + 9s, o).empty());
  EXPECT_TRUE(w.flagged().empty());
  auto due = w.update(reports(ranks), t0 + 10s, o);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_FALSE(due[0].stall);
  EXPECT_EQ(due[0].line.rfind("rank 2 on node n1 is 4.0x slower than the median for 10 s (in "
                              "compute, not in collectives",
                              0),
            0u)
      << due[0].line;
  EXPECT_EQ(w.flagged().count(2), 1u);
  EXPECT_TRUE(coordinator::is_speed_report(due[0].line));  // the local launcher shows it
  EXPECT_FALSE(coordinator::is_speed_report("round 1 closed: 2 nodes"));
  EXPECT_TRUE(w.update(reports(ranks), t0 + 20s, o).empty());  // once per episode
  EXPECT_EQ(w.flagged().size(), 1u);
  // It keeps pace again: no longer flagged; slow again later: reported again after the window.
  ranks[2] = rank(2, 0.1, 0.3);
  EXPECT_TRUE(w.update(reports(ranks), t0 + 21s, o).empty());
  EXPECT_TRUE(w.flagged().empty());
  ranks[2] = rank(2, 0.5, 0.0);
  EXPECT_TRUE(w.update(reports(ranks), t0 + 22s, o).empty());
  EXPECT_EQ(w.update(reports(ranks), t0 + 32s, o).size(), 1u);
}

TEST(Stragglers, EvenRanksNoRatesOrThresholdOffReportNothing) {
  coordinator::StragglerOptions o{2.0, 0s, 0ms};
  auto t = Clock::time_point{} + 5s;
  {
    coordinator::StragglerWatch w;
    std::vector<pb::RankProgress> even = {rank(0, 0.1, 0.1), rank(1, 0.15, 0.05),
                                          rank(2, 0.12, 0.08)};
    EXPECT_TRUE(w.update(reports(even), t, o).empty());
  }
  {
    coordinator::StragglerWatch w;
    std::vector<pb::RankProgress> one = {rank(0, 0.1, 0.1)};
    EXPECT_TRUE(w.update(reports(one), t, o).empty());  // no one to compare with
  }
  {
    coordinator::StragglerWatch w;
    std::vector<pb::RankProgress> ranks = {rank(0, 0.1, 0.3), rank(1, 0.9, 0)};
    ranks[1].set_has_rate(false);
    EXPECT_TRUE(w.update(reports(ranks), t, o).empty());
    coordinator::StragglerOptions off{0, 0s, 0ms};
    ranks[1].set_has_rate(true);
    EXPECT_TRUE(w.update(reports(ranks), t, off).empty());
    // Two ranks: the slow one against the other alone.
    EXPECT_EQ(w.update(reports(ranks), t, o).size(), 1u);
  }
}

TEST(Stragglers, AStallNamesTheRankOutsideAnyCollective) {
  coordinator::StragglerWatch w;
  coordinator::StragglerOptions o{0, 0s, 60s};
  std::vector<pb::RankProgress> ranks = {
      rank(0, 0.1, 0.1, 50, 70'000), rank(1, 0.1, 0.1, 50, 70'000), rank(2, 0.1, 0.1, 50, 70'000)};
  ranks[0].set_in_flight("allreduce #813");
  ranks[2].set_in_flight("allreduce #813");
  ranks[1].set_last_finished("allreduce #812");
  auto t = Clock::time_point{} + 100s;
  auto due = w.update(reports(ranks), t, o);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_TRUE(due[0].stall);
  EXPECT_TRUE(coordinator::is_speed_report(due[0].line));
  EXPECT_EQ(due[0].line,
            "rank 1 on node n0 has taken no step for 70 s after step 50; it is outside any "
            "collective (its last was allreduce #812), and 2 other ranks wait in collectives");
  EXPECT_TRUE(w.update(reports(ranks), t + 1s, o).empty());  // once per stall
  // One rank stepping again ends the stall; before any step there is no stall at all.
  ranks[0].set_step_age_ms(5);
  EXPECT_TRUE(w.update(reports(ranks), t + 2s, o).empty());
  EXPECT_FALSE(w.stalled());
  std::vector<pb::RankProgress> fresh = {rank(0, 0.1, 0.1, 0, -1), rank(1, 0.1, 0.1, 0, -1)};
  EXPECT_TRUE(w.update(reports(fresh), t + 500s, o).empty());
}

TEST(Stragglers, Median) {
  EXPECT_EQ(coordinator::median({}), 0);
  EXPECT_EQ(coordinator::median({3, 1, 2}), 2);
  EXPECT_EQ(coordinator::median({4, 1, 3, 2}), 2.5);
}

// ============================================================================ the coordinator

// A 2-node job through the core: the agents' syncs carry their ranks' progress; time passes.
struct CoreJob {
  FakeClock clock;
  coordinator::CoordinatorCore core{clock, [] {
                                      coordinator::CoordinatorOptions o;
                                      o.coordinator_id = "coord-test";
                                      o.verify_reused_instructions = true;
                                      return o;
                                    }()};
  explicit CoreJob(const std::string& hostile_host) {
    for (const char* id : {"a", "b"}) {
      pb::RegisterNodeRequest r;
      r.set_node_id(id);
      r.set_hostname(std::string(id) == "b" ? hostile_host : "host-a");
      r.set_address(std::string(id) + ".internal");
      r.set_machine_rank(-1);
      pb::RegisterNodeResponse resp;
      EXPECT_TRUE(core.register_node(r, &resp).is_ok());
    }
    pb::SubmitJobRequest submit;
    submit.set_job_id("j");
    auto* s = submit.mutable_spec();
    s->add_argv("/bin/train");
    s->set_processes_per_node(1);
    s->set_min_nodes(2);
    s->set_max_nodes(2);
    s->set_max_restarts(1);
    s->set_join_timeout_ms(60'000);
    s->set_last_call_ms(0);
    s->set_stop_timeout_ms(5'000);
    s->set_straggler_threshold(2);
    s->set_straggler_window_ms(10'000);
    pb::SubmitJobResponse sr;
    EXPECT_TRUE(core.submit_job(submit, &sr).is_ok());
    for (const char* id : {"a", "b"}) {
      sync(id, {});
      pb::JoinRoundRequest j;
      j.set_node_id(id);
      j.set_job_id("j");
      j.set_round(0);
      EXPECT_TRUE(core.join_round(j).is_ok());
    }
    EXPECT_EQ(core.job_state("j"), pb::JOB_STATE_RUNNING);
  }
  void sync(const std::string& id, const std::vector<pb::RankProgress>& progress) {
    pb::SyncRequest req;
    req.set_node_id(id);
    for (const auto& p : progress) *req.add_progress() = p;
    pb::SyncResponse resp;
    EXPECT_TRUE(core.sync(req, &resp).is_ok());
  }
  std::string metrics() {
    metrics::Exposition out;
    core.write_metrics(out);
    return out.take();
  }
  std::vector<std::string> messages() {
    pb::WatchJobRequest w;
    w.set_job_id("j");
    pb::WatchJobResponse resp;
    EXPECT_TRUE(core.watch_job(w, &resp).is_ok());
    std::vector<std::string> out;
    for (const auto& e : resp.events())
      if (e.has_message()) out.push_back(e.message());
    return out;
  }
};

TEST(CoordinatorObserve, AStragglerIsAnEventAMetricAndAMarkOnTheEscapedPage) {
  CoreJob job("<script>alert(1)</script>");
  for (int t = 0; t <= 12; ++t) {
    job.sync("a", {rank(0, 0.1, 0.3)});
    job.sync("b", {rank(1, 0.35, 0.02)});
    job.clock.advance(1s);
    job.core.tick();
  }
  auto msgs = job.messages();
  auto it = std::find_if(msgs.begin(), msgs.end(), [](const std::string& m) {
    return m.find("slower than the median") != std::string::npos;
  });
  ASSERT_NE(it, msgs.end());
  EXPECT_EQ(it->rfind("rank 1 on node b is 3.5x slower than the median for ", 0), 0u) << *it;
  std::string m = job.metrics();
  EXPECT_NE(m.find("accel_rank_straggler{job_id=\"j\",rank=\"1\",node=\"b\"} 1\n"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("accel_job_straggler_reports_total{job_id=\"j\"} 1\n"), std::string::npos);
  EXPECT_NE(m.find("accel_coordinator_jobs{state=\"running\"} 1\n"), std::string::npos);
  EXPECT_NE(m.find("accel_coordinator_nodes{state=\"busy\"} 2\n"), std::string::npos);
  EXPECT_NE(m.find("accel_job_steps_per_second{job_id=\"j\",stat=\"median\"}"), std::string::npos);
  std::string page = job.core.status_page(5);
  EXPECT_NE(page.find("<tr class=\"rank straggler\" data-rank=\"1\" data-node=\"b\">"),
            std::string::npos);
  EXPECT_NE(page.find("<tr class=\"rank\" data-rank=\"0\" data-node=\"a\">"), std::string::npos);
  EXPECT_EQ(page.find("<script"), std::string::npos);
  EXPECT_NE(page.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);
  EXPECT_NE(page.find("<meta http-equiv=\"refresh\" content=\"5\">"), std::string::npos);
  EXPECT_EQ(page.find("http://"), std::string::npos) << "the page must load nothing from elsewhere";
}

TEST(CoordinatorObserve, RestartsAreCountedByCauseAndEveryUsualCauseStartsAtZero) {
  CoreJob job("host-b");
  std::string before = job.metrics();
  for (const char* cause : {"exit", "signal", "hang", "node_lost", "network"}) {
    EXPECT_NE(before.find("accel_job_restarts_total{job_id=\"j\",cause=\"" + std::string(cause) +
                          "\"} 0\n"),
              std::string::npos)
        << cause;
  }
  pb::ReportGroupRequest rep;
  rep.set_node_id("a");
  rep.set_job_id("j");
  rep.set_round(0);
  rep.set_event(pb::ReportGroupRequest::EVENT_FAILED);
  auto* f = rep.add_failures();
  f->set_kind(pb::Failure::KIND_EXIT);
  f->set_rank(0);
  f->set_signal(9);
  f->set_time_unix_ms(job.clock.unix_ms());
  ASSERT_TRUE(job.core.report_group(rep).is_ok());
  std::string after = job.metrics();
  EXPECT_NE(after.find("accel_job_restarts_total{job_id=\"j\",cause=\"signal\"} 1\n"),
            std::string::npos)
      << after;
  EXPECT_NE(after.find("accel_job_rounds_total{job_id=\"j\"} 2\n"), std::string::npos);
  EXPECT_NE(after.find("accel_job_restarts_counted{job_id=\"j\"} 1\n"), std::string::npos);
}

}  // namespace
}  // namespace accel
