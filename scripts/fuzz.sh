#!/usr/bin/env bash
# fuzz.sh -- builds a libFuzzer target with clang (ASan+UBSan) and runs it for a while.
#   scripts/fuzz.sh TARGET [SECONDS] [BUILD_DIR]     e.g. scripts/fuzz.sh fuzz_shard_messages 60
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=$1
seconds=${2:-30}
build=${3:-$root/build-fuzz}
CC=clang cmake -S "$root" -B "$build" -DFUSION_FUZZ=ON -DFUSION_SANITIZE_TESTS=OFF -DFUSION_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$(nproc)" --target "$target" >/dev/null
corpus="$build/corpus-$target"
mkdir -p "$corpus"
seeds="$root/tests/fuzz/${target}_seeds.py"
[ -f "$seeds" ] && python3 "$seeds" "$corpus"
cd "$build"
ASAN_OPTIONS=detect_leaks=0 "./$target" -max_total_time="$seconds" -max_len=8192 -rss_limit_mb=4096 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 25
