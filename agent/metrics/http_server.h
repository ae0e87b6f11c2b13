// HttpServer: the small HTTP/1.1 listener behind /metrics and the status page (Boost.Beast on
// an io_context the caller runs). It answers GET and HEAD only, with the handler's response;
// anything else is refused with a status code, never with a crash or an unbounded wait.
//
// Bounds, since anyone who can reach the port can talk to it: requests over 8 KiB are refused
// (431/413), a connection that sends nothing whole within `timeout` is closed, at most
// `max_connections` are open at once (more are closed at accept). With a token, every request
// must carry "Authorization: Bearer <token>" (compared in constant time) or gets 401.
//
// Thread: everything, the handler included, runs on the io_context's thread.
#pragma once

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "agent/common/status.h"

namespace accel::metrics {

struct HttpRequest {
  std::string method;  // "GET" or "HEAD"
  std::string path;    // the target without its query
  std::string query;   // after '?', empty when none
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

struct HttpServerOptions {
  // "PORT" (loopback), "HOST:PORT" or "[V6]:PORT"; port 0: any free port (see port()).
  std::string address;
  std::string token;  // empty: no authorization asked
  std::size_t max_connections = 64;
  std::chrono::milliseconds timeout{10'000};
};

// The address to bind for `text`: "9100" -> ("127.0.0.1", 9100). The error says what is wrong.
struct ListenAddress {
  std::string host;
  int port = 0;
};
Result<ListenAddress> parse_listen_address(const std::string& text);

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  // Binds and starts accepting. The error names the address (in use, not an address here).
  static Result<std::unique_ptr<HttpServer>> start(boost::asio::io_context& io,
                                                   HttpServerOptions options, Handler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  [[nodiscard]] int port() const;
  // Stops accepting and closes open connections (from the io thread).
  void stop();

  struct State;

 private:
  explicit HttpServer(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace accel::metrics
