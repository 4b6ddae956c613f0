//! One MoE layer at SmolLM2-135M's sizes (hidden 576, expert width 1536, 8 experts, top-2) for
//! 1, 8, 64 and 256 tokens: grouped execution (`MoeLayer::forward`) against the per-token loop
//! over experts (`MoeLayer::forward_per_token`), with BF16, W4A16 (compressed-tensors, int4
//! groups of 64) and W4A8 (Quark, int4 per channel, int8 activations) experts, side by side in
//! one run. The layer comes from a random model upcycled with perturbed experts and quantized
//! with `--experts-only`, written once into the target directory.
//! Run: `cargo bench -p tessera-engine --bench moe`.

#![allow(missing_docs)] // criterion's macros generate undocumented functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_engine::convert::ConvertOptions;
use tessera_engine::float_dtype::FloatDtype;
use tessera_engine::model::moe::MoeLayer;
use tessera_engine::quantize::{quantize_dir, Format, QuantizeOptions, Recipe, Scheme};
use tessera_engine::upcycle::{random_dense, upcycle, MoeFamily, RandomDims, UpcycleOptions};
use tessera_engine::weights::ModelWeights;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;

/// Writes the BF16 MoE model and its two experts-only quantizations; returns (name, dir).
fn models() -> Vec<(&'static str, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-moe");
    let like = ModelWeights::open(&tessera_engine::default_model::for_tests())
        .expect("default model: run scripts/fetch-default-model.sh")
        .checkpoint;
    let bf16 = root.join("bf16");
    if !bf16.join("config.json").exists() {
        let dense = random_dense(&like, RandomDims { hidden: 576, ffn: 1536, layers: 2, heads: 9, kv_heads: 3 }, 1);
        let opts = UpcycleOptions {
            family: MoeFamily::Mixtral,
            experts: 8,
            top_k: 2,
            groups: (1, 1),
            perturb: 0.5,
            seed: 2,
            stacked: false,
            convert: ConvertOptions { dtype: FloatDtype::BF16, max_shard_bytes: None },
        };
        upcycle(&dense, &bf16, &opts).unwrap();
    }
    let mut out = vec![("bf16", bf16.clone())];
    for (name, recipe) in [
        ("w4a16-g64", Recipe::resolve(Scheme::W4A16, None, Some(64), false).unwrap()),
        ("w4a8", Recipe::resolve(Scheme::W4A8, Some(Format::Quark), None, false).unwrap()),
    ] {
        let dir = root.join(name);
        if !dir.join("config.json").exists() {
            quantize_dir(&QuantizeOptions { input: bf16.clone(), output: dir.clone(), recipe, exclude: vec![], experts_only: true, calibrated: None, mse_observer: false, head: None, progress: Default::default() }).unwrap();
        }
        out.push((name, dir));
    }
    out
}

fn bench(c: &mut Criterion) {
    let caps = CpuCaps::detect();
    for (name, dir) in models() {
        let ck = ModelWeights::open(&dir).unwrap();
        let cfg = &ck.checkpoint.config;
        let moe = cfg.moe.clone().unwrap();
        let layer = MoeLayer::load(&ck, 1, cfg, &moe, None, &caps, LinearPolicy::DEFAULT).unwrap();
        let h = cfg.hidden_size;
        let mut g = c.benchmark_group(format!("moe-8x2/{name}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
        for m in [1usize, 8, 64, 256] {
            let x: Vec<f32> = (0..m * h).map(|i| (i * 7919 % 2000) as f32 / 1000.0 - 1.0).collect();
            let mut y = vec![0f32; m * h];
            g.throughput(Throughput::Elements(m as u64));
            g.bench_with_input(BenchmarkId::new("grouped", m), &m, |b, &m| b.iter(|| layer.forward(&x, &[m], &mut y)));
            g.bench_with_input(BenchmarkId::new("per-token", m), &m, |b, _| b.iter(|| layer.forward_per_token(&x, &mut y)));
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
