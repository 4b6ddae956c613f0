#!/usr/bin/env bash
# Side-by-side speed comparison with llama.cpp's llama-bench on the same GGUF files: for each
# round and each file, llama-bench then `tessera bench` (same prompt and generation lengths,
# same thread count), so machine noise hits both alike. Prints each tool's pp/tg lines with the
# load average before it; take medians over rounds (docs/benchmarks/kquants.md does).
# Usage: scripts/bench-vs-llamacpp.sh [model.gguf ...]   (default: the project's default model)
# Env: LLAMA_BENCH (default: built by scripts/build-llama-cpp.sh), TESSERA (default
#      target/release/tessera), THREADS (2), ROUNDS (3), PP (512), TG (64), REPS (2),
#      LLAMA_BENCH_FLAGS (added to llama-bench's; e.g. `--repack 0,1` runs both weight layouts,
#      each line then led by its repack value, on hosts where both run: not where AMX faults).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_BENCH="${LLAMA_BENCH:-$("$ROOT/scripts/build-llama-cpp.sh")/llama-bench}"
TESSERA="${TESSERA:-$ROOT/target/release/tessera}"
[[ -x "$TESSERA" ]] || (cd "$ROOT" && cargo build --release --locked -p tessera-server)
THREADS="${THREADS:-2}" ROUNDS="${ROUNDS:-3}" PP="${PP:-512}" TG="${TG:-64}" REPS="${REPS:-2}"
MODELS=("$@")
[[ ${#MODELS[@]} -gt 0 ]] || MODELS=("$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf")
load() { cut -d' ' -f1 /proc/loadavg; }
for i in $(seq 1 "$ROUNDS"); do
    for m in "${MODELS[@]}"; do
        name=$(basename "$m" .gguf)
        echo "== round $i $name llama.cpp load $(load)"
        # shellcheck disable=SC2086
        "$LLAMA_BENCH" -m "$m" -t "$THREADS" -p "$PP" -n "$TG" -r "$REPS" ${LLAMA_BENCH_FLAGS:-} -o md 2>/dev/null | grep -E "\| +(pp|tg)[0-9]+ " |
            awk -F'|' -v repack="${LLAMA_BENCH_FLAGS:-}" '{ if (repack ~ /repack/) printf "repack%s ", $(NF-3); print $(NF-2), $(NF-1) }'
        echo "== round $i $name tessera load $(load)"
        RAYON_NUM_THREADS="$THREADS" "$TESSERA" bench --model "$m" -p "$PP" -n "$TG" -r "$REPS" 2>/dev/null | grep -E "^\| (pp|tg)[0-9]+ " | awk -F'|' '{print $2, $3}'
    done
done
