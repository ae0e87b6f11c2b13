// The TCP side of the store: accept, read, feed StoreCore, write replies.
#include "agent/store/store_server.h"

#include <fcntl.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <deque>
#include <unordered_map>
#include <vector>

namespace accel::store {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {
constexpr size_t kReadChunk = 64 * 1024;
// Why 64 KiB over the largest value: the reply to a GET of a value at the limit (its 8-byte length
// and 64 MiB) must fit, or a stored value could never be read.
constexpr size_t kMaxUnsent = 64 * 1024 * 1024 + 64 * 1024;
}  // namespace

struct StoreServer::Impl : std::enable_shared_from_this<StoreServer::Impl> {
  struct Client {
    tcp::socket socket;
    std::string in;
    std::deque<std::string> out;
    size_t unsent = 0;
    bool writing = false;
    bool reading = false;
    explicit Client(tcp::socket s) : socket(std::move(s)) {}
  };

  Impl(asio::io_context& io_context, StoreServerOptions opts)
      : io(io_context), options(std::move(opts)), acceptor(io_context), core(options.limits) {}

  asio::io_context& io;
  StoreServerOptions options;
  tcp::acceptor acceptor;
  asio::steady_timer retry{io};  // accept() again after an error
  StoreCore core;
  std::unordered_map<StoreCore::ConnId, std::unique_ptr<Client>> clients;
  // Why one buffer for every client: reads happen in on_readable, one at a time on the io
  // thread, so an idle connection holds no read buffer (16384 of them would hold 1 GiB).
  std::vector<char> buffer = std::vector<char>(kReadChunk);
  size_t warnings = 0;
  bool closed = false;
  StoreServer::Traffic traffic;

  void warn(const std::string& what) {
    ++warnings;
    if (options.warn && (warnings <= 20 || warnings % 1000 == 0)) {
      options.warn("rendezvous store: " + what +
                   (warnings == 20 ? " (further warnings: one in 1000)" : ""));
    }
  }

  void accept() {
    acceptor.async_accept(
        [self = shared_from_this()](const boost::system::error_code& ec, tcp::socket s) {
          if (self->closed) return;
          if (!ec) {
            self->adopt(std::move(s));
            self->accept();
            return;
          }
          // Why go on after an error, and why after a pause: EMFILE and friends pass, and the
          // listener must not die of them; accepting again at once would spin at 100% CPU on a
          // connection the kernel keeps offering while no descriptor is free.
          self->warn("cannot accept a connection: " + ec.message() +
                     (ec == asio::error::no_descriptors
                          ? " (the open-file limit; raise it with ulimit -n)"
                          : ""));
          self->retry.expires_after(std::chrono::milliseconds(100));
          self->retry.async_wait([self](const boost::system::error_code& wait_ec) {
            if (!wait_ec && !self->closed) self->accept();
          });
        });
  }

  void adopt(tcp::socket s) {
    ++traffic.connections;
    if (clients.size() >= options.max_connections) {
      warn("refused a connection: " + std::to_string(clients.size()) + " clients already");
      boost::system::error_code ignored;
      s.close(ignored);
      return;
    }
    boost::system::error_code ignored;
    // Why CLOEXEC: workers are forked from this thread; none may inherit another's connection.
    ::fcntl(s.native_handle(), F_SETFD, FD_CLOEXEC);
    s.set_option(tcp::no_delay(true), ignored);
    s.non_blocking(true, ignored);
    StoreCore::ConnId id = core.open();
    clients.emplace(id, std::make_unique<Client>(std::move(s)));
    read(id);
  }

  void drop(StoreCore::ConnId id, const std::string& why) {
    auto it = clients.find(id);
    if (it == clients.end()) return;
    if (!why.empty()) {
      boost::system::error_code ec;
      auto peer = it->second->socket.remote_endpoint(ec);
      warn(
          "closed the connection from " +
          (ec ? std::string("?") : peer.address().to_string() + ":" + std::to_string(peer.port())) +
          ": " + why);
    }
    boost::system::error_code ignored;
    it->second->socket.close(ignored);
    clients.erase(it);
    core.close(id);
  }

  void read(StoreCore::ConnId id) {
    auto it = clients.find(id);
    if (it == clients.end() || it->second->reading) return;
    Client& c = *it->second;
    if (c.unsent > kMaxUnsent / 4) return;  // Why: a client that does not read its replies waits
    c.reading = true;
    c.socket.async_wait(tcp::socket::wait_read,
                        [self = shared_from_this(), id](const boost::system::error_code& ec) {
                          self->on_readable(id, ec);
                        });
  }

  void on_readable(StoreCore::ConnId id, const boost::system::error_code& ec) {
    if (closed) return;
    auto it = clients.find(id);
    if (it == clients.end()) return;
    Client& c = *it->second;
    c.reading = false;
    boost::system::error_code read_ec = ec;
    size_t n = 0;
    if (!read_ec) n = c.socket.read_some(asio::buffer(buffer), read_ec);  // non-blocking
    if (!read_ec) traffic.received_bytes += n;
    if (read_ec == asio::error::would_block || read_ec == asio::error::try_again) {
      read(id);
      return;
    }
    if (read_ec) {
      drop(id, "");  // the client went away (EOF): the usual end of a worker
      return;
    }
    c.in.append(buffer.data(), n);
    if (c.in.size() >= core.bytes_wanted(id)) {
      if (auto error = core.feed(id, c.in)) {
        flush();
        drop(id, *error);
        return;
      }
    }
    flush();
    read(id);
  }

  // Sends what StoreCore queued, to whichever clients it was for.
  void flush() {
    for (StoreCore::ConnId id : core.take_ready()) {
      auto it = clients.find(id);
      std::string bytes = core.take_output(id);
      if (it == clients.end() || bytes.empty()) continue;
      Client& c = *it->second;
      c.unsent += bytes.size();
      c.out.push_back(std::move(bytes));
      if (c.unsent > kMaxUnsent) {
        drop(id, "more than " + std::to_string(kMaxUnsent) + " bytes of replies left unread");
        continue;
      }
      write(id);
    }
  }

  void write(StoreCore::ConnId id) {
    auto it = clients.find(id);
    if (it == clients.end() || it->second->writing || it->second->out.empty()) return;
    Client& c = *it->second;
    c.writing = true;
    asio::async_write(c.socket, asio::buffer(c.out.front()),
                      [self = shared_from_this(), id](const boost::system::error_code& ec, size_t) {
                        if (self->closed) return;
                        auto found = self->clients.find(id);
                        if (found == self->clients.end()) return;
                        Client& client = *found->second;
                        client.writing = false;
                        if (ec) {
                          self->drop(id, "");
                          return;
                        }
                        client.unsent -= client.out.front().size();
                        self->traffic.sent_bytes += client.out.front().size();
                        client.out.pop_front();
                        self->write(id);
                        self->read(id);
                      });
  }

  void reset() {
    std::vector<StoreCore::ConnId> ids;
    for (auto& [id, c] : clients) ids.push_back(id);
    for (auto id : ids) drop(id, "");
    core.clear();
  }

  void close() {
    closed = true;
    boost::system::error_code ignored;
    retry.cancel();
    acceptor.close(ignored);
    for (auto& [id, c] : clients) c->socket.close(ignored);
    clients.clear();
  }
};

StoreServer::StoreServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

StoreServer::~StoreServer() {
  if (impl_) impl_->close();
}

Result<std::unique_ptr<StoreServer>> StoreServer::listen(asio::io_context& io,
                                                         StoreServerOptions options) {
  if (options.port < 0 || options.port > 65535) {
    return Status::error("store port " + std::to_string(options.port) + " is not a port");
  }
  const std::string where = options.host + ":" + std::to_string(options.port);
  boost::system::error_code ec;
  tcp::resolver resolver(io);
  auto found = resolver.resolve(options.host, std::to_string(options.port),
                                tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || found.empty()) {
    return Status::error("cannot resolve '" + options.host + "' to bind the rendezvous store: " +
                         (ec ? ec.message() : std::string("no address")));
  }
  auto impl = std::make_shared<Impl>(io, options);
  std::string last_error;
  for (const auto& entry : found) {
    impl->acceptor.close(ec);
    tcp::endpoint ep = entry.endpoint();
    if (impl->acceptor.open(ep.protocol(), ec)) {
      last_error = ec.message();
      continue;
    }
    // Why reuse_address: a port left in TIME_WAIT by the last job is free; one with a listener
    // still fails with EADDRINUSE.
    impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    ::fcntl(impl->acceptor.native_handle(), F_SETFD, FD_CLOEXEC);
    if (impl->acceptor.bind(ep, ec)) {
      last_error = ec.message();
      if (ec == asio::error::address_in_use) last_error += " (another process holds the port)";
      continue;
    }
    if (impl->acceptor.listen(asio::socket_base::max_listen_connections, ec)) {
      last_error = ec.message();
      continue;
    }
    impl->accept();
    return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl)));
  }
  return Status::error("cannot listen on " + where +
                       " for the rendezvous store (MASTER_PORT): " + last_error);
}

int StoreServer::port() const { return impl_->acceptor.local_endpoint().port(); }
void StoreServer::reset() { impl_->reset(); }
size_t StoreServer::connections() const { return impl_->clients.size(); }
const StoreServer::Traffic& StoreServer::traffic() const { return impl_->traffic; }
const StoreCore& StoreServer::core() const { return impl_->core; }

}  // namespace accel::store
