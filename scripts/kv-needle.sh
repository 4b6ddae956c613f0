#!/usr/bin/env bash
# Needle retrieval through the server, per KV-cache format: a fact placed near the start of a
# long prompt (~DEPTH tokens of the corpus after it) is asked for at the end; greedy, 8 tokens.
# Prints one line per format: whether the answer contains the fact, and the answer.
#
#   scripts/kv-needle.sh [CORPUS_CHARS]   (default 6000 characters of filler, ~1.5k tokens)
#
# Environment: ONLY (an extended regex: run only the formats it matches, e.g. ONLY=qjl1).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN=${TESSERA_BIN:-$ROOT/target/release/tessera}
CORPUS=${CORPUS:-$ROOT/../shared/data/pride_and_prejudice.txt}
CHARS=${1:-6000}
PORT=8131
if [[ -n "${ONLY:-}" ]]; then
  rc=0; grep -Eq -- "$ONLY" </dev/null || rc=$?
  (( rc <= 1 )) || { echo "ONLY is not a valid extended regex: $ONLY" >&2; exit 2; }
fi
FORMATS=(f32 bf16 fp8_e4m3 int8 "k=qjl1,v=bf16" "k=qjl1-w0-s0,v=bf16" tq3_0 "k=bf16,v=tq3_0" hqmq-s96-r4 "k=hqmq-s96-r4-sink4,v=hqmq-s96-r4" hqmq-s192-r6-med3)
PROMPT=$(python3 - "$CORPUS" "$CHARS" <<'PY'
import json, sys
text = open(sys.argv[1], encoding="utf-8").read()[20000:20000 + int(sys.argv[2])]
prompt = ("The secret passphrase is \"blue pelican 4817\". Remember it.\n\n" + text +
          "\n\nQuestion: What is the secret passphrase mentioned at the start?\nAnswer: The secret passphrase is \"")
print(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}))
PY
)
for f in "${FORMATS[@]}"; do
  [[ -n "${ONLY:-}" ]] && ! grep -Eq -- "$ONLY" <<<"$f" && continue
  if [[ $f == k=* ]]; then
    k=${f%%,*}; v=${f##*,}
    flags=(--kv-cache-dtype-k "${k#k=}" --kv-cache-dtype-v "${v#v=}")
  else
    flags=(--kv-cache-dtype "$f")
  fi
  "$BIN" serve --port $PORT --served-model-name m --kv-cache-memory 512MiB "${flags[@]}" >/tmp/kv-needle-server.log 2>&1 &
  pid=$!
  "$ROOT/scripts/wait-ready.sh" $PORT
  answer=$(curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' -d "$PROMPT" |
    python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["choices"][0]["text"].replace("\n"," "), "|", r["usage"]["prompt_tokens"], "prompt tokens")')
  kill "$pid"; wait "$pid" 2>/dev/null || true
  if [[ $answer == *4817* ]]; then ok=found; else ok=MISSED; fi
  printf '| %s | %s | %s |\n' "$f" "$ok" "$answer"
done
