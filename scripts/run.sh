#!/usr/bin/env bash
# run.sh -- installs what is missing, builds, and runs fusion's main job on the
# default model (SmolLM2-135M-Instruct): a chat completion answered locally.
#   scripts/run.sh ["your question"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" >&2
model=$("$root/scripts/fetch-default-model.sh")
prompt=${1:-"What is the capital of France? Answer in one sentence."}
exec "$root/build/fusion-generate" --model "$model" --chat "$prompt" --max-tokens 64
