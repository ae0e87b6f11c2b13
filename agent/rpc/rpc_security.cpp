// Token loading, TLS credentials, channel construction.
#include "agent/rpc/rpc_security.h"

#include <absl/synchronization/mutex.h>
#include <grpc/grpc.h>
#include <grpc/support/log.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string_view>

#include "agent/common/token_file.h"
#include "agent/rpc/coordinator_api.h"
#include "agent/rpc/token_tls.h"

namespace accel::rpc {

namespace {

Result<std::string> read_pem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(std::string(what) + " " + path + ": cannot read it");
  std::stringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  if (text.find("-----BEGIN") == std::string::npos) {
    return Status::error(std::string(what) + " " + path + ": not a PEM file (no -----BEGIN line)");
  }
  return text;
}

}  // namespace

Result<std::string> load_token(const std::string& token_file, const char* env_value) {
  if (!token_file.empty()) return read_token_file("token_file", token_file);
  std::string token;
  const std::string where = "ACCEL_TOKEN";
  if (env_value != nullptr) {
    token = env_value;
  } else {
    return Status::error(
        "no token: the control plane needs a shared secret on every node; set ACCEL_TOKEN or "
        "token_file (for example: head -c 24 /dev/urandom | base64 > ~/.accel-token); under "
        "Slurm, export ACCEL_TOKEN in the batch script before srun, which passes it to every "
        "node");
  }
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
  if (token.empty()) return Status::error(where + " is empty");
  if (token.find_first_of("\n\t ") != std::string::npos) {
    return Status::error(where + ": the token must be one word without spaces");
  }
  return token;
}

Result<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsFiles& tls,
                                                                    const std::string& token) {
  if (!tls.server_tls()) {
    if (!tls.cert.empty())
      return Status::error("tls_cert " + tls.cert + " has no tls_key: TLS needs both");
    if (!tls.key.empty())
      return Status::error("tls_key " + tls.key + " has no tls_cert: TLS needs both");
    auto derived = token_tls(token);
    if (!derived) return derived.status();
    grpc::SslServerCredentialsOptions opts(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    opts.pem_key_cert_pairs.push_back({derived->key_pem, derived->cert_pem});
    return grpc::SslServerCredentials(opts);
  }
  auto cert = read_pem(tls.cert, "tls_cert");
  if (!cert) return cert.status();
  auto key = read_pem(tls.key, "tls_key");
  if (!key) return key.status();
  grpc::SslServerCredentialsOptions opts(
      tls.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                     : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!tls.ca.empty()) {
    auto ca = read_pem(tls.ca, "tls_ca");
    if (!ca) return ca.status();
    opts.pem_root_certs = *ca;
  }
  opts.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(opts);
}

Result<std::shared_ptr<grpc::ChannelCredentials>> channel_credentials(const TlsFiles& tls,
                                                                      const std::string& token) {
  grpc::SslCredentialsOptions opts;
  if (uses_token_tls(tls)) {
    // Why the token's certificate as the only root: a server proves it holds the token by
    // completing the handshake with that certificate's key; nothing else is trusted.
    auto derived = token_tls(token);
    if (!derived) return derived.status();
    opts.pem_root_certs = derived->cert_pem;
    return grpc::SslCredentials(opts);
  }
  auto ca = read_pem(tls.ca, "tls_ca");
  if (!ca) return ca.status();
  opts.pem_root_certs = *ca;
  if (!tls.cert.empty() && !tls.key.empty()) {
    auto cert = read_pem(tls.cert, "tls_cert");
    if (!cert) return cert.status();
    auto key = read_pem(tls.key, "tls_key");
    if (!key) return key.status();
    opts.pem_cert_chain = *cert;
    opts.pem_private_key = *key;
  }
  return grpc::SslCredentials(opts);
}

namespace {

std::atomic<uint64_t> g_accept_failures{0};
std::atomic<uint64_t> g_certificates_refused{0};

void log_hook(gpr_log_func_args* args) {
  const char* message = args->message != nullptr ? args->message : "";
  if (args->severity == GPR_LOG_SEVERITY_ERROR) {
    if (std::strncmp(message, "Failed accept4", 14) == 0) g_accept_failures.fetch_add(1);
    // Why not printed: the call that needed the connection fails, and its caller says why in
    // words (CoordinatorClient turns it into UNAUTHENTICATED); gRPC would repeat this line on
    // every reconnection attempt.
    // "wrong version number": the server answered the ClientHello with something not TLS (a
    // plaintext server); "certificate verify failed": its certificate is not the trusted one.
    if (std::strstr(message, "Handshake failed") != nullptr &&
        (std::strstr(message, "certificate verify failed") != nullptr ||
         std::strstr(message, "wrong version number") != nullptr)) {
      g_certificates_refused.fetch_add(1);
      return;
    }
  }
  const char* file = args->file != nullptr ? std::strrchr(args->file, '/') : nullptr;
  std::fprintf(stderr, "%s %s:%d] %s\n", gpr_log_severity_string(args->severity),
               file != nullptr ? file + 1 : (args->file != nullptr ? args->file : "?"), args->line,
               message);
}

}  // namespace

void install_grpc_log_hook() {
  static std::once_flag once;
  std::call_once(once, [] { gpr_set_log_function(log_hook); });
}

uint64_t grpc_accept_failures() { return g_accept_failures.load(); }
uint64_t server_certificates_refused() { return g_certificates_refused.load(); }

void prepare_grpc_process() {
  constexpr const char* kBackupPoll = "GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS";
  bool ours = std::getenv(kBackupPoll) == nullptr;
  if (ours) ::setenv(kBackupPoll, "100", 0);
  // Why: Debian builds Abseil without NDEBUG, so every absl::Mutex that gRPC takes also updates
  // a global lock-order graph (deadlock detection, meant for debug builds): about a tenth of a
  // busy coordinator's CPU in perf. Set before gRPC creates its first mutex.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  grpc_init();  // reads the variable; never shut down (the processes end with _Exit)
  install_grpc_log_hook();
  if (ours) ::unsetenv(kBackupPoll);
}

void forget_token_in_environment() {
  constexpr std::string_view kPrefix = "ACCEL_TOKEN=";
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string_view(*e).substr(0, kPrefix.size()) == kPrefix) {
      char* value = *e + kPrefix.size();
      std::memset(value, 0, std::strlen(value));  // the bytes /proc/<pid>/environ shows
    }
  }
  ::unsetenv("ACCEL_TOKEN");
}

Result<std::shared_ptr<grpc::Channel>> make_channel(const std::string& target, const TlsFiles& tls,
                                                    const std::string& token) {
  install_grpc_log_hook();
  auto creds = channel_credentials(tls, token);
  if (!creds) return creds.status();
  grpc::ChannelArguments args;
  // The token's certificate names kTokenTlsName, whatever host serves it.
  if (uses_token_tls(tls)) args.SetSslTargetNameOverride(kTokenTlsName);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Why: an idle agent's Sync waits up to 30 s with nothing sent; by default gRPC stops pinging
  // after two pings without data, and a dead coordinator would go unnoticed until the deadline.
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, 2000);
  // Why short backoff: after a coordinator restart agents should be back within a second.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Why 5 s: gRPC reads this as the time one connection attempt (TCP connect and TLS handshake)
  // may take, not as a backoff. At 100 ms a busy machine never finished a TLS handshake in time,
  // and a launcher started before its coordinator retried for 15 s without connecting.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  // Why: each client its own connection (simulated agents in bench_coordinator share a process).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, *creds, args);
}

void prepare_context(grpc::ClientContext& ctx, const std::string& token,
                     std::chrono::milliseconds timeout) {
  ctx.AddMetadata("authorization", "Bearer " + token);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
}

bool token_matches(const grpc::CallbackServerContext& ctx, const std::string& token) {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return false;
  std::string expected = "Bearer " + token;
  std::string_view got(it->second.data(), it->second.size());
  if (got.size() != expected.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff |= static_cast<unsigned char>(got[i] ^ expected[i]);
  }
  return diff == 0;
}

std::string describe(const grpc::Status& status) {
  return describe(CallStatus{static_cast<CallCode>(status.error_code()), status.error_message()});
}

}  // namespace accel::rpc
