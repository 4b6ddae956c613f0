#!/usr/bin/env bash
# Tessera replicas behind a router from PyPI (in .venv-test/): vLLM's router (ROUTER=vllm-router,
# the default) or SGLang's gateway (ROUTER=smg), measured with tessera-bench:
# throughput against the number of replicas, and the prefix-cache hit rate with the router's
# round-robin policy against its cache-aware one, on a workload of GROUPS system prompts shared
# by QUESTIONS requests each (interleaved). Loopback only. Writes one line per run to stdout and
# the bench JSONs to $OUT (default /tmp/tessera-bench-routers).
#
#   scripts/bench-routers.sh                  # replicas 1,2,3 x round_robin,cache_aware
#   REPLICAS="1 2" POLICIES=cache_aware THREADS=1 PREFIX_GROUPS=12 QUESTIONS=8 scripts/bench-routers.sh
#   ROUTER=smg scripts/bench-routers.sh
#
# THREADS is each replica's RAYON_NUM_THREADS (its compute threads); on a small machine give
# each replica a share of the cores, or replicas only fight over them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUTER="${ROUTER:-vllm-router}"
case "$ROUTER" in
    vllm-router) LAUNCH=(-m vllm_router.launch_router --log-level warning) ;;
    smg) LAUNCH=(-m smg launch --log-level warn) ;;
    *) echo "ROUTER must be vllm-router or smg, not $ROUTER" >&2; exit 1 ;;
esac
REPLICAS="${REPLICAS:-1 2 3}"
POLICIES="${POLICIES:-round_robin cache_aware}"
THREADS="${THREADS:-1}"
GROUPS_N="${PREFIX_GROUPS:-12}"
QUESTIONS="${QUESTIONS:-8}"
OUTPUT_LEN="${OUTPUT_LEN:-32}"
CONCURRENCY="${CONCURRENCY:-8}"
BASE_PORT="${BASE_PORT:-18200}"
OUT="${OUT:-/tmp/tessera-bench-routers}"
mkdir -p "$OUT"
PY="$(scripts/python-env.sh)"
cargo build --release --locked -p tessera-server -p tessera-loadtest >&2

# The workload: each group's prompt is a ~300-token system text of its own plus a question.
PROMPTS="$OUT/prompts.txt"
"$PY" - "$GROUPS_N" "$QUESTIONS" "$PROMPTS" <<'PY'
import random, sys
groups, questions, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = random.Random(7)
words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu".split()
lines = []
for g in range(groups):
    system = f"System prompt {g}: " + " ".join(rng.choice(words) for _ in range(280)) + "."
    for q in range(questions):
        lines.append(f"{system} Question {q}: which word comes after {rng.choice(words)}?")
rng.shuffle(lines)
open(path, "w").write("\n".join(lines) + "\n")
PY
NUM=$((GROUPS_N * QUESTIONS))

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
scrape() { # sum of a counter over the replicas
    local total=0 v
    for ((i = 1; i <= $1; i++)); do
        v="$(curl -s "http://127.0.0.1:$((BASE_PORT + i))/metrics" | awk -v n="$2" '$1 == n {print $2}')"
        total="$(python3 -c "print($total + ${v:-0})")"
    done
    echo "$total"
}
wait_http() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "no answer from $1" >&2; return 1; }

for n in $REPLICAS; do
    for policy in $POLICIES; do
        pids=()
        urls=()
        for ((i = 1; i <= n; i++)); do
            port=$((BASE_PORT + i))
            RAYON_NUM_THREADS="$THREADS" target/release/tessera serve --port "$port" --kv-cache-memory 256MiB >"$OUT/replica$i.log" 2>&1 &
            pids+=($!)
            urls+=("http://127.0.0.1:$port")
        done
        for u in "${urls[@]}"; do wait_http "$u/health"; done
        "$PY" "${LAUNCH[@]}" --host 127.0.0.1 --port "$BASE_PORT" --policy "$policy" \
            --prometheus-host 127.0.0.1 --prometheus-port "$((BASE_PORT + 99))" \
            --health-check-interval-secs 5 --worker-urls "${urls[@]}" >"$OUT/$ROUTER.log" 2>&1 &
        pids+=($!)
        wait_http "http://127.0.0.1:$BASE_PORT/v1/models"
        q0="$(scrape "$n" tessera_prefix_cache_queries_total)"; h0="$(scrape "$n" tessera_prefix_cache_hits_total)"
        json="$OUT/$ROUTER-r$n-$policy.json"
        target/release/tessera-bench --base-url "http://127.0.0.1:$BASE_PORT" --dataset-name prompts --dataset-path "$PROMPTS" \
            --num-prompts "$NUM" --output-len "$OUTPUT_LEN" --max-concurrency "$CONCURRENCY" --no-progress \
            --output-json "$json" >"$OUT/$ROUTER-r$n-$policy.txt" 2>&1
        q1="$(scrape "$n" tessera_prefix_cache_queries_total)"; h1="$(scrape "$n" tessera_prefix_cache_hits_total)"
        ROUTER="$ROUTER" python3 - "$json" "$n" "$policy" "$THREADS" "$q0" "$q1" "$h0" "$h1" <<'PY'
import json, os, sys
path, n, policy, threads = sys.argv[1:5]
q0, q1, h0, h1 = map(float, sys.argv[5:9])
r = json.load(open(path))
def find(d, *names):
    for k in names:
        if k in d: return d[k]
    for v in d.values():
        if isinstance(v, dict):
            x = find(v, *names)
            if x is not None: return x
    return None
print(json.dumps({
    "router": os.environ["ROUTER"], "replicas": int(n), "policy": policy, "threads_per_replica": int(threads),
    "completed": find(r, "completed"), "failed": find(r, "failed"),
    "output_tok_s": find(r, "output_throughput"), "req_s": find(r, "request_throughput"),
    "mean_ttft_ms": (r.get("ttft_ms") or {}).get("mean"), "p99_ttft_ms": (r.get("ttft_ms") or {}).get("p99"),
    "prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None,
}))
PY
        cleanup
        wait 2>/dev/null || true
    done
done
