#!/usr/bin/env bash
# Makes sure `buildah` and `debootstrap` (Debian's packages) are on PATH for
# scripts/container-test.sh, installing them with apt-get when missing (through sudo when not
# root). Fails when it cannot.
set -euo pipefail
missing=()
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if ((${#missing[@]})); then
    SUDO=()
    if [ "$(id -u)" != 0 ]; then SUDO=(sudo); fi
    echo "${missing[*]} missing; installing Debian's packages" >&2
    "${SUDO[@]}" apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq "${missing[@]}" >&2
fi
command -v buildah debootstrap
