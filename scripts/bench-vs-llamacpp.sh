#!/usr/bin/env bash
# Side-by-side speed comparison with llama.cpp's llama-bench on the same GGUF file:
# alternates the two tools ROUNDS times (default 3) so machine noise hits both equally.
# Usage: scripts/bench-vs-llamacpp.sh /path/to/llama-bench [model.gguf] [threads]
# llama-bench is not built by this project; point at an existing build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_BENCH="${1:?usage: $0 /path/to/llama-bench [model.gguf] [threads]}"
MODEL="${2:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${3:-2}"
ROUNDS="${ROUNDS:-3}"
TESSERA="$ROOT/target/release/tessera"
[[ -x "$TESSERA" ]] || (cd "$ROOT" && cargo build --release --locked -p tessera-server)
for i in $(seq 1 "$ROUNDS"); do
    echo "== round $i: llama.cpp"
    "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 5 -o md 2>/dev/null | grep -E "pp512|tg128"
    echo "== round $i: tessera"
    RAYON_NUM_THREADS="$THREADS" "$TESSERA" bench --model "$MODEL" -p 512 -n 128 -r 5 | grep -E "pp512|tg128|RSS"
done
