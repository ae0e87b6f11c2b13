// The token's Ed25519 key and self-signed certificate (token_tls.h), with OpenSSL.
#include "agent/rpc/token_tls.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace accel::rpc {
namespace {

constexpr const char* kSalt = "accel-control-plane-tls-v1";
constexpr int kIterations = 100'000;

template <class T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const { Free(p); }
};
using Key = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

std::string bio_text(BIO* bio) {
  char* data = nullptr;
  long n = BIO_get_mem_data(bio, &data);
  return n > 0 ? std::string(data, static_cast<std::size_t>(n)) : std::string();
}

Result<TokenTls> derive(const std::string& token) {
  auto fail = [](const char* step) {
    return Status::error(std::string("cannot derive the control plane's TLS key from the token: ") +
                         step + " failed");
  };
  unsigned char seed[32];
  if (PKCS5_PBKDF2_HMAC(token.data(), static_cast<int>(token.size()),
                        reinterpret_cast<const unsigned char*>(kSalt),
                        static_cast<int>(std::strlen(kSalt)), kIterations, EVP_sha256(),
                        sizeof seed, seed) != 1) {
    return fail("PBKDF2");
  }
  Key key(EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, seed, sizeof seed));
  OPENSSL_cleanse(seed, sizeof seed);
  if (!key) return fail("the Ed25519 key");
  Cert cert(X509_new());
  if (!cert) return fail("X509_new");
  // Why fixed fields (serial, dates, names): every process must derive the same bytes.
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1);
  ASN1_TIME_set_string(X509_getm_notBefore(cert.get()), "20200101000000Z");
  ASN1_TIME_set_string(X509_getm_notAfter(cert.get()), "20991231235959Z");
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(kTokenTlsName), -1, -1, 0);
  X509_set_issuer_name(cert.get(), name);
  X509_set_pubkey(cert.get(), key.get());
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, cert.get(), cert.get(), nullptr, nullptr, 0);
  const std::string san = std::string("DNS:") + kTokenTlsName;
  const std::pair<int, const char*> extensions[] = {
      {NID_basic_constraints, "critical,CA:TRUE"},
      {NID_key_usage, "critical,digitalSignature,keyCertSign"},
      {NID_subject_alt_name, san.c_str()},
  };
  for (const auto& [nid, value] : extensions) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    if (ext == nullptr) return fail("a certificate extension");
    X509_add_ext(cert.get(), ext, -1);
    X509_EXTENSION_free(ext);
  }
  if (X509_sign(cert.get(), key.get(), nullptr) == 0) return fail("signing the certificate");
  Bio cert_bio(BIO_new(BIO_s_mem()));
  Bio key_bio(BIO_new(BIO_s_mem()));
  if (!cert_bio || !key_bio || PEM_write_bio_X509(cert_bio.get(), cert.get()) != 1 ||
      PEM_write_bio_PrivateKey(key_bio.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr) !=
          1) {
    return fail("writing PEM");
  }
  return TokenTls{bio_text(cert_bio.get()), bio_text(key_bio.get())};
}

}  // namespace

Result<TokenTls> token_tls(const std::string& token) {
  static std::mutex mu;
  static std::map<std::string, TokenTls> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(token); it != cache.end()) return it->second;
  auto derived = derive(token);
  if (derived) cache.emplace(token, *derived);
  return derived;
}

}  // namespace accel::rpc
