//! Replays the stored fuzz corpora through the engine's fuzz entry points
//! (`tessera_engine::fuzzing`), without libFuzzer: every file of fuzz/corpus/<target>/ and
//! fuzz/regressions/<target>/ must load or fail with an error, never panic. Long fuzzing runs:
//! scripts/fuzz.sh.

use std::path::Path;
use tessera_engine::fuzzing;

/// Runs `f` over the stored inputs of `target`; fails naming each input that panicked.
fn replay(target: &str, f: impl Fn(&[u8])) {
    if let Err(e) = tessera_engine::fuzzing::replay_corpus(target, f) {
        panic!("{e}");
    }
}

#[test]
fn gguf_corpus() {
    replay("gguf", |d| {
        let _ = fuzzing::gguf(d);
    });
}

#[test]
fn hf_checkpoint_corpus() {
    replay("hf_checkpoint", |d| {
        let _ = fuzzing::hf_checkpoint(d);
    });
}

#[test]
fn tokenizer_decode_corpus() {
    let tok = fuzzing::default_tokenizer();
    replay("tokenizer_decode", |d| fuzzing::tokenizer_decode(tok, d));
}

/// A GGUF file with these metadata entries (`(key, type id, value bytes)`) and no tensors.
fn gguf_with(kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let s = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (k, ty, v) in kvs {
        b.extend(s(k));
        b.extend(ty.to_le_bytes());
        b.extend(v);
    }
    b
}

/// Review of the loaders for the fuzz targets: a layer count of 10^18 sized the MoE layer
/// flags (`vec![true; num_layers]`) before the configuration was validated, aborting the
/// process on the allocation; it is now a configuration error naming the key.
#[test]
fn layer_counts_are_checked_before_sizing_anything() {
    let u32v = |x: u32| x.to_le_bytes().to_vec();
    let strv = |x: &str| [&(x.len() as u64).to_le_bytes()[..], x.as_bytes()].concat();
    let tokens = [&8u32.to_le_bytes()[..], &1u64.to_le_bytes(), &strv("a")].concat();
    let f = gguf_with(&[
        ("general.architecture", 8, strv("llama")),
        ("tokenizer.ggml.tokens", 9, tokens),
        ("llama.embedding_length", 4, u32v(8)),
        ("llama.attention.head_count", 4, u32v(2)),
        ("llama.block_count", 10, 1_000_000_000_000_000_000u64.to_le_bytes().to_vec()),
        ("llama.expert_count", 4, u32v(2)),
        ("llama.expert_used_count", 4, u32v(1)),
        ("llama.feed_forward_length", 4, u32v(16)),
    ]);
    let e = fuzzing::gguf(&f).unwrap_err().to_string();
    assert!(e.contains("llama.block_count") && e.contains("out of range"), "{e}");

    let base = r#""hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 5,
        "max_position_embeddings": 64, "num_local_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8"#;
    for ty in ["mixtral", "qwen3_moe", "deepseek_v3"] {
        let cfg = format!(r#"{{"model_type": "{ty}", "num_hidden_layers": 1000000000000000000, "n_routed_experts": 2, {base}}}"#);
        let e = fuzzing::hf_checkpoint(cfg.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers") && e.contains("out of range"), "{ty}: {e}");
    }
}

/// Review: DeepSeek's shared-expert width (`moe_intermediate_size * n_shared_experts`)
/// overflowed; Qwen's `mlp_only_layers` was searched once per layer (10^4 entries times 2^24
/// layers took minutes). Both are answered at once now.
#[test]
fn moe_layer_settings_cannot_overflow_or_stall() {
    let cfg = r#"{"model_type": "deepseek_v3", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 16, "vocab_size": 5, "max_position_embeddings": 64, "n_routed_experts": 2,
        "num_experts_per_tok": 1, "moe_intermediate_size": 4294967296, "n_shared_experts": 4294967296}"#;
    let e = fuzzing::hf_checkpoint(cfg.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("n_shared_experts"), "{e}");

    let dense: Vec<String> = (0..10_000).map(|i| (i * 3).to_string()).collect();
    let cfg = format!(
        r#"{{"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 16777216,
        "intermediate_size": 16, "vocab_size": 5, "max_position_embeddings": 64, "num_experts": 2,
        "num_experts_per_tok": 1, "moe_intermediate_size": 8, "mlp_only_layers": [{}]}}"#,
        dense.join(",")
    );
    let start = std::time::Instant::now();
    let _ = fuzzing::hf_checkpoint(cfg.as_bytes());
    assert!(start.elapsed().as_secs_f64() < 5.0, "{:?}", start.elapsed());
}

/// The seeds (fuzz/seeds/make_seeds.py) are whole models that load completely, so the
/// fuzzers start from inputs that reach every stage of loading.
#[test]
fn seeds_load_completely() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    for seed in ["gguf/seed-tiny-f32.gguf", "gguf/seed-tiny-q8_0.gguf"] {
        fuzzing::gguf(&std::fs::read(corpus.join(seed)).unwrap()).unwrap_or_else(|e| panic!("{seed}: {e}"));
    }
    for seed in ["hf_checkpoint/seed-tiny-f32", "hf_checkpoint/seed-tiny-f16", "hf_checkpoint/seed-tiny-bf16"] {
        fuzzing::hf_checkpoint(&std::fs::read(corpus.join(seed)).unwrap()).unwrap_or_else(|e| panic!("{seed}: {e}"));
    }
}
