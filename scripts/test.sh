#!/usr/bin/env bash
# test.sh -- installs what is missing, builds (plain and ASan+UBSan) and runs every test under CTest.
#   scripts/test.sh [ctest args...]     e.g. scripts/test.sh -L unit
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root/build"
ctest --output-on-failure -j"$(nproc)" --timeout 900 "$@"
