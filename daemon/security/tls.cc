#include "daemon/security/tls.h"

#include <sys/stat.h>

#include <cstdio>
#include <mutex>
#include <optional>
#include <utility>
#include <variant>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/objects.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/files.h"

namespace rannc {
namespace security {
namespace {

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* x509) const { X509_free(x509); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// OpenSSL's reason for this thread's last error; the thread's error queue is emptied (gRPC reads
// the queue of the thread it handshakes on, which may be this one).
std::string OpenSslReason() {
  const unsigned long error = ERR_peek_last_error();
  const char* reason = error != 0 ? ERR_reason_error_string(error) : nullptr;
  std::string text = reason != nullptr ? reason
                     : error != 0      ? absl::StrCat("error ", error)
                                       : "no detail";
  ERR_clear_error();
  return text;
}

// What is wrong with a file's text: `reason` leads the message, `detail` follows what the file
// should hold.
struct Flaw {
  std::string reason;
  std::string detail;
};

absl::Status Bad(const std::string& flag, const std::string& path, const char* what,
                 const Flaw& flaw) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " ", path, ": ", flaw.reason, " (", what, "; ", flaw.detail, ")"));
}

struct PemBlock {
  std::string name;  // "CERTIFICATE", "PRIVATE KEY", ...
  std::string der;
};

// The PEM blocks of `text` in order, or its flaw: empty, no PEM at all, or a block cut short or
// damaged (a truncated file). Text around the blocks is skipped, as OpenSSL skips it.
std::variant<std::vector<PemBlock>, Flaw> PemBlocks(const std::string& text) {
  if (text.empty()) return Flaw{"empty", "expected a -----BEGIN ... block"};
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return Flaw{"not PEM", "expected a -----BEGIN ... block"};
  }
  BioPtr bio = MemoryBio(text);
  std::vector<PemBlock> blocks;
  for (;;) {
    char* name = nullptr;
    char* header = nullptr;
    unsigned char* data = nullptr;
    long size = 0;
    if (PEM_read_bio(bio.get(), &name, &header, &data, &size) != 1) {
      const unsigned long error = ERR_peek_last_error();
      if (ERR_GET_LIB(error) == ERR_LIB_PEM && ERR_GET_REASON(error) == PEM_R_NO_START_LINE) {
        ERR_clear_error();
        return blocks;
      }
      return Flaw{"a PEM block is cut short or damaged",
                  absl::StrCat("a truncated file? OpenSSL: ", OpenSslReason())};
    }
    blocks.push_back({name, std::string(reinterpret_cast<const char*>(data), size)});
    OPENSSL_free(name);
    OPENSSL_free(header);
    OPENSSL_free(data);
  }
}

std::string BlockNames(const std::vector<PemBlock>& blocks) {
  std::vector<std::string> names;
  for (const PemBlock& block : blocks) names.push_back(block.name);
  return absl::StrJoin(names, ", ");
}

bool IsCertificate(const std::string& name) {
  return name == "CERTIFICATE" || name == "X509 CERTIFICATE" || name == "TRUSTED CERTIFICATE";
}

// The certificates of a PEM text (a chain, or root certificates), each parsed; other blocks are
// skipped, as gRPC skips them.
std::variant<std::vector<X509Ptr>, Flaw> Certificates(const std::string& text) {
  auto blocks = PemBlocks(text);
  if (const Flaw* flaw = std::get_if<Flaw>(&blocks)) return *flaw;
  const auto& all = std::get<std::vector<PemBlock>>(blocks);
  std::vector<const PemBlock*> certificates;
  for (const PemBlock& block : all) {
    if (IsCertificate(block.name)) certificates.push_back(&block);
  }
  if (certificates.empty()) {
    return Flaw{"holds no certificate", absl::StrCat("its PEM blocks: ", BlockNames(all))};
  }
  std::vector<X509Ptr> parsed;
  for (size_t i = 0; i < certificates.size(); ++i) {
    const std::string& der = certificates[i]->der;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(der.data());
    X509Ptr x509(certificates[i]->name == "TRUSTED CERTIFICATE"
                     ? d2i_X509_AUX(nullptr, &p, static_cast<long>(der.size()))
                     : d2i_X509(nullptr, &p, static_cast<long>(der.size())));
    if (x509 == nullptr) {
      return Flaw{absl::StrCat("certificate ", i + 1, " of ", certificates.size(),
                               " does not parse"),
                  absl::StrCat("OpenSSL: ", OpenSslReason())};
    }
    parsed.push_back(std::move(x509));
  }
  return parsed;
}

// The first private key of a PEM text, read as gRPC reads it (no passphrase).
std::variant<PkeyPtr, Flaw> PrivateKey(const std::string& text) {
  auto blocks = PemBlocks(text);
  if (const Flaw* flaw = std::get_if<Flaw>(&blocks)) return *flaw;
  const auto& all = std::get<std::vector<PemBlock>>(blocks);
  bool any = false;
  for (const PemBlock& block : all) any = any || absl::EndsWith(block.name, "PRIVATE KEY");
  if (!any) return Flaw{"holds no private key", absl::StrCat("its PEM blocks: ", BlockNames(all))};
  BioPtr bio = MemoryBio(text);
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, const_cast<char*>("")));
  if (key == nullptr) {
    return Flaw{"the private key does not parse",
                absl::StrCat("it must not be encrypted; OpenSSL: ", OpenSslReason())};
  }
  return key;
}

std::string Describe(X509* x509) {
  char name[256] = {0};
  if (X509_NAME_get_text_by_NID(X509_get_subject_name(x509), NID_commonName, name,
                                sizeof(name) - 1) < 0) {
    ERR_clear_error();
    std::snprintf(name, sizeof(name), "(no common name)");
  }
  std::string expiry;
  BioPtr out(BIO_new(BIO_s_mem()));
  if (ASN1_TIME_print(out.get(), X509_get0_notAfter(x509)) == 1) {
    char* data = nullptr;
    const long size = BIO_get_mem_data(out.get(), &data);
    expiry.assign(data, size);
  }
  ERR_clear_error();
  return absl::StrCat("CN=", name, expiry.empty() ? "" : ", valid until ", expiry);
}

// A file's identity: what changes when it is rewritten or replaced.
struct FileStamp {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp& o) const {
    return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns;
  }
};

std::optional<FileStamp> Stamp(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileStamp{st.st_dev, st.st_ino, st.st_size,
                   static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(
    const TlsFiles& files, std::chrono::seconds refresh) {
  const unsigned int seconds = static_cast<unsigned int>(std::max<int64_t>(1, refresh.count()));
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.ca, seconds);
}

std::mutex peer_mu;
std::shared_ptr<grpc::ChannelCredentials>& PeerSlot() {
  static auto* slot = new std::shared_ptr<grpc::ChannelCredentials>();
  return *slot;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& flag, bool need_identity) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "give ", flag, "-cert and ", flag, "-key together (a certificate and its private key)"));
  }
  if (need_identity && files.cert.empty() && files.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "-ca without ", flag, "-cert and ", flag, "-key: a TLS server needs its own "
        "certificate and key"));
  }
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files, flag);
  if (!pem.ok()) return pem.status();
  return CheckTlsPem(*pem, files, flag);
}

absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files, const std::string& flag) {
  struct Part {
    const std::string& path;
    std::string* text;
    const char* suffix;
    const char* what;
  };
  TlsPem pem;
  const Part parts[] = {{files.cert, &pem.cert, "-cert", "a certificate chain"},
                        {files.key, &pem.key, "-key", "a private key"},
                        {files.ca, &pem.ca, "-ca", "root certificates"}};
  // A writer that replaces the files one by one (key, then certificate) may be caught half
  // done: read again while any file changed under the reading, as gRPC does.
  constexpr int kAttempts = 3;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    std::vector<std::optional<FileStamp>> before, after;
    for (const Part& part : parts) {
      before.push_back(part.path.empty() ? std::nullopt : Stamp(part.path));
    }
    for (const Part& part : parts) {
      if (part.path.empty()) continue;
      absl::StatusOr<std::string> text = ReadFile(part.path);
      if (!text.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(flag, part.suffix, " ", part.path,
                                                       ": cannot be read (", part.what,
                                                       "; a PEM file this process can read)"));
      }
      *part.text = std::move(*text);
    }
    for (const Part& part : parts) {
      after.push_back(part.path.empty() ? std::nullopt : Stamp(part.path));
    }
    if (before == after) break;
  }
  return pem;
}

absl::Status CheckTlsPem(const TlsPem& pem, const TlsFiles& files, const std::string& flag) {
  if (!files.cert.empty()) {
    auto chain = Certificates(pem.cert);
    if (const Flaw* flaw = std::get_if<Flaw>(&chain)) {
      return Bad(flag + "-cert", files.cert, "a certificate chain", *flaw);
    }
    auto key = PrivateKey(pem.key);
    if (const Flaw* flaw = std::get_if<Flaw>(&key)) {
      return Bad(flag + "-key", files.key, "a private key", *flaw);
    }
    X509* leaf = std::get<std::vector<X509Ptr>>(chain).front().get();
    if (X509_check_private_key(leaf, std::get<PkeyPtr>(key).get()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat(
          flag, "-key ", files.key, ": not the key of the certificate in ", flag, "-cert ",
          files.cert, " (", Describe(leaf), "; give the key that certificate was issued for)"));
    }
  }
  if (!files.ca.empty()) {
    auto roots = Certificates(pem.ca);
    if (const Flaw* flaw = std::get_if<Flaw>(&roots)) {
      return Bad(flag + "-ca", files.ca, "root certificates", *flaw);
    }
  }
  return absl::OkStatus();
}

std::string KeyAndChainPem(const TlsPem& pem) {
  auto blocks = PemBlocks(pem.key);
  if (std::holds_alternative<Flaw>(blocks)) return "";
  for (const PemBlock& block : std::get<std::vector<PemBlock>>(blocks)) {
    if (!absl::EndsWith(block.name, "PRIVATE KEY")) continue;
    BioPtr out(BIO_new(BIO_s_mem()));
    if (PEM_write_bio(out.get(), block.name.c_str(), "",
                      reinterpret_cast<const unsigned char*>(block.der.data()),
                      static_cast<long>(block.der.size())) <= 0) {
      ERR_clear_error();
      return "";
    }
    char* data = nullptr;
    const long size = BIO_get_mem_data(out.get(), &data);
    return std::string(data, static_cast<size_t>(size)) + pem.cert;
  }
  return "";
}

std::string DescribeCertificate(const std::string& cert_pem) {
  auto chain = Certificates(cert_pem);
  if (std::holds_alternative<Flaw>(chain)) return "";
  return Describe(std::get<std::vector<X509Ptr>>(chain).front().get());
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& files,
                                                           std::chrono::seconds refresh) {
  grpc::experimental::TlsServerCredentialsOptions options(Provider(files, refresh));
  options.watch_identity_key_cert_pairs();
  if (!files.ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& files,
                                                             std::chrono::seconds refresh) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(files, refresh));
  if (!files.ca.empty()) options.watch_root_certs();
  if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

void SetPeerCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials) {
  std::lock_guard<std::mutex> lock(peer_mu);
  PeerSlot() = std::move(credentials);
}

std::shared_ptr<grpc::ChannelCredentials> PeerCredentials() {
  std::lock_guard<std::mutex> lock(peer_mu);
  if (!PeerSlot()) return grpc::InsecureChannelCredentials();
  return PeerSlot();
}

std::string PeerCertificate(const grpc::ServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& name : auth->FindPropertyValues("x509_common_name")) {
    return std::string(name.data(), name.size());
  }
  return "(no common name)";
}

}  // namespace security
}  // namespace rannc
