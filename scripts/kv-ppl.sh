#!/usr/bin/env bash
# Perplexity of a model (the default one unless MODEL says) with every KV-cache format, at ctx
# 1024 and 2048 (unless CTXS says), on the project's corpus (llama.cpp's method: second half of each window scored). Prints a markdown
# table: PPL, delta vs bf16 KV (bf16 runs first), KV bytes per token, compression vs bf16.
#
#   scripts/kv-ppl.sh [CHUNKS_AT_1024]        (default 12; ctx 2048 uses half as many windows)
#
# Environment: MODEL (a model path; default $TESSERA_MODEL, else the default model), CTXS
# (default "1024 2048"), ONLY (an extended regex: run only the formats whose flags match it;
# bf16 always runs), CORPUS (another text, e.g. one of scripts/heldout-texts.sh's).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TESSERA_BIN:-target/release/tessera}
CORPUS=${CORPUS:-../shared/data/pride_and_prejudice.txt}
CHUNKS=${1:-12}
MODEL_FLAGS=()
[[ -n "${MODEL:-}" ]] && MODEL_FLAGS=(--model "$MODEL")
if [[ -n "${ONLY:-}" ]]; then
  rc=0; grep -Eq -- "$ONLY" </dev/null || rc=$?
  (( rc <= 1 )) || { echo "ONLY is not a valid extended regex: $ONLY" >&2; exit 2; }
fi
FORMATS=(
  "--kv-cache-dtype bf16"
  "--kv-cache-dtype f32"
  "--kv-cache-dtype f16"
  "--kv-cache-dtype fp8_e4m3"
  "--kv-cache-dtype int8"
  "--kv-cache-dtype-k qjl1 --kv-cache-dtype-v bf16"
  "--kv-cache-dtype-k qjl1-w0-s0 --kv-cache-dtype-v bf16"
  "--kv-cache-dtype tq3_0"
  "--kv-cache-dtype-k tq3_0 --kv-cache-dtype-v bf16"
  "--kv-cache-dtype-k bf16 --kv-cache-dtype-v tq3_0"
  "--kv-cache-dtype hqmq-s24-r3"
  "--kv-cache-dtype hqmq-s96-r4"
  "--kv-cache-dtype-k hqmq-s96-r4-sink4 --kv-cache-dtype-v hqmq-s96-r4"
  "--kv-cache-dtype hqmq-s96-r6-med3"
  "--kv-cache-dtype hqmq-s192-r6-med3"
  "--kv-cache-dtype-k hqmq-s192-r6-med3-sink4 --kv-cache-dtype-v hqmq-s192-r6-med3"
)
for ctx in ${CTXS:-1024 2048}; do
  chunks=$(( CHUNKS * 1024 / ctx ))
  echo
  echo "ctx $ctx, $chunks windows"
  echo
  echo "| KV cache | bytes/token | vs bf16 | PPL | delta vs bf16 |"
  echo "|---|---|---|---|---|"
  base=""
  for f in "${FORMATS[@]}"; do
    if [[ -n "${ONLY:-}" && "$f" != "--kv-cache-dtype bf16" ]] && ! grep -Eq -- "$ONLY" <<<"$f"; then
      continue
    fi
    # shellcheck disable=SC2086
    out=$(RUST_LOG=${RUST_LOG:-info} "$BIN" perplexity ${MODEL_FLAGS[@]+"${MODEL_FLAGS[@]}"} --file "$CORPUS" --ctx "$ctx" --chunks "$chunks" $f 2>&1)
    ppl=$(sed -n 's/^Final estimate: PPL = \([0-9.]*\) .*/\1/p' <<<"$out")
    # The KV-cache pool's log line: kv_cache=NAME (BYTES bytes/token, RATIOx smaller than bf16...),
    # or RATIOx larger for a cache bigger than bf16 (f32): the table shows bf16 / this either way.
    desc=$(sed 's/\x1b\[[0-9;]*m//g' <<<"$out" | sed -n 's/.*kv_cache=\(.*\) (\([0-9.]*\) bytes\/token, \([0-9.]*\)x \(smaller\|larger\) than bf16.*/\1|\2|\3|\4/p' | head -1)
    if [[ -z "$ppl" || -z "$desc" ]]; then
      echo "no perplexity or KV-cache log line from: $BIN perplexity ... $f (RUST_LOG must show info)" >&2
      exit 1
    fi
    IFS='|' read -r name bpt ratio way <<<"$desc"
    [[ "$way" == "larger" ]] && ratio=$(awk -v r="$ratio" 'BEGIN{printf "%.2f", 1/r}')
    [[ "$name" == "bf16" ]] && base=$ppl
    delta=$(awk -v p="$ppl" -v b="$base" 'BEGIN{printf "%+.2f%%", (p/b-1)*100}')
    echo "| $name | $bpt | ${ratio}x | $ppl | $delta |"
  done
done
