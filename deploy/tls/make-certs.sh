#!/bin/sh
# Makes a cluster CA (once) and a certificate it signs, for ranncd's TLS (docs/security.md):
#
#   deploy/tls/make-certs.sh DIR NAME [SAN ...]
#   deploy/tls/make-certs.sh /etc/rannc node-a IP:10.0.0.1 DNS:node-a.rannc
#
# DIR/ca.crt and DIR/ca.key: the CA, made on the first call (EC P-256, 10 years); keep ca.key
# off the nodes. DIR/NAME.crt and DIR/NAME.key: a certificate for NAME (its common name), valid
# for servers and clients (a daemon is both, to its peers), with the subject alternative names
# given (default IP:127.0.0.1 and DNS:localhost), for 1 year. Clients dial a daemon by one of
# those names. Needs openssl.
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 DIR NAME [SAN ...]   (SAN: IP:1.2.3.4 or DNS:host)" >&2
  exit 2
fi
dir=$1
name=$2
shift 2
sans=""
for san in "$@"; do sans="${sans:+$sans,}$san"; done
[ -n "$sans" ] || sans="IP:127.0.0.1,DNS:localhost"
mkdir -p "$dir"
umask 077
if [ ! -f "$dir/ca.crt" ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -days 3650 -subj "/CN=rannc cluster CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
fi
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$dir/$name.key" -out "$dir/$name.csr" -subj "/CN=$name" 2>/dev/null
ext=$(mktemp)
trap 'rm -f "$ext"' EXIT
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
  "$sans" > "$ext"
openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -CAcreateserial -out "$dir/$name.crt" -days 365 -extfile "$ext" 2>/dev/null
rm -f "$dir/$name.csr"
chmod 644 "$dir/ca.crt" "$dir/$name.crt"
echo "$dir/$name.crt and $dir/$name.key (CA $dir/ca.crt; names $sans)"
