// How every accel gRPC endpoint is secured: a shared token sent as "authorization: Bearer
// <token>" metadata on every call, always over TLS: the site's certificates when it configures
// them (server cert/key, a CA for clients to verify it with, the CA on the server for mutual
// TLS), else a certificate derived from the token (token_tls.h), which only a token holder can
// serve, so a client never sends the token to a server that does not already hold it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "agent/common/status.h"

namespace accel::rpc {

struct TlsFiles {
  std::string cert;  // PEM certificate chain of this endpoint
  std::string key;   // PEM private key of `cert`
  std::string ca;    // PEM CA: servers require client certificates signed by it; clients
                   // verify the server with it. Empty: no TLS (client) / no client certs (server).
  [[nodiscard]] bool server_tls() const { return !cert.empty() && !key.empty(); }
  [[nodiscard]] bool client_tls() const { return !ca.empty(); }
};

// Call first thing in a process that uses gRPC, before any gRPC object exists: initializes gRPC
// with a 100 ms client backup poller. Why: gRPC (1.51) notices a reconnecting channel's connect
// only when something polls it; between blocking calls only the backup poller does, every 5 s by
// default, so a launcher started a moment before its coordinator waited 5 s per attempt (and,
// with TLS under load, never connected). The variable is set for gRPC's start-up only (workers
// do not inherit it); one already set by the user wins. Also turns off Abseil's mutex deadlock
// detection, which Debian's build leaves on.
void prepare_grpc_process();

// Blanks ACCEL_TOKEN's value in this process's original environment block and removes it from
// the environment. Call once the token has been read. Why: /proc/<pid>/environ shows the block
// the process started with to every process of the same user, its workers included.
void forget_token_in_environment();

// The token: the first line of `token_file` if set, else $ACCEL_TOKEN. Errors name the file.
// Empty tokens are refused: the control plane never runs open.
Result<std::string> load_token(const std::string& token_file, const char* env_value);

// The server's TLS: `tls`'s certificate when set, else the token's.
Result<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsFiles& tls,
                                                                    const std::string& token);
// The client's TLS: verify the server with `tls.ca` when set, else accept only the token's
// certificate (uses_token_tls).
Result<std::shared_ptr<grpc::ChannelCredentials>> channel_credentials(const TlsFiles& tls,
                                                                      const std::string& token);
inline bool uses_token_tls(const TlsFiles& tls) { return !tls.client_tls(); }

// A channel to `target` ("host:port") with keepalive pings so a dead peer is noticed in seconds.
Result<std::shared_ptr<grpc::Channel>> make_channel(const std::string& target, const TlsFiles& tls,
                                                    const std::string& token);

// gRPC's log lines pass through accel's hook from the first call of this (prepare_grpc_process
// and every endpoint call it): it counts the events below and prints every other line as gRPC
// would. A refused server certificate is not printed: the call that failed says it.
void install_grpc_log_hook();
// "Failed accept4" lines so far: gRPC's listener may have stopped accepting (EMFILE).
uint64_t grpc_accept_failures();
// TLS handshakes this process gave up as a client because the server's certificate was not the
// one it trusts (for the token's certificate: the server does not hold the token) or the server
// did not speak TLS.
uint64_t server_certificates_refused();

// Puts the token on a client call and bounds it.
void prepare_context(grpc::ClientContext& ctx, const std::string& token,
                     std::chrono::milliseconds timeout);

// True when the call carries exactly `token` (compared in constant time).
bool token_matches(const grpc::CallbackServerContext& ctx, const std::string& token);

// "UNAVAILABLE: failed to connect to all addresses" -> a sentence for people.
std::string describe(const grpc::Status& status);

}  // namespace accel::rpc
