//! `--device`: a bad value is refused by name; `cuda` without an NVIDIA driver fails with a clear
//! error (the CI case), and with one, `generate --device cuda` runs (its logits are compared
//! with the CPU's in the engine's `cuda_model` test).

use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const PROMPT: &[&str] = &["generate", "--prompt", "The capital of France is", "--max-tokens", "12", "--temperature", "0"];

#[test]
fn unknown_devices_are_refused_by_name() {
    for cmd in [PROMPT, &["serve"]] {
        let out = tessera(&[cmd, &["--device", "tpu"]].concat());
        assert!(!out.status.success());
        assert!(stderr(&out).contains("unknown device 'tpu': expected cpu, cuda or cuda:N"), "{}", stderr(&out));
    }
}

#[test]
fn cuda_generates_or_says_why_it_cannot() {
    let cuda = tessera(&[PROMPT, &["--device", "cuda"]].concat());
    if !tessera_kernels::cuda::driver_available() {
        assert!(!cuda.status.success());
        assert!(stderr(&cuda).contains("libcuda was not found"), "{}", stderr(&cuda));
        let serve = tessera(&["serve", "--device", "cuda:0"]);
        assert!(!serve.status.success());
        assert!(stderr(&serve).contains("libcuda was not found"), "{}", stderr(&serve));
        return;
    }
    assert!(cuda.status.success(), "{}", stderr(&cuda));
    assert!(stderr(&cuda).contains("device: "), "{}", stderr(&cuda));
    assert!(!String::from_utf8_lossy(&cuda.stdout).trim().is_empty());
}
