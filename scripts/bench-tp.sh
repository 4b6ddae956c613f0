#!/usr/bin/env bash
# Tensor parallelism side by side: `tessera bench` at --tensor-parallel-size 1 and 2, rounds
# alternating, on the default model and on a random 1B Llama (Q4_1, 659 MiB: beyond the cache),
# written by `tessera convert random-llama` when missing. Prints each run's table (tokens/s and,
# for two ranks, each rank's share of the time inside collectives). Run on a quiet machine:
# ranks spin-wait for each other, so a core taken by another process stalls both.
#   scripts/bench-tp.sh [ROUNDS]    (docs/benchmarks/tensor-parallel.md)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROUNDS="${1:-3}"
B="$ROOT/target/release/tessera"
[ -x "$B" ] || cargo build --release -p tessera-server --manifest-path "$ROOT/Cargo.toml"
ONE_B="${TMPDIR:-/tmp}/tessera-random-1b-q4_1.gguf"
[ -f "$ONE_B" ] || "$B" convert random-llama --preset 1b --type q4_1 --output "$ONE_B"
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) CPUs; commit $(git -C "$ROOT" rev-parse --short HEAD); $(date -u +%F)"
for round in $(seq "$ROUNDS"); do
    for tp in 1 2; do
        echo "=== round $round, default model, --tp $tp"
        "$B" bench --tp "$tp" -p 512 -n 64 -r 2 2>/dev/null | grep -E '^\| (pp|tg)'
        "$B" bench --tp "$tp" -p 0 -n 64 -b 8 -r 2 2>/dev/null | grep -E '^\| (pp|tg)'
        echo "=== round $round, random 1B Q4_1, --tp $tp"
        "$B" bench --model "$ONE_B" --tp "$tp" -p 128 -n 32 -r 1 2>/dev/null | grep -E '^\| (pp|tg)'
    done
done
