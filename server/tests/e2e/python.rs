//! The official `openai` Python client (installed from PyPI into .venv-test/ by
//! scripts/python-env.sh) against the shared server.

use crate::harness::shared;
use std::path::Path;
use std::process::{Command, Stdio};

/// Runs `server/tests/python/<script>` with the shared server's URL and model; it must pass.
fn run_script(script: &str) {
    run_script_on(shared(), script);
}

/// Runs `server/tests/python/<script>` against `s`; it must pass.
pub fn run_script_on(s: &crate::harness::Server, script: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let env = Command::new(root.join("scripts/python-env.sh")).stderr(Stdio::inherit()).output().expect("running scripts/python-env.sh");
    assert!(env.status.success(), "the Python test environment could not be made");
    let python = String::from_utf8(env.stdout).unwrap().trim().to_owned();
    let out = Command::new(python)
        .arg(root.join("server/tests/python").join(script))
        .args([s.url("/v1"), "SmolLM2-135M-Instruct.Q4_1".into()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_openai_python_client_works() {
    run_script("openai_client.py");
}

#[test]
fn tool_calls_round_trip_with_the_openai_client() {
    run_script("tool_calls.py");
}

#[test]
fn structured_outputs_parse_with_the_openai_client() {
    run_script("structured_outputs.py");
}

#[test]
fn the_responses_api_works_with_the_openai_client() {
    run_script("responses_api.py");
}
