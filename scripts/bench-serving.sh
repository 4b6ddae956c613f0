#!/usr/bin/env bash
# Serving benchmark, side by side: `tessera serve` and llama.cpp's llama-server on the same
# GGUF file, driven by `tessera-bench` with the same load (random token-exact prompts,
# ignore_eos, greedy, closed loop at a fixed concurrency). Both servers start first and each
# load runs against Tessera, then at once against llama-server with the same prompts: one
# server works at a time (the other idles, using no CPU), and the two runs of a load are
# minutes closer than when each server ran all loads in turn, so a shared host's drifting
# speed moves their ratio less.
# Usage: scripts/bench-serving.sh [/path/to/llama-server] [model.gguf]
# Shapes: prefill-heavy 256 in / 64 out and decode-heavy 32 in / 128 out, at concurrency 1
# and 8, each run with its own prompts (seed). JSON reports land in target/bench-serving/. llama-server is not built by this
# project; without it only Tessera runs. LLAMA_SERVER_FLAGS adds flags to llama-server's own
# (`--no-repack` where the CPU reports AMX that the VM does not let it use: ggml's AMX kernels
# crash there on the first batched step).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_SERVER="${1:-}"
MODEL="${2:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="$ROOT/target/bench-serving"
mkdir -p "$OUT"
(cd "$ROOT" && cargo build --release --locked -p tessera-server -p tessera-loadtest)
TESSERA="$ROOT/target/release/tessera"
BENCH="$ROOT/target/release/tessera-bench"

run_load() { # name port input output concurrency seed
    local name="$1" port="$2" n=$(($5 == 1 ? 4 : 16))
    echo "== $name: input $3, output $4, concurrency $5, $n requests"
    "$BENCH" --base-url "http://127.0.0.1:$port" --model "$MODEL" \
        --random-input-len "$3" --random-output-len "$4" --num-prompts "$n" \
        --max-concurrency "$5" --warmup-requests 1 --seed "$6" --no-progress \
        --output-json "$OUT/$name-in$3-out$4-c$5.json" | sed -n '/Successful requests/,$p'
}

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
"$TESSERA" serve --model "$MODEL" --port 8100 --max-num-seqs 8 &
PIDS+=($!)
if [[ -n "$LLAMA_SERVER" ]]; then
    # shellcheck disable=SC2086
    "$LLAMA_SERVER" -m "$MODEL" -np 8 -t 2 -c 8192 --port 8090 ${LLAMA_SERVER_FLAGS:-} >/dev/null 2>&1 &
    PIDS+=($!)
    "$ROOT/scripts/wait-ready.sh" 8090
fi
"$ROOT/scripts/wait-ready.sh" 8100

seed=0
for shape in "256 64" "32 128"; do
    set -- $shape
    for c in 1 8; do
        seed=$((seed + 1)) # fresh prompts per load: no prefix reuse across loads
        run_load tessera 8100 "$1" "$2" "$c" "$seed"
        if [[ -n "$LLAMA_SERVER" ]]; then
            run_load llama-server 8090 "$1" "$2" "$c" "$seed"
        fi
    done
done
curl -s http://127.0.0.1:8100/metrics | grep -E '^tessera_step_(overhead|forward)_seconds_(sum|count)|^tessera_generation_tokens_total' > "$OUT/tessera-step-metrics.txt"
