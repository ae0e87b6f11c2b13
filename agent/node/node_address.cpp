// A node's addresses (node_address.h).
#include "agent/node/node_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace accel::node {
namespace {

// The numeric addresses `host` resolves to (a literal gives itself).
std::vector<sockaddr_storage> resolve(const std::string& host) {
  std::vector<sockaddr_storage> out;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    sockaddr_storage s{};
    std::memcpy(&s, a->ai_addr, a->ai_addrlen);
    out.push_back(s);
  }
  ::freeaddrinfo(res);
  return out;
}

bool is_loopback(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&s);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&s);
  if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return true;
  if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) return in6->sin6_addr.s6_addr[12] == 127;
  return false;
}

std::string text_of(const sockaddr_storage& s) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* addr =
      s.ss_family == AF_INET
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&s)->sin_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr);
  return ::inet_ntop(s.ss_family, addr, text, sizeof text) != nullptr ? text : "?";
}

bool same_address(const sockaddr* a, const sockaddr_storage& b) {
  if (a == nullptr || a->sa_family != b.ss_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(&b)->sin_addr.s_addr;
  }
  return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6*>(&b)->sin6_addr, sizeof(in6_addr)) == 0;
}

}  // namespace

std::string local_hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

std::string route_address_to(const std::string& target) {
  auto colon = target.rfind(':');
  std::string host = target.substr(0, colon);
  std::string port = colon == std::string::npos ? "29400" : target.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return local_hostname();
  }
  std::string out = local_hostname();
  int fd = ::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[INET6_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* addr =
          local.ss_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (::inet_ntop(local.ss_family, addr, text, sizeof text) != nullptr) out = text;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

std::string interface_of_address(const std::string& address) {
  auto wanted = resolve(address);
  if (wanted.empty()) return "";
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (const auto& w : wanted) {
    for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
      if (same_address(i->ifa_addr, w)) name = i->ifa_name;
    }
    if (!name.empty()) break;
  }
  ::freeifaddrs(list);
  return name;
}

std::string loopback_name_problem(const std::string& host, const std::string& what) {
  if (host.empty() || host == "localhost") return "";
  in6_addr literal{};
  if (::inet_pton(AF_INET, host.c_str(), &literal) == 1 ||
      ::inet_pton(AF_INET6, host.c_str(), &literal) == 1) {
    return "";  // an address given as such is meant
  }
  auto addresses = resolve(host);
  if (addresses.empty()) return "";
  for (const auto& a : addresses) {
    if (!is_loopback(a)) return "";
  }
  return what + " " + host + " resolves to " + text_of(addresses.front()) +
         ", a loopback address: the other machines cannot reach this one there (a host's own "
         "name often maps to 127.0.1.1 in /etc/hosts). Give the address of the interface the "
         "other machines reach (for example 10.0.0.1), or a name that resolves to it; for every "
         "node on this one machine, give 127.0.0.1";
}

}  // namespace accel::node
