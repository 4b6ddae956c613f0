//! `convert::to_hf_dir` on the default model: the f32 conversion loads through the HF loader
//! and runs exactly like the GGUF; the bf16 conversion stays within bf16 rounding of it; the
//! tokenizer, special tokens and hyper-parameters survive; and tensor values agree with Python
//! `gguf`'s own dequantization (engine/tests/fixtures/make_gguf_dequant_fixture.py).

use crate::common;

use common::{default_model_path, fixture, max_rel_err, model_with};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tessera_engine::convert::{to_hf_dir, ConvertOptions};
use tessera_engine::float_dtype::FloatDtype;
use tessera_engine::model::{LlamaModel, SeqInput};
use tessera_engine::sample::argmax;
use tessera_engine::weights::ModelWeights;
use tessera_engine::LoadedModel;
use tessera_kernels::linear::LinearPolicy;

/// Converts the default model once per test binary into the cargo test tmpdir.
fn converted(dtype: FloatDtype) -> &'static Path {
    static F32: OnceLock<PathBuf> = OnceLock::new();
    static BF16: OnceLock<PathBuf> = OnceLock::new();
    let cell = if dtype == FloatDtype::F32 { &F32 } else { &BF16 };
    cell.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("convert-{}", dtype.torch_name()));
        let _ = std::fs::remove_dir_all(&dir);
        let ck = ModelWeights::open(&default_model_path()).unwrap().checkpoint;
        let s = to_hf_dir(&ck, &dir, &ConvertOptions { dtype, max_shard_bytes: None }).unwrap();
        assert_eq!(s.shards, vec!["model.safetensors"]);
        dir
    })
}

fn cases() -> Vec<Vec<u32>> {
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(fixture("model/reference_logits.json")).unwrap()).unwrap();
    spec["cases"].as_array().unwrap().iter().map(|c| c["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()).collect()
}

fn logits(m: &LlamaModel, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.local_kv(1024);
    m.forward(&mut [SeqInput { tokens, kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0)
}

fn greedy(m: &LlamaModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut kv = m.local_kv(1024);
    let mut l = m.forward(&mut [SeqInput { tokens: prompt, kv: &mut kv, logits_from: Some(prompt.len() - 1) }]).unwrap().swap_remove(0);
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(argmax(&l));
        l = m.forward(&mut [SeqInput { tokens: &out[out.len() - 1..], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0);
    }
    out
}

/// F32 output holds exactly the values the GGUF's blocks dequantize to (Q4_1/Q8_0 values are
/// exact in f32), so the float path multiplies the same numbers in both models; only the
/// order of f32 operations could differ (e.g. panel packing per storage type). Measured: 0 (bit
/// identical); bound 1e-6 of the logit spread, far below any token decision.
#[test]
fn f32_conversion_runs_like_the_gguf() {
    let gguf = model_with(LinearPolicy::ALWAYS_GEMM);
    let hf = LoadedModel::load(converted(FloatDtype::F32), LinearPolicy::ALWAYS_GEMM).unwrap();
    let vocab = gguf.model.config().vocab_size;
    for tokens in cases() {
        let e = max_rel_err(&logits(&hf.model, &tokens), &logits(&gguf.model, &tokens), vocab);
        eprintln!("f32 conversion, {} tokens: max |diff| / spread = {e:.2e}", tokens.len());
        assert!(e <= 1e-6, "{} tokens: relative logit error {e}", tokens.len());
    }
}

/// BF16 rounds every weight to 8 significant bits (relative error <= 2^-9 ≈ 2e-3 per weight,
/// independent across weights, so logits move by far less than that fraction of their spread).
/// Measured <= 7.3e-3 of the spread; bound 3e-2. Greedy continuations must not change for the
/// prompts whose top-1/top-2 gaps are >= 0.2 logits (the first three reference cases).
#[test]
fn bf16_conversion_stays_close() {
    let gguf = model_with(LinearPolicy::ALWAYS_GEMM);
    let hf = LoadedModel::load(converted(FloatDtype::BF16), LinearPolicy::ALWAYS_GEMM).unwrap();
    let vocab = gguf.model.config().vocab_size;
    for (i, tokens) in cases().iter().enumerate() {
        let e = max_rel_err(&logits(&hf.model, tokens), &logits(&gguf.model, tokens), vocab);
        eprintln!("bf16 conversion, {} tokens: max |diff| / spread = {e:.2e}", tokens.len());
        assert!(e <= 3e-2, "{} tokens: relative logit error {e}", tokens.len());
        if i < 3 {
            assert_eq!(greedy(&hf.model, tokens, 10), greedy(&gguf.model, tokens, 10), "greedy continuation of case {i}");
        }
    }
}

/// Hyper-parameters, special tokens, the chat template and the tokenizer survive the trip.
#[test]
fn config_and_tokenizer_round_trip() {
    let dir = converted(FloatDtype::BF16);
    let gguf = LoadedModel::load(&default_model_path(), LinearPolicy::DEFAULT).unwrap();
    let hf = ModelWeights::open(dir).unwrap().checkpoint;
    assert_eq!(hf.config, gguf.weights.checkpoint.config);
    assert_eq!(hf.special.bos, gguf.weights.checkpoint.special.bos);
    assert_eq!(hf.special.eos, gguf.weights.checkpoint.special.eos);
    assert_eq!(hf.special.add_bos, gguf.weights.checkpoint.special.add_bos);
    assert_eq!(hf.special.chat_template, gguf.weights.checkpoint.special.chat_template);
    assert!(hf.special.chat_template.is_some());

    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let c = &gguf.weights.checkpoint.config;
    assert_eq!(cfg["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert_eq!(cfg["hidden_act"], "silu");
    for (key, want) in [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.num_layers),
        ("num_attention_heads", c.num_heads),
        ("num_key_value_heads", c.num_kv_heads),
        ("head_dim", c.head_dim),
        ("max_position_embeddings", c.max_position_embeddings),
    ] {
        assert_eq!(cfg[key].as_u64(), Some(want as u64), "{key}");
    }
    assert_eq!(cfg["rope_theta"].as_f64(), Some(100000.0));
    assert_eq!(cfg["rms_norm_eps"].as_f64(), Some(1e-5), "shortest f32 decimal, not 9.99e-6");
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!((cfg["bos_token_id"].as_u64(), cfg["eos_token_id"].as_u64()), (Some(1), Some(2)));
    let tcfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!((tcfg["bos_token"].as_str(), tcfg["eos_token"].as_str()), (Some("<|im_start|>"), Some("<|im_end|>")));
    assert_eq!(tcfg["add_bos_token"], false);

    let hf_tok = tessera_engine::tokenizer::Tokenizer::from_checkpoint(&hf).unwrap();
    assert_eq!(hf_tok.vocab_size(), gguf.tokenizer.vocab_size());
    let texts = [
        "The capital of France is Paris.",
        "<|im_start|>user\nWhat is 2+2? 12345 apples<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Unicode: café, naïve, 日本語, emoji 🤖, Ελληνικά",
        "code: fn main() { println!(\"{}\", 1_000_000); }",
    ];
    for t in texts {
        let ids = gguf.tokenizer.encode(t).unwrap();
        assert_eq!(hf_tok.encode(t).unwrap(), ids, "{t:?}");
        assert_eq!(hf_tok.decode(&ids), gguf.tokenizer.decode(&ids), "{t:?}");
        assert_eq!(hf_tok.decode(&ids), t);
    }
}

/// The f32 conversion's values at Python-chosen positions equal `gguf.quants.dequantize`'s
/// (same f32 arithmetic: exact), under the Hugging Face names and with Q/K rows in Hugging Face
/// order; per-tensor sums agree to f64 summation-order noise (1e-9 relative).
#[test]
fn values_match_python_gguf_dequantization() {
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(fixture("convert/gguf_dequant.json")).unwrap()).unwrap();
    let bytes = std::fs::read(converted(FloatDtype::F32).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for t in spec["tensors"].as_array().unwrap() {
        let name = t["hf_name"].as_str().unwrap();
        let view = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let shape: Vec<usize> = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        assert_eq!(view.shape(), shape, "{name}");
        let v = FloatDtype::F32.decode(view.data());
        for s in t["samples"].as_array().unwrap() {
            let (i, want) = (s[0].as_u64().unwrap() as usize, s[1].as_f64().unwrap() as f32);
            assert_eq!(v[i], want, "{name}[{i}] (row {}, col {})", i / shape[shape.len() - 1], i % shape[shape.len() - 1]);
        }
        let sums = [
            ("sum", v.iter().map(|&x| x as f64).sum::<f64>()),
            ("sum_abs", v.iter().map(|&x| (x as f64).abs()).sum::<f64>()),
            ("sum_sq", v.iter().map(|&x| x as f64 * x as f64).sum::<f64>()),
        ];
        for (key, got) in sums {
            let want = t[key].as_f64().unwrap();
            assert!((got - want).abs() <= 1e-9 * want.abs().max(1.0), "{name} {key}: {got} vs {want}");
        }
    }
}

/// Sharded output: every tensor lands in exactly one shard listed by the index, and the
/// directory loads to the same tensors as the single-file conversion.
#[test]
fn sharded_output_has_an_index() {
    let dir = tempfile::tempdir().unwrap();
    let ck = ModelWeights::open(&default_model_path()).unwrap().checkpoint;
    let s = to_hf_dir(&ck, dir.path(), &ConvertOptions { dtype: FloatDtype::BF16, max_shard_bytes: Some(100 << 20) }).unwrap();
    assert_eq!(s.shards.len(), 3, "{:?}", s.shards);
    assert_eq!(s.shards[0], "model-00001-of-00003.safetensors");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), ck.tensors.len());
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(s.bytes));
    let hf = ModelWeights::open(dir.path()).unwrap().checkpoint;
    let single = ModelWeights::open(converted(FloatDtype::BF16)).unwrap().checkpoint;
    assert_eq!(hf.tensors.len(), single.tensors.len());
    for (name, t) in &hf.tensors {
        assert_eq!(t.data.bytes(), single.tensors[name].data.bytes(), "{name}");
    }
}

/// On a model that prepends BOS (the bf16 conversion with `add_bos_token: true`), the key
/// calibration `LoadedModel::kv_layout` runs is one BOS, then the built-in text's passes
/// without a BOS of their own: the layout's key centers (and scales) are exactly what
/// `key_calibration::measure` gives on that sequence, for a one-pass format (tq3_0) and for one
/// that takes `CENTERING_PASSES` (HQMQ). (The text was encoded with the tokenizer's own BOS
/// once, so the sequence began with two.)
#[test]
fn key_calibration_has_one_bos_on_models_that_add_it() {
    use tessera_engine::kv_cache::KvDtype;
    use tessera_engine::model::key_calibration::{self, CALIBRATION_TEXT, CENTERING_PASSES};
    let src = converted(FloatDtype::BF16);
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        std::os::unix::fs::symlink(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("tokenizer_config.json");
    let mut tcfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    tcfg["add_bos_token"] = Value::Bool(true);
    std::fs::remove_file(&cfg_path).unwrap();
    std::fs::write(&cfg_path, tcfg.to_string()).unwrap();

    let lm = LoadedModel::load(dir.path(), LinearPolicy::DEFAULT).unwrap();
    let bos = lm.tokenizer.special().bos.unwrap();
    assert!(lm.tokenizer.special().add_bos);
    let text = lm.tokenizer.encode_with(CALIBRATION_TEXT, false).unwrap();
    assert_ne!(text[0], bos);
    for (format, passes) in [("tq3_0", 1), ("hqmq-s96-r4", CENTERING_PASSES)] {
        let req = KvDtype { k: format.parse().unwrap(), v: "bf16".parse().unwrap() };
        let layout = lm.kv_layout(req, 16, 0).unwrap();
        let mut sequence = vec![bos];
        (0..passes).for_each(|_| sequence.extend_from_slice(&text));
        let want = key_calibration::measure(&lm.model, &lm.model.kv_layout(req, 16, 0).unwrap(), &sequence).unwrap();
        for layer in 0..lm.model.config().num_layers {
            assert_eq!(layout.key_center(layer), Some(want.centers[layer].as_slice()), "{format}: layer {layer}'s key center");
            assert_eq!(layout.key_scale(layer), want.scales.as_ref().map(|s| s[layer].as_slice()), "{format}: layer {layer}'s key scales");
        }
    }
}
