#!/usr/bin/env bash
# Runs Tessera's CUDA checks on a GPU machine that has no Rust toolchain (docs/cuda-notes.md).
#
# Here (with cargo):   scripts/gpu-check.sh build   -> gpu-bin/ (stripped test, bench and server
#                                                     binaries) and gpu-model/{a,b}: the binaries
#                                                     and the default model in two carries (one
#                                                     call carries at most 64 MiB with the tree)
# There (GPU machine): scripts/gpu-check.sh run kernels   kernel tests vs the CPU, memcheck,
#                                                          ceilings and kernel timings
#                      scripts/gpu-check.sh run model     model tests vs the CPU, greedy text,
#                                                          serving (the openai client's checks,
#                                                          tessera-bench) on the default model
#                                                          and a synthetic 8B Q4_0
# Here (dry run):      scripts/gpu-check.sh run all      the same; GPU parts fail fast without one
#
# Every log goes to $OUT (or gpu-out/); a summary table is printed last. Each stage has its own
# timeout, so one hang cannot eat the machine's lease. TESSERA_REQUIRE_GPU makes the tests fail,
# not skip, when the device is unusable.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/gpu-bin"
MODEL_PARTS="$ROOT/gpu-model"
cd "$ROOT"

build() {
    set -e
    rm -rf "$BIN" && mkdir -p "$BIN"
    # Each crate has one integration-test binary; its CUDA tests are the cuda_* modules.
    for crate in kernels engine; do
        exe=$(cargo test --release -p "tessera-$crate" --test it --no-run --message-format=json 2>/dev/null |
              python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
        cp "$exe" "$BIN/$crate-tests"
    done
    exe=$(cargo bench -p tessera-kernels --bench cuda --no-run --message-format=json 2>/dev/null |
          python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
    cp "$exe" "$BIN/cuda-bench"
    cargo build --release -p tessera-server -p tessera-loadtest --bins
    cp target/release/tessera target/release/tessera-bench "$BIN/"
    strip "$BIN"/*
    scripts/fetch-default-model.sh
    # Two carries of at most ~58 MiB each (the tree beside them travels too): a = the binaries
    # (xz) and the model's first bytes, b = the rest of the model and its checksum.
    rm -rf "$MODEL_PARTS" && mkdir -p "$MODEL_PARTS/a" "$MODEL_PARTS/b"
    tar -C "$BIN" -cf - . | xz -T0 -6 >"$MODEL_PARTS/a/bin.tar.xz"
    local m=models/SmolLM2-135M-Instruct.Q4_1.gguf first
    first=$(( (58 << 20) - $(stat -c %s "$MODEL_PARTS/a/bin.tar.xz") ))
    head -c "$first" "$m" >"$MODEL_PARTS/a/part"
    tail -c +"$((first + 1))" "$m" >"$MODEL_PARTS/b/part"
    sha256sum "$m" | cut -d' ' -f1 >"$MODEL_PARTS/b/sha256"
    du -sh "$BIN" "$MODEL_PARTS"/*
}

# NVRTC, the CUDA headers and cuBLAS: the PyTorch venv's CUDA 13 wheels, else the toolkit, else
# .venv-cuda (here); the driver's libcuda from the loader path or /usr/local/nvidia.
cuda_env() {
    local nv d
    nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
    for d in "$nv/cu13" /usr/local/cuda "$ROOT/.venv-cuda/nvidia/cu13"; do
        if [[ -f "$d/include/cuda_bf16.h" ]]; then
            export TESSERA_CUDA_INCLUDE="$d/include"
            export LD_LIBRARY_PATH="$d/lib:$d/lib64:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            break
        fi
    done
    export TESSERA_REQUIRE_NVRTC=1 TESSERA_REQUIRE_GPU=1 TESSERA_CUDA_CACHE="${TMPDIR:-/tmp}/tessera-cuda-cache"
    echo "headers: ${TESSERA_CUDA_INCLUDE:-none}"
    ls "${TESSERA_CUDA_INCLUDE:-/nonexistent}/../lib" 2>/dev/null | grep -E 'nvrtc|cublas' | head -5
}

OUTDIR="${OUT:-$ROOT/gpu-out}"
SUMMARY="$OUTDIR/summary.txt"
# stage NAME LOG SECONDS CMD...: runs CMD with a timeout, appends its output to LOG (and leaves
# it in /tmp/stage.out), records the outcome and the time in the summary.
stage() {
    local name=$1 log=$2 secs=$3 start rc
    shift 3
    start=$(date +%s.%N)
    echo "=== $name: $*" >>"$OUTDIR/$log"
    timeout --kill-after=10 "$secs" "$@" >/tmp/stage.out 2>&1
    rc=$?
    cat /tmp/stage.out >>"$OUTDIR/$log"
    printf '%-34s rc=%-3s %6.1f s  (%s)\n' "$name" "$rc" "$(awk "BEGIN{print $(date +%s.%N) - $start}")" "$log" | tee -a "$SUMMARY"
    return $rc
}

kernels_phase() {
    stage "kernel tests vs CPU" kernels.log 120 "$BIN/kernels-tests" --test-threads=4 cuda_
    # The libtest summary lines, for the notes.
    grep -E '^test result|FAILED|panicked' /tmp/stage.out | head -20 | tee -a "$SUMMARY"
    stage "ceilings + kernel timings" bench.log 120 "$BIN/cuda-bench"
    if command -v compute-sanitizer >/dev/null; then
        stage "memcheck kernel tests" kernels.log 110 compute-sanitizer --tool memcheck --error-exitcode 9 \
            "$BIN/kernels-tests" --test-threads=1 cuda_ops:: cuda_attention:: cuda_linear::
        grep -E 'ERROR SUMMARY|^test result' /tmp/stage.out | tail -3 | tee -a "$SUMMARY"
    fi
}

http_get() {
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

# serve_bench NAME MODEL: tessera serve --device cuda, then tessera-bench at concurrency 1 and 32.
serve_bench() {
    local name=$1 model=$2 port=8391 pid i
    "$BIN/tessera" serve --model "$model" --device cuda --port "$port" --kv-cache-memory 8GB >>"$OUTDIR/serve.log" 2>&1 &
    pid=$!
    for i in $(seq 1 90); do
        http_get "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "$name: server exited (serve.log)" | tee -a "$SUMMARY"; return 1
    fi
    echo "$name: server up after ${i}s" | tee -a "$SUMMARY"
    # The official openai client's checks (server/tests/python/openai_client.py), from wheels
    # carried in .whl/ (the GPU machine cannot reach PyPI).
    if [[ $name == default && -d "$ROOT/.whl" ]]; then
        stage "openai client (python)" serve.log 90 bash -c "python3 -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/site $ROOT/.whl/*.whl && PYTHONPATH=/tmp/site python3 \
            $ROOT/server/tests/python/openai_client.py http://127.0.0.1:$port/v1 SmolLM2-135M-Instruct.Q4_1"
    fi
    for c in 1 32; do
        stage "$name bench c=$c" serve.log 60 "$BIN/tessera-bench" --port "$port" --model "$model" \
            --random-input-len 256 --random-output-len 128 --num-prompts $((c == 1 ? 4 : 64)) \
            --max-concurrency "$c" --warmup-requests 2 --no-progress --max-duration 45
        grep -E 'Output token throughput|Mean TTFT|Mean TPOT|Successful requests|Failed requests' /tmp/stage.out | sed "s/^/  $name c=$c: /" | tee -a "$SUMMARY"
    done
    http_get "http://127.0.0.1:$port/metrics" 2>/dev/null | grep -E '^tessera_(requests|generation_tokens)' | head -6 >>"$OUTDIR/serve.log"
    kill "$pid"; wait "$pid" 2>/dev/null
}

model_phase() {
    local m=models/SmolLM2-135M-Instruct.Q4_1.gguf
    if [[ -f "$MODEL_PARTS/a/part" && -f "$MODEL_PARTS/b/part" && ! -f "$m" ]]; then
        mkdir -p models && cat "$MODEL_PARTS/a/part" "$MODEL_PARTS/b/part" >"$m"
    fi
    if [[ -f "$MODEL_PARTS/b/sha256" ]] && [[ "$(sha256sum "$m" | cut -d' ' -f1)" != "$(cat "$MODEL_PARTS/b/sha256")" ]]; then
        echo "default model: checksum mismatch" | tee -a "$SUMMARY"; return 1
    fi
    export TESSERA_TEST_MODEL="$ROOT/$m" TESSERA_MODEL="$ROOT/$m"
    stage "model tests vs CPU" model.log 150 "$BIN/engine-tests" --test-threads=2 --nocapture cuda_
    grep -E '^test result|FAILED|panicked|logits differ by|batched vs alone|greedy:' /tmp/stage.out | head -40 | tee -a "$SUMMARY"
    # Greedy text, GPU vs CPU (the same 64 tokens unless a near-tie: the model tests check that).
    local gen="$BIN/tessera generate --model $m --prompt 'The capital of France is' --max-tokens 64 --temperature 0"
    # The CPU's default path quantizes activations to 8 bits for GGUF blocks; `--compute float`
    # is the function the GPU computes (f32 activations over dequantized weights).
    stage "generate cpu" model.log 45 bash -c "$gen --device cpu >/tmp/gen-cpu.txt"
    stage "generate cpu --compute float" model.log 45 bash -c "$gen --device cpu --compute float >/tmp/gen-cpu-float.txt"
    stage "generate cuda" model.log 45 bash -c "$gen --device cuda >/tmp/gen-cuda.txt"
    for f in cpu cpu-float cuda; do echo "--- greedy text, $f:"; cat "/tmp/gen-$f.txt"; echo; done >>"$OUTDIR/model.log"
    for f in cpu cpu-float; do
        if cmp -s "/tmp/gen-$f.txt" /tmp/gen-cuda.txt; then echo "greedy text: cuda = $f"; else echo "greedy text: cuda != $f (model.log)"; fi
    done | tee -a "$SUMMARY"
    serve_bench default "$m"
    command -v nvidia-smi >/dev/null || { echo "no GPU: synthetic 8B skipped" | tee -a "$SUMMARY"; return 0; }
    stage "write synthetic 8B Q4_0" serve.log 120 "$BIN/tessera" convert random-llama --preset 8b --type q4_0 \
        --embedding-type q8_0 --tokenizer "$m" --output /tmp/llama8b-q4_0.gguf &&
        serve_bench 8b-q4_0 /tmp/llama8b-q4_0.gguf
}

case "${1:-}" in
build) build ;;
run)
    mkdir -p "$OUTDIR"
    : >"$SUMMARY"
    if [[ ! -x "$BIN/tessera" && -f "$MODEL_PARTS/a/bin.tar.xz" ]]; then
        mkdir -p "$BIN" && xz -dc "$MODEL_PARTS/a/bin.tar.xz" | tar -C "$BIN" -xf -
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
    cuda_env >/tmp/cuda-env.txt 2>&1   # not in a pipe: its exports must stay in this shell
    tee -a "$SUMMARY" </tmp/cuda-env.txt
    case "${2:-all}" in
    kernels) kernels_phase ;;
    model) model_phase ;;
    all) kernels_phase; model_phase ;;
    *) echo "usage: $0 run kernels|model|all" >&2; exit 2 ;;
    esac
    echo "--- summary"; cat "$SUMMARY"
    ! grep -qE 'rc=[1-9]' "$SUMMARY"
    ;;
*) echo "usage: $0 build | run kernels|model|all" >&2; exit 2 ;;
esac
