#!/usr/bin/env bash
# Coverage-guided fuzzing of Tessera's untrusted inputs with cargo fuzz (libFuzzer).
#
#   scripts/fuzz.sh list                      the targets
#   scripts/fuzz.sh run TARGET [SECONDS]      fuzz one target (default 300 s) from its corpus
#   scripts/fuzz.sh runs TARGET N             fuzz one target for N executions
#   scripts/fuzz.sh all [SECONDS]             every target in turn, then merge and minimize
#                                             each corpus (fuzz/corpus/<target>/)
#   scripts/fuzz.sh minimize TARGET           merge-minimize one target's corpus in place
#   scripts/fuzz.sh build                     build the fuzz targets only
#
# Environment: FUZZ_SANITIZER (none | address; default none: the targets are safe Rust over
# parsers, and without ASan they run about twice as fast), FUZZ_ARGS (extra libFuzzer flags),
# FUZZ_RSS_MB (memory limit, default 2048), FUZZ_TIMEOUT (seconds per input before a hang
# is reported, default 10), FUZZ_KEEP (inputs per target that minimize commits, default 60).
#
# The ordinary test suite replays the stored corpora without libFuzzer (engine/tests/it/fuzz_corpus.rs,
# server/tests/e2e/fuzz_corpus.rs). A crash leaves its input in fuzz/artifacts/<target>/: fix the
# bug, add a regression test, and keep the input in fuzz/regressions/<target>/.
# The stable toolchain stands in for nightly (RUSTC_BOOTSTRAP=1); one fuzzer runs at a time
# (one process: no -jobs/-fork) on the 2-core machines. The tokenizer_decode and openai_request targets use the
# default model's tokenizer: scripts/fetch-default-model.sh fetches it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export RUSTC_BOOTSTRAP=1
TARGETS=(gguf hf_checkpoint tokenizer_decode openai_request chat_template)
SAN="${FUZZ_SANITIZER:-none}"
RSS="${FUZZ_RSS_MB:-2048}"
TIMEOUT="${FUZZ_TIMEOUT:-10}"

ensure_cargo_fuzz() {
  if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
  fi
}

ensure_model() {
  case "$1" in
    tokenizer_decode | openai_request) scripts/fetch-default-model.sh >/dev/null ;;
  esac
}

build() {
  ensure_cargo_fuzz
  cargo fuzz build --sanitizer "$SAN" "$@"
}

# fuzz TARGET LIBFUZZER_FLAGS...: runs from the stored corpus (new inputs go to
# fuzz/target/corpus/<target>/ until a merge brings the interesting ones back).
fuzz() {
  local target="$1"
  shift
  ensure_model "$target"
  local work="fuzz/target/corpus/$target"
  mkdir -p "$work" "fuzz/artifacts/$target"
  # shellcheck disable=SC2086
  cargo fuzz run --sanitizer "$SAN" "$target" "$work" "fuzz/corpus/$target" -- \
    -rss_limit_mb="$RSS" -timeout="$TIMEOUT" -print_final_stats=1 \
    -artifact_prefix="fuzz/artifacts/$target/" "$@" ${FUZZ_ARGS:-}
}

minimize() {
  local target="$1"
  ensure_model "$target"
  local work="fuzz/target/corpus/$target"
  local fresh="fuzz/target/merged/$target"
  rm -rf "$fresh"
  mkdir -p "$fresh" "$work"
  cargo fuzz run --sanitizer "$SAN" "$target" "$fresh" "fuzz/corpus/$target" "$work" -- \
    -merge=1 -rss_limit_mb="$RSS" -timeout="$TIMEOUT"
  # Seeds keep their names; of the rest of what the merge kept, the FUZZ_KEEP smallest
  # inputs are committed (the replay run in CI stays short and the repository small; the
  # whole corpus stays in fuzz/target/corpus/ for the next long run).
  find "fuzz/corpus/$target" -type f ! -name 'seed-*' -delete
  find "$fresh" -type f -printf '%s %p\n' | sort -n >"$fresh.sizes"
  head -n "${FUZZ_KEEP:-60}" "$fresh.sizes" | cut -d' ' -f2- |
    while read -r f; do
      [ -e "fuzz/corpus/$target/$(basename "$f")" ] || cp "$f" "fuzz/corpus/$target/"
    done
  ls "fuzz/corpus/$target" | wc -l | xargs echo "$target corpus files:"
}

case "${1:-}" in
  list) printf '%s\n' "${TARGETS[@]}" ;;
  build) build ;;
  run) build; fuzz "$2" -max_total_time="${3:-300}" ;;
  runs) build; fuzz "$2" -runs="$3" ;;
  minimize) build; minimize "$2" ;;
  all)
    build
    for t in "${TARGETS[@]}"; do fuzz "$t" -max_total_time="${2:-300}"; done
    for t in "${TARGETS[@]}"; do minimize "$t"; done
    ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
