#!/usr/bin/env bash
# Builds deploy/Dockerfile's runtime stage around a tessera binary built here, runs the image and
# sends it a completion; no registry and no Docker engine needed. The e2e test
# `deploy::the_container_image_serves_a_completion` runs it with the binary the tests built.
#
#   scripts/container-test.sh [BINARY]      (default: target/release/tessera)
#
# 1. The base image: Debian bookworm from Debian's mirror (`debootstrap --variant=minbase`),
#    cached as a tarball under ~/.cache/tessera/container-base/, imported into buildah and tagged
#    with the name deploy/Dockerfile's RUNTIME_IMAGE names (debian:bookworm-slim), so the build
#    pulls nothing.
# 2. The image: `buildah bud` of deploy/Dockerfile itself with ARTIFACTS=prebuilt and the binary
#    and model as the prebuilt-out build context (the Rust build stage is skipped); the runtime
#    stage runs as written (apt-get install ca-certificates from the mirror, useradd).
# 3. The container: the image's ENTRYPOINT and CMD with the CMD's --port value replaced by a free
#    port (what `docker run -p PORT:8000` maps), run by `buildah run --isolation chroot` (the
#    image's USER and ENV apply) on the host's network. Checks: /health answers 200, the server
#    process runs as the image's uid, a greedy /v1/completions answers in full, SIGTERM stops
#    it with status 0. Prints one JSON line: the server's uid and gid, the image's USER, the
#    completion request and response, and the exit status.
#
# Runs as root. Installs buildah and debootstrap with apt-get when missing
# (scripts/ensure-container-tools.sh). Everything buildah makes (the imported base, the image,
# the container) lives in a temporary storage root, removed on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$(realpath "${1:-$ROOT/target/release/tessera}")"
cd "$ROOT"
scripts/fetch-default-model.sh
MODEL="$(realpath "${TESSERA_MODELS_DIR:-models}/SmolLM2-135M-Instruct.Q4_1.gguf")"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKERFILE=deploy/Dockerfile
IMAGE=localhost/tessera:container-test
[[ -x "$BIN" ]] || { echo "error: no tessera binary at $BIN" >&2; exit 1; }
# The base image's name, as the Dockerfile's build argument defaults it.
BASE_IMAGE="$(sed -n 's/^ARG RUNTIME_IMAGE=//p' "$DOCKERFILE")"
[[ -n "$BASE_IMAGE" ]] || { echo "error: no ARG RUNTIME_IMAGE in $DOCKERFILE" >&2; exit 1; }
SUITE="$(sed -n 's/^debian:\([a-z]*\).*/\1/p' <<<"$BASE_IMAGE")"
[[ -n "$SUITE" ]] || { echo "error: RUNTIME_IMAGE $BASE_IMAGE is not a Debian image" >&2; exit 1; }

[[ "$(id -u)" == 0 ]] || { echo "error: run as root (buildah's storage, debootstrap and chroot need it)" >&2; exit 1; }
scripts/ensure-container-tools.sh >/dev/null

# Removes DIR unless something is mounted below it (debootstrap's /proc, a layer): rm -rf would
# reach through the mount.
remove_unmounted() {
    if grep -q " $1/" /proc/self/mountinfo; then
        echo "warning: mounts left under $1; not removing it" >&2
    else
        rm -rf "$1"
    fi
}

# 1. The base root filesystem, made once (one maker at a time).
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tessera/container-base"
BASE_TAR="$CACHE/debian-$SUITE-minbase.tar"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [[ ! -f "$BASE_TAR" ]]; then
    echo "debootstrap --variant=minbase $SUITE ($MIRROR) into $BASE_TAR" >&2
    rootfs="$(mktemp -d -p "$CACHE" rootfs.XXXXXX)"
    if ! debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1; then
        tail -n 20 "$rootfs.log" >&2
        remove_unmounted "$rootfs"
        rm -f "$rootfs.log"
        exit 1
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -cf "$BASE_TAR.part" .
    mv "$BASE_TAR.part" "$BASE_TAR"
    remove_unmounted "$rootfs"
    rm -f "$rootfs.log"
fi
flock -u 9

STORE="$(mktemp -d -p "${TMPDIR:-/var/tmp}" tessera-container-test.XXXXXX)"
B=(buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver vfs)
cleanup() {
    "${B[@]}" rm --all >/dev/null 2>&1 || true
    "${B[@]}" rmi --all --force >/dev/null 2>&1 || true
    remove_unmounted "$STORE"
}
trap cleanup EXIT

echo "importing the base as $BASE_IMAGE" >&2
ctr="$("${B[@]}" from scratch)"
tar -C "$("${B[@]}" mount "$ctr")" -xf "$BASE_TAR"
"${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash "$ctr"
"${B[@]}" commit --quiet "$ctr" "$BASE_IMAGE" >/dev/null
"${B[@]}" rm "$ctr" >/dev/null

# 2. The image, from the Dockerfile's runtime stage with the prebuilt binary and model.
mkdir -p "$STORE/prebuilt/models"
cp "$BIN" "$STORE/prebuilt/tessera"
cp "$MODEL" "$STORE/prebuilt/models/"
echo "buildah bud $DOCKERFILE (ARTIFACTS=prebuilt)" >&2
# The build context is the prebuilt directory: with ARTIFACTS=prebuilt no stage that is built
# reads the main context (only the skipped build stage copies the repository).
"${B[@]}" bud --quiet --pull=never --isolation chroot --build-arg ARTIFACTS=prebuilt \
    --build-context prebuilt-out="$STORE/prebuilt" -f "$DOCKERFILE" -t "$IMAGE" "$STORE/prebuilt" >&2

# 3. Run it and talk to it.
ctr="$("${B[@]}" from --pull=never "$IMAGE")"
"${B[@]}" inspect --type image "$IMAGE" >"$STORE/image.json"
python3 - "$STORE/image.json" "${B[@]}" run --isolation chroot "$ctr" -- <<'PY'
import json, os, signal, socket, subprocess, sys, time, urllib.request

config = json.load(open(sys.argv[1]))["OCIv1"]["config"]
run = sys.argv[2:]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cmd = list(config["Cmd"])
assert "--port" in cmd, f"the image's CMD sets no --port: {cmd}"
cmd[cmd.index("--port") + 1] = str(port)
argv = config["Entrypoint"] + cmd
print(f"running {argv} as {config.get('User')}", file=sys.stderr)
log = open(os.path.join(os.path.dirname(sys.argv[1]), "serve.log"), "w+")
proc = subprocess.Popen(run + argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
base = f"http://127.0.0.1:{port}"


def fail(msg):
    log.seek(0)
    print(f"error: {msg}\nthe container's output ends:\n" + "".join(log.readlines()[-30:]), file=sys.stderr)
    # The server first: killing `buildah run` alone would leave it running.
    if (pid := server_pid()) is not None:
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    sys.exit(1)


def server_pid():
    """The tessera process under `buildah run` (its descendant whose executable is tessera)."""
    parent = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(p)] = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    for pid in parent:
        up = pid
        while up in parent and up != proc.pid:
            up = parent[up]
        try:
            if up == proc.pid and os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "tessera":
                return pid
        except OSError:
            pass
    return None


deadline = time.monotonic() + 300
while True:
    if proc.poll() is not None:
        fail(f"the container exited with {proc.returncode} before /health answered")
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        fail("/health did not answer 200 within 300 s")
    time.sleep(0.5)

pid = server_pid()
if pid is None:
    fail("no tessera process under buildah run")
status = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status").read().splitlines() if ":" in l)
uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])

env = dict(e.split("=", 1) for e in config["Env"])
model = os.path.basename(env["TESSERA_MODEL"]).removesuffix(".gguf")
body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}
req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as r:
        completion = json.load(r)
except OSError as e:
    fail(f"/v1/completions failed: {e}")
if completion.get("usage", {}).get("completion_tokens") != 8 or completion["choices"][0]["finish_reason"] != "length":
    fail(f"unexpected completion: {completion}")

os.kill(pid, signal.SIGTERM)
try:
    code = proc.wait(timeout=60)
except subprocess.TimeoutExpired:
    fail("the server did not exit within 60 s of SIGTERM")
if code != 0:
    fail(f"the container exited with {code} after SIGTERM")
print(json.dumps({"uid": uid, "gid": gid, "user": config.get("User"), "request": body, "completion": completion, "exit": code}))
PY
