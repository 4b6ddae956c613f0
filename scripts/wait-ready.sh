#!/usr/bin/env bash
# Waits up to 60 s for an OpenAI-compatible server on 127.0.0.1:PORT to answer /health.
# Usage: scripts/wait-ready.sh PORT
for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && exit 0
    sleep 0.1
done
echo "server on port $1 did not come up" >&2
exit 1
