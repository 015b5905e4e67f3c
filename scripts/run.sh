#!/usr/bin/env bash
# run.sh -- installs what building and running need (scripts/setup.sh run), builds the programs
# (no tests), then runs fusion end to end on the default model (SmolLM2-135M-Instruct): two
# local shards (blocks 0:15 and 15:30) and the OpenAI-compatible gateway on loopback, one chat
# completion sent with curl, the answer printed, everything stopped.
#   scripts/run.sh ["your question"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" run >&2
model=$("$root/scripts/fetch-default-model.sh")
prompt=${1:-"What is the capital of France? Answer in one sentence."}
build=${FUSION_BUILD_DIR:-$root/build}

# A new build tree is made without tests (FUSION_TESTS=OFF: the libraries and every program);
# in one that scripts/test.sh configured with tests, only the three programs used here are built.
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFUSION_TESTS=OFF >/dev/null
fi
targets=()
grep -qx 'FUSION_TESTS:BOOL=OFF' "$build/CMakeCache.txt" || targets=(--target fusion fusion-shard fusion-gateway)
cmake --build "$build" -j"$(nproc)" "${targets[@]}" >&2

work=$(mktemp -d "${TMPDIR:-/tmp}/fusion-run.XXXXXX")
pids=()
cleanup() {
  local rc=$?
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ "$rc" -ne 0 ]; then
    for f in "$work"/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
key="sk-local-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
threads=$(( $(nproc) > 1 ? $(nproc) / 2 : 1 ))

# wait_file FILE PID -- waits for a port file while the process lives
wait_file() {
  for _ in $(seq 600); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || { echo "run.sh: process $2 exited before it was ready" >&2; return 1; }
    sleep 0.1
  done
  echo "run.sh: timed out waiting for $1" >&2
  return 1
}

for span in 0:15 15:30; do
  name=shard-${span/:/-}
  FUSION_SECRET=$secret "$build/fusion-shard" --model "$model" --blocks "$span" --listen 127.0.0.1:0 \
    --port-file "$work/$name.port" --insecure --threads "$threads" >"$work/$name.log" 2>&1 &
  pids+=($!)
  wait_file "$work/$name.port" "$!"
done
p1=$(cat "$work/shard-0-15.port")
p2=$(cat "$work/shard-15-30.port")

FUSION_SECRET=$secret FUSION_API_KEY=$key "$build/fusion-gateway" --model "$model" --model-name SmolLM2-135M-Instruct \
  --hop "127.0.0.1:$p1:0:15" --hop "127.0.0.1:$p2:15:30" --insecure \
  --listen 127.0.0.1:0 --port-file "$work/gateway.port" >"$work/gateway.log" 2>&1 &
gw_pid=$!
pids=("$gw_pid" "${pids[@]}") # stop the gateway first
wait_file "$work/gateway.port" "$gw_pid"
url="http://127.0.0.1:$(cat "$work/gateway.port")"

for _ in $(seq 100); do
  curl -sf "$url/health" >/dev/null && break
  sleep 0.1
done
curl -sf "$url/health" >/dev/null || { echo "run.sh: the gateway is not healthy" >&2; exit 1; }

body=$(PROMPT=$prompt python3 - <<'EOF'
import json, os
print(json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 64, "temperature": 0,
                  "messages": [{"role": "user", "content": os.environ["PROMPT"]}]}))
EOF
)
echo "\$ curl $url/v1/chat/completions -H 'Authorization: Bearer ...' -H 'Content-Type: application/json' -d '$body'" >&2
reply=$(curl -sS --fail-with-body "$url/v1/chat/completions" -H "Authorization: Bearer $key" \
  -H "Content-Type: application/json" -d "$body")
REPLY_JSON=$reply python3 - <<'EOF'
import json, os, sys
r = json.loads(os.environ["REPLY_JSON"])
print(r["choices"][0]["message"]["content"])
u = r["usage"]
print("[%s: %d prompt + %d completion tokens, finish_reason=%s]" % (
    r["model"], u["prompt_tokens"], u["completion_tokens"], r["choices"][0]["finish_reason"]), file=sys.stderr)
EOF
