#!/usr/bin/env bash
# The first start as a new user meets it: a fresh clone of this repository and an empty HOME, then
# `bash scripts/run.sh` (venv, install, kernels, the model, the profile, the three services) until the
# first chat completion answers. Prints the seconds to "specserve is up" and to the first answer.
#   bash bench/first_start.sh [OUT_LOG]      (SPECSERVE_CPU_KERNELS_VARIANT=avx2 forces a kernel variant)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/bench/results/first_start.log}"
WORK="$(mktemp -d /tmp/firststart.XXXXXX)"
PORT="${PORT:-8765}"
git clone -q "$ROOT" "$WORK/clone"
mkdir -p "$WORK/home"
start=$(date +%s.%N)
: >"$OUT"  # the log starts empty; run.sh and the result line below both append, so neither overwrites the other
( cd "$WORK/clone" && HOME="$WORK/home" exec bash scripts/run.sh --port "$PORT" ) >>"$OUT" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$WORK"' EXIT
up=""
for _ in $(seq 1 1200); do
    if [ -z "$up" ] && grep -q "specserve is up" "$OUT"; then up=$(date +%s.%N); fi
    if [ -n "$up" ] && curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16,"temperature":0}' \
        >"$WORK/answer.json"; then
        answered=$(date +%s.%N)
        printf 'up after %.0f s; first answer after %.0f s: %s\n' "$(echo "$up - $start" | bc)" \
            "$(echo "$answered - $start" | bc)" "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"])' "$WORK/answer.json")" | tee -a "$OUT"
        exit 0
    fi
    kill -0 $pid 2>/dev/null || { echo "run.sh exited before answering; see $OUT"; exit 1; }
    sleep 0.5
done
echo "no answer within 600 s; see $OUT"
exit 1
