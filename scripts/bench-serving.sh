#!/usr/bin/env bash
# Serving benchmark, side by side: `tessera serve` and llama.cpp's llama-server on the same
# GGUF file, driven by `tessera-bench` with the same load (random token-exact prompts,
# ignore_eos, greedy, closed loop at a fixed concurrency). The two servers run one after the
# other, never at once, each alone on the machine.
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

run_shapes() { # name port
    local name="$1" port="$2" seed=0
    for shape in "256 64" "32 128"; do
        set -- $shape
        for c in 1 8; do
            local n=$((c == 1 ? 4 : 16))
            seed=$((seed + 1)) # fresh prompts per run: no prefix reuse across runs
            echo "== $name: input $1, output $2, concurrency $c, $n requests"
            "$BENCH" --base-url "http://127.0.0.1:$port" --model "$MODEL" \
                --random-input-len "$1" --random-output-len "$2" --num-prompts "$n" \
                --max-concurrency "$c" --warmup-requests 1 --seed "$seed" --no-progress \
                --output-json "$OUT/$name-in$1-out$2-c$c.json" | sed -n '/Successful requests/,$p'
        done
    done
}

"$TESSERA" serve --model "$MODEL" --port 8100 --max-num-seqs 8 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
"$ROOT/scripts/wait-ready.sh" 8100
run_shapes tessera 8100
curl -s http://127.0.0.1:8100/metrics | grep -E '^tessera_step_(overhead|forward)_seconds_(sum|count)|^tessera_generation_tokens_total' > "$OUT/tessera-step-metrics.txt"
kill $PID; wait $PID 2>/dev/null || true

if [[ -n "$LLAMA_SERVER" ]]; then
    # shellcheck disable=SC2086
    "$LLAMA_SERVER" -m "$MODEL" -np 8 -t 2 -c 8192 --port 8090 ${LLAMA_SERVER_FLAGS:-} >/dev/null 2>&1 &
    PID=$!
    "$ROOT/scripts/wait-ready.sh" 8090
    run_shapes llama-server 8090
    kill $PID; wait $PID 2>/dev/null || true
fi
