#!/usr/bin/env bash
# setup.sh -- installs what fusion needs on Debian 12, creates the test virtual
# environment, fetches the default model into the model cache and builds.
#
#   scripts/setup.sh            everything
#   SETUP_SKIP_BUILD=1 ...      dependencies and model only
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# ---- Debian packages ----------------------------------------------------------
pkgs=(build-essential cmake pkg-config git curl ca-certificates openssl
      libjansson-dev libpcre2-dev libutf8proc-dev libcurl4-openssl-dev libssl-dev
      libcmocka-dev libopenblas-dev libopenblas0-pthread libmicrohttpd-dev libsqlite3-dev
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
      python3 python3-venv python3-pip python3-torch clang libclang-rt-14-dev
      chromium chromium-driver) # the browser for tests/integration/test_swarm_page.py
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ---- Python environment for oracles and clients ---------------------------------
# Debian's torch is importable from /usr/bin/python3 only; the venv sees it.
venv="$root/.venv"
stamp="$venv/.fusion-requirements"
reqs="$root/tests/requirements.txt"
reqs_nodeps="$root/tests/requirements-nodeps.txt" # packages whose declared deps would pull CUDA torch
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
if ! cat "$reqs" "$reqs_nodeps" | cmp -s - "$stamp"; then
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$reqs_nodeps"
  cat "$reqs" "$reqs_nodeps" > "$stamp"
fi

# ---- default model ----------------------------------------------------------------
"$root/scripts/fetch-default-model.sh"

# ---- build --------------------------------------------------------------------------
if [ -z "${SETUP_SKIP_BUILD:-}" ]; then
  cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$root/build" -j"$(nproc)"
fi
