// TLS for a control plane that has no certificates of its own: a key pair and a self-signed
// certificate derived from the shared token, so that only a holder of the token can serve it.
//
// Why: a client sends the token on every call. Without TLS it hands it to whoever listens on the
// coordinator's port, and a port on a shared machine can be taken first by another user. With
// the derived certificate the client trusts exactly one certificate, the token's: a server that
// does not know the token cannot complete the TLS handshake, so the client sends it nothing.
// The key is PBKDF2-HMAC-SHA256 of the token (fixed salt, 100,000 iterations), an Ed25519 seed;
// Ed25519 signs deterministically, so every process derives the very same certificate.
#pragma once

#include <string>

#include "agent/common/status.h"

namespace accel::rpc {

// The name the derived certificate is issued to; clients check the server presents it.
inline constexpr const char* kTokenTlsName = "accel-control-plane";

struct TokenTls {
  std::string cert_pem;  // self-signed, CN and DNS name kTokenTlsName, valid 2020-2099
  std::string key_pem;   // its Ed25519 private key
};

// The token's certificate and key (cached per token: the derivation takes about 25 ms).
Result<TokenTls> token_tls(const std::string& token);

}  // namespace accel::rpc
