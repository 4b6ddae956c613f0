#!/usr/bin/env bash
# End-to-end throughput per KV-cache format: `tessera serve` with the format, driven by
# tessera-bench with long prompts (4096 random tokens, 16 output tokens, ignore_eos, greedy) at
# concurrency 8, 8 requests, one format at a time. JSON reports land in target/kv-bench/.
# Usage: scripts/kv-bench.sh [format ...]   (default: a representative set)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/target/kv-bench"
mkdir -p "$OUT"
(cd "$ROOT" && cargo build --release --locked -p tessera-server -p tessera-loadtest)
FORMATS=("$@")
[[ ${#FORMATS[@]} -gt 0 ]] || FORMATS=(bf16 f32 fp8_e4m3 int8 tq3_0 hqmq-s96-r4 hqmq-s192-r6-med3 qjl1/bf16)
port=8200
for f in "${FORMATS[@]}"; do
    port=$((port + 1))
    k="${f%%/*}" v="${f##*/}"
    "$ROOT/target/release/tessera" serve --port "$port" --max-num-seqs 8 --max-num-batched-tokens 2048 \
        --kv-cache-memory 3GiB --kv-cache-dtype-k "$k" --kv-cache-dtype-v "$v" --log-format json 2>"$OUT/${f//\//_}.log" &
    pid=$!
    "$ROOT/scripts/wait-ready.sh" "$port" >/dev/null
    echo "== $f"
    "$ROOT/target/release/tessera-bench" --base-url "http://127.0.0.1:$port" --random-input-len 4096 \
        --random-output-len 16 --num-prompts 8 --max-concurrency 8 --seed 7 --no-progress \
        --output-json "$OUT/${f//\//_}.json" | grep -E "Request throughput|Output token throughput|Total token throughput|Mean TTFT|Median TPOT"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
done
