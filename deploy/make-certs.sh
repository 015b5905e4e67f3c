#!/bin/sh
# make-certs.sh DIR NAME... -- a private CA and one TLS certificate for a home cluster, plus
# the swarm secret and an API key, written into DIR once (existing files are kept).
# Every NAME (the compose service names) is a subjectAltName of the certificate, so each
# node can serve TLS under its own name; on separate machines give each its own
# certificate signed by the same CA.
set -eu
dir=$1
shift
umask 077
mkdir -p "$dir"
cd "$dir"
if [ ! -s ca.pem ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 3650 \
    -subj "/CN=fusion home cluster CA" 2>/dev/null
fi
if [ ! -s node.pem ]; then
  san="DNS:localhost,IP:127.0.0.1"
  for n in "$@"; do san="$san,DNS:$n"; done
  openssl req -newkey rsa:2048 -nodes -keyout node.key -out node.csr -subj "/CN=fusion node" 2>/dev/null
  printf 'subjectAltName=%s\n' "$san" > node.ext
  openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out node.pem -days 3650 \
    -extfile node.ext 2>/dev/null
  rm -f node.csr node.ext
fi
[ -s swarm.secret ] || openssl rand -hex 24 > swarm.secret
[ -s api-keys.txt ] || echo "sk-fusion-$(openssl rand -hex 16)" > api-keys.txt
chmod 0644 ca.pem node.pem
echo "make-certs: CA, certificate ($*), swarm secret and API key in $dir"
