// The listener and its sessions, with Boost.Beast.
#include "agent/metrics/http_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <list>
#include <optional>

namespace accel::metrics {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t kMaxRequestBytes = 8 * 1024;

bool same_token(std::string_view given, std::string_view want) {
  // Why no early exit: the time taken must not tell how much of the token was right.
  unsigned diff = given.size() == want.size() ? 0 : 1;
  for (std::size_t i = 0; i < given.size(); ++i)
    diff |= static_cast<unsigned char>(given[i]) ^
            static_cast<unsigned char>(want.empty() ? 0 : want[i % want.size()]);
  return diff == 0;
}

}  // namespace

Result<ListenAddress> parse_listen_address(const std::string& text) {
  ListenAddress out;
  std::string port_text = text;
  if (auto colon = text.rfind(':'); colon != std::string::npos) {
    out.host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']')
      out.host = out.host.substr(1, out.host.size() - 2);
    if (out.host.empty())
      return Status::error("'" + text + "' has no host before the ':' (give PORT or HOST:PORT)");
  } else {
    out.host = "127.0.0.1";
  }
  int port = -1;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 0 || port > 65535) {
    return Status::error("'" + text + "' is not PORT or HOST:PORT with a port of 0 to 65535");
  }
  out.port = port;
  if (out.host == "localhost") out.host = "127.0.0.1";
  boost::system::error_code bad;
  asio::ip::make_address(out.host, bad);
  if (bad) {
    return Status::error("'" + out.host + "' in '" + text +
                         "' is not an IP address (give one this host has, such as 127.0.0.1 or "
                         "0.0.0.0)");
  }
  return out;
}

struct HttpServer::State : std::enable_shared_from_this<HttpServer::State> {
  State(asio::io_context& io, HttpServerOptions o, Handler h)
      : io(io), acceptor(io), options(std::move(o)), handler(std::move(h)) {}

  struct Session : std::enable_shared_from_this<Session> {
    Session(std::shared_ptr<State> owner, tcp::socket socket)
        : owner(std::move(owner)), stream(std::move(socket)) {}
    std::shared_ptr<State> owner;
    beast::tcp_stream stream;
    beast::flat_buffer buffer;
    std::optional<http::request_parser<http::string_body>> parser;
    http::response<http::string_body> response;
    std::list<std::weak_ptr<Session>>::iterator self;

    void read() {
      if (!owner) return;  // the server stopped
      parser.emplace();
      parser->header_limit(kMaxRequestBytes);
      parser->body_limit(kMaxRequestBytes);
      stream.expires_after(owner->options.timeout);
      http::async_read(
          stream, buffer, *parser,
          [s = shared_from_this()](beast::error_code ec, std::size_t) { s->on_read(ec); });
    }

    void on_read(beast::error_code ec) {
      if (!owner) return;
      if (ec == http::error::header_limit) return reply_error(431, "request header too large\n");
      if (ec == http::error::body_limit) return reply_error(413, "request too large\n");
      if (ec == http::error::bad_method || ec == http::error::bad_target ||
          ec == http::error::bad_version || ec == http::error::bad_field)
        return reply_error(400, "malformed request\n");
      if (ec) return close();
      const auto& req = parser->get();
      HttpResponse r;
      bool keep = req.keep_alive();
      if (!owner->options.token.empty()) {
        auto auth = req[http::field::authorization];
        std::string_view given(auth.data(), auth.size());
        constexpr std::string_view kBearer = "Bearer ";
        bool ok = given.substr(0, kBearer.size()) == kBearer &&
                  same_token(given.substr(kBearer.size()), owner->options.token);
        if (!ok) r = {401, "text/plain; charset=utf-8", "a bearer token is required\n"};
      }
      if (r.status == 200 && req.method() != http::verb::get && req.method() != http::verb::head)
        r = {405, "text/plain; charset=utf-8", "only GET and HEAD\n"};
      if (r.status == 200) {
        HttpRequest hr;
        hr.method = req.method() == http::verb::head ? "HEAD" : "GET";
        std::string target(req.target().data(), req.target().size());
        auto q = target.find('?');
        hr.path = target.substr(0, q);
        if (q != std::string::npos) hr.query = target.substr(q + 1);
        try {
          r = owner->handler(hr);
        } catch (const std::exception& e) {
          r = {500, "text/plain; charset=utf-8", std::string("internal error: ") + e.what() + "\n"};
        }
      }
      send(std::move(r), keep, req.method() == http::verb::head);
    }

    void reply_error(int status, std::string body) {
      send({status, "text/plain; charset=utf-8", std::move(body)}, false, false);
    }

    void send(HttpResponse r, bool keep, bool head) {
      if (!owner) return;
      response = {};
      response.result(static_cast<unsigned>(r.status));
      response.version(11);
      response.set(http::field::server, "accel");
      response.set(http::field::content_type, r.content_type);
      response.set(http::field::cache_control, "no-store");
      if (r.status == 401) response.set(http::field::www_authenticate, "Bearer");
      response.keep_alive(keep);
      // Why before leaving the body out: a HEAD answer carries the length of the GET's body.
      response.content_length(r.body.size());
      if (!head) response.body() = std::move(r.body);
      stream.expires_after(owner->options.timeout);
      http::async_write(stream, response,
                        [s = shared_from_this(), keep](beast::error_code ec, std::size_t) {
                          if (ec || !keep) return s->close();
                          s->read();
                        });
    }

    void close() {
      beast::error_code ignored;
      stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
      stream.socket().close(ignored);
      if (owner) {
        owner->sessions.erase(self);
        owner.reset();
      }
    }
  };

  void accept() {
    acceptor.async_accept([s = shared_from_this()](beast::error_code ec, tcp::socket socket) {
      if (s->stopped) return;
      if (!ec) {
        if (s->sessions.size() >= s->options.max_connections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else {
          auto session = std::make_shared<Session>(s, std::move(socket));
          s->sessions.push_front(session);
          session->self = s->sessions.begin();
          session->read();
        }
      }
      // Why go on after an error: EMFILE and the like pass; the listener must not die of one.
      s->accept();
    });
  }

  asio::io_context& io;
  tcp::acceptor acceptor;
  HttpServerOptions options;
  Handler handler;
  std::list<std::weak_ptr<Session>> sessions;
  bool stopped = false;
  int port = 0;
};

HttpServer::HttpServer(std::shared_ptr<State> state) : state_(std::move(state)) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::port() const { return state_->port; }

void HttpServer::stop() {
  if (!state_ || state_->stopped) return;
  state_->stopped = true;
  beast::error_code ignored;
  state_->acceptor.close(ignored);
  auto sessions = state_->sessions;
  for (auto& weak : sessions) {
    if (auto s = weak.lock()) s->close();
  }
  state_->sessions.clear();
}

Result<std::unique_ptr<HttpServer>> HttpServer::start(asio::io_context& io,
                                                      HttpServerOptions options, Handler handler) {
  auto where = parse_listen_address(options.address);
  if (!where) return where.status();
  auto state = std::make_shared<State>(io, std::move(options), std::move(handler));
  tcp::endpoint endpoint(asio::ip::make_address(where->host),
                         static_cast<unsigned short>(where->port));
  beast::error_code ec;
  state->acceptor.open(endpoint.protocol(), ec);
  if (!ec) state->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) state->acceptor.bind(endpoint, ec);
  if (!ec) state->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::error("cannot serve metrics on " + state->options.address + ": " + ec.message());
  }
  state->port = state->acceptor.local_endpoint().port();
  state->accept();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(state)));
}

}  // namespace accel::metrics
