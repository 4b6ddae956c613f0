//! A checkpoint made by Tessera's own tools (the default model converted with `tessera convert
//! gguf-to-hf`, then quantized to W4A8 with `tessera quantize`, calibrated: SmoothQuant and
//! GPTQ, with the output head in int8) served end to end: the plan in `/v1/models`, the plan metric, the startup log, and
//! completions. Also the group size `quantize --scheme w4a16` picks for the model's widths.

use crate::harness::{model_path, Server};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

/// Runs the `tessera` binary with `args`, failing the test with its stderr on error; its stdout.
fn tessera(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().unwrap();
    assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn quantized_checkpoint_serves_with_its_plan() {
    let dir = std::env::temp_dir().join(format!("tessera-e2e-quant-{}", std::process::id()));
    let (bf16, w4a8) = (dir.join("bf16"), dir.join("w4a8"));
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    tessera(&["convert", "gguf-to-hf", "--input", model_path().to_str().unwrap(), "--output", &s(&bf16)]);
    // Calibration text from the middle of the corpus.
    let corpus = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/data/pride_and_prejudice.txt")).unwrap();
    let calibration = dir.join("calibration.txt");
    std::fs::write(&calibration, &corpus[300_000..330_000]).unwrap();
    let quantize = ["quantize", "--input", &s(&bf16), "--output", &s(&w4a8), "--scheme", "w4a8", "--smoothquant", "0.5", "--gptq", "--lm-head", "w8a8-int8"];
    // Rounding to nearest and GPTQ exclude each other.
    let refused = Command::new(env!("CARGO_BIN_EXE_tessera")).args([&quantize[..], &["--rtn"]].concat()).output().unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("cannot be used with '--rtn'"), "{stderr}");
    let stdout = tessera(&[&quantize[..], &["--calibration", &s(&calibration), "--calibration-tokens", "1024"]].concat());
    assert!(stdout.contains("calibrated on 1024 tokens in 1 sequence(s)"), "{stdout}");
    // W4A16 without --group-size: the default model's 576-wide inputs take groups of 64, not
    // a short last group of 128, and the command says why.
    let w4a16 = dir.join("w4a16");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(["quantize", "--input", &s(&bf16), "--output", &s(&w4a16), "--scheme", "w4a16", "--rtn"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("group size 64:") && stdout.contains("576 columns wide"), "{stdout}");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(w4a16.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"], 64, "{config}");
    let server = Server::start(&["--model", &s(&w4a8)]);
    std::fs::remove_dir_all(&dir).unwrap(); // mapped files stay readable

    let (status, body) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let m = &serde_json::from_str::<Value>(&body).unwrap()["data"][0];
    assert!(m["quantization_config"].as_str().unwrap().starts_with("quark"), "{}", m["quantization_config"]);
    let plan = m["plan"].as_array().unwrap();
    let tp = m["tensor_parallel_size"].as_u64().unwrap() as usize;
    assert_eq!(plan.len(), (30 * 7 + 1) * tp);
    for row in plan.iter().filter(|r| r["tensor"] != "output.weight") {
        assert_eq!(row["storage"], "int4 channel sym", "{row}");
        assert_eq!(row["activations"], "int8/token", "{row}");
        assert!(row["scheme"].as_str().unwrap().contains("W4A8"), "{row}");
        assert!(row["kernel"].as_str().unwrap().starts_with("cpu.w4a8.int4xint8."), "{row}");
        assert!(row["note"].as_str().unwrap().contains("int8 per token"), "{row}");
    }
    // The tied output head, untied and quantized by `--lm-head w8a8-int8`.
    let head = &plan[210];
    assert_eq!((head["tensor"].as_str(), head["storage"].as_str(), head["activations"].as_str()), (Some("output.weight"), Some("int8 channel"), Some("int8/token")), "{head}");
    assert!(head["scheme"].as_str().unwrap().contains("W8A8-int8"), "{head}");

    let metrics = server.metrics().await;
    let w4a8_layers: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("tessera_quant_plan_layers{") && l.contains("storage=\"int4 channel sym\""))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    assert_eq!(w4a8_layers, 210.0 * tp as f64, "{metrics}");
    assert!(server.logs().iter().any(|l| l.contains("kernel plan") && l.contains("W4A8")), "startup log names the plan");

    // Greedy completions run through the W4A8 kernels and are batch-invariant: two copies of
    // one prompt sent together (n = 2 at temperature 0) give the same text.
    let v = server.complete(json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "n": 2, "ignore_eos": true})).await;
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 2);
    assert!(!texts[0].trim().is_empty(), "{v}");
    assert_eq!(texts[0], texts[1]);
    assert_eq!(v["usage"]["completion_tokens"], 24);
}
