#!/usr/bin/env bash
# MoE serving benchmark: the default model upcycled to 8 experts top-2 (Mixtral family,
# experts perturbed by 2% so they differ), served in BF16 and with its experts quantized
# (`--experts-only`) to W4A8 and W4A16, each driven by `tessera-bench` (32 in / 128 out,
# ignore_eos, greedy) at concurrency 1 and 8. The dense BF16 conversion runs the same load for
# reference. Servers run one after the other. Models go to target/bench-moe-models/, JSON
# reports to target/bench-moe/.
# Usage: scripts/bench-moe.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/fetch-default-model.sh >/dev/null
cargo build --release --locked -p tessera-server -p tessera-loadtest
TESSERA="$ROOT/target/release/tessera"
BENCH="$ROOT/target/release/tessera-bench"
GGUF="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
M="$ROOT/target/bench-moe-models"
OUT="$ROOT/target/bench-moe"
mkdir -p "$M" "$OUT"

[[ -f "$M/dense/config.json" ]] || "$TESSERA" convert gguf-to-hf --input "$GGUF" --output "$M/dense"
[[ -f "$M/moe-bf16/config.json" ]] || "$TESSERA" convert upcycle-moe --input "$GGUF" --output "$M/moe-bf16" \
    --family mixtral --experts 8 --top-k 2 --perturb 0.02 --seed 1
[[ -f "$M/moe-w4a8/config.json" ]] || "$TESSERA" quantize --input "$M/moe-bf16" --output "$M/moe-w4a8" \
    --scheme w4a8 --format quark --experts-only
[[ -f "$M/moe-w4a16/config.json" ]] || "$TESSERA" quantize --input "$M/moe-bf16" --output "$M/moe-w4a16" \
    --scheme w4a16 --group-size 64 --experts-only

for name in dense moe-bf16 moe-w4a8 moe-w4a16; do
    "$TESSERA" serve --model "$M/$name" --port 8101 --max-num-seqs 8 >/dev/null 2>&1 &
    PID=$!
    trap 'kill $PID 2>/dev/null || true' EXIT
    "$ROOT/scripts/wait-ready.sh" 8101
    seed=0
    for c in 1 8; do
        n=$((c == 1 ? 4 : 16))
        seed=$((seed + 1))
        echo "== $name: input 32, output 128, concurrency $c, $n requests"
        "$BENCH" --base-url http://127.0.0.1:8101 --model "$M/$name" \
            --random-input-len 32 --random-output-len 128 --num-prompts "$n" \
            --max-concurrency "$c" --warmup-requests 1 --seed "$seed" --no-progress \
            --output-json "$OUT/$name-c$c.json" | grep -E 'Output token throughput|Median TPOT|Median TTFT'
    done
    kill $PID; wait $PID 2>/dev/null || true
done
