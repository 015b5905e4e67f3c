#!/usr/bin/env bash
# test.sh -- installs everything the tests need (scripts/setup.sh test), builds everything
# (the programs, the unit tests plain and under ASan+UBSan) and runs every test under CTest.
#   scripts/test.sh [ctest args...]     e.g. scripts/test.sh -L unit
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" test
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFUSION_TESTS=ON >/dev/null
cmake --build "$root/build" -j"$(nproc)"
cd "$root/build"
ctest --output-on-failure -j"$(nproc)" --timeout 900 "$@"
