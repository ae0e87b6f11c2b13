// A node's addresses: the one it is reached at, the interface that holds it, and the names that
// cannot work across machines (a host name that resolves to loopback: Debian's /etc/hosts maps
// the host's own name to 127.0.1.1).
#pragma once

#include <string>

namespace accel::node {

std::string local_hostname();

// The local address the kernel would use to reach `target` ("host:port"): what other nodes
// can most likely reach this one at. Falls back to the hostname.
std::string route_address_to(const std::string& target);

// The network interface ("eth0", "lo") that holds `address` (a name or a numeric address),
// or "" when none of this machine's does.
std::string interface_of_address(const std::string& address);

// Why `host` cannot be the address other machines reach (`what` names it in the message, for
// example "main_process_ip"), or "": a name other than "localhost" whose every address is a
// loopback one. Loopback literals and "localhost" are taken as meant (every node on one
// machine); a name that does not resolve is left to the connection's own error.
std::string loopback_name_problem(const std::string& host, const std::string& what);

}  // namespace accel::node
