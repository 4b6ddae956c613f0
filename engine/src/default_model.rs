//! Where the project's default model lives: the one place the CLI, the load tester, the tests
//! and the fuzz targets resolve it from (`scripts/fetch-default-model.sh` puts it there).

use std::path::{Path, PathBuf};

/// File name of the default model.
pub const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the default model is fetched to: `$TESSERA_MODELS_DIR` (default: `models/` at the
/// repository root) joined with [`FILE`].
pub fn fetched() -> PathBuf {
    let dir = std::env::var_os("TESSERA_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
    dir.join(FILE)
}

/// The model the tests run: `$TESSERA_TEST_MODEL` when set (test binaries run on another
/// machine), else [`fetched`]. Panics with the fix when it is missing: the README's test
/// command fetches it first.
pub fn for_tests() -> PathBuf {
    let p = std::env::var_os("TESSERA_TEST_MODEL").map(PathBuf::from).unwrap_or_else(fetched);
    assert!(p.exists(), "default model missing at {}: run scripts/fetch-default-model.sh (the test command does)", p.display());
    p
}
