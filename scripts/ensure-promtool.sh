#!/usr/bin/env bash
# Makes sure `promtool` (Prometheus' checker, from Debian's `prometheus` package) is on PATH,
# installing it with apt-get when missing (through sudo when not root). Fails when it cannot.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1; then
    SUDO=()
    if [ "$(id -u)" != 0 ]; then SUDO=(sudo); fi
    echo "promtool missing; installing Debian's prometheus package" >&2
    "${SUDO[@]}" apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends prometheus >&2
fi
command -v promtool
