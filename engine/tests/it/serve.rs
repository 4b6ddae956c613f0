//! The serving engine with the real default model: continuous batching, the paged KV cache,
//! prefix caching, preemption, stop handling, prompt logprobs and aborts.

use crate::common;

use common::{default_model_path, greedy_reference, model};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_engine::kv_cache::{BlockPool, KvDtype, LocalKv, PagedSeqKv, SequenceKv};
use tessera_engine::model::SeqInput;
use tessera_engine::sample::{logsumexp, SamplingParams};
use tessera_engine::serve::{Engine, EngineConfig, Event, FinishReason, GenRequest, OutputText, StopReason, SubmitError, Usage};
use tessera_engine::synthetic::{write_random_llama, LlamaShape, QuantMix, RandomLlamaOptions};
use tessera_engine::LoadedModel;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::LinearPolicy;

fn engine(cfg: EngineConfig) -> Engine {
    engine_with(LinearPolicy::DEFAULT, cfg)
}

fn engine_with(policy: LinearPolicy, cfg: EngineConfig) -> Engine {
    let m = LoadedModel::load(&default_model_path(), policy).unwrap();
    Engine::start(Arc::new(m), cfg).unwrap()
}

fn no_cache() -> EngineConfig {
    EngineConfig { prefix_caching: false, ..EngineConfig::default() }
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "The three primary colors are red, blue and",
];

fn tokens(text: &str) -> Vec<u32> {
    model().tokenizer.encode(text).unwrap()
}

fn greedy(id: &str, prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
    let mut r = GenRequest::new(id, prompt, SamplingParams::greedy(), max_tokens);
    r.ignore_eos = true;
    r
}

/// Collected events of one request.
#[derive(Debug, Default)]
struct Outcome {
    text: String,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    prompt_logprobs: Vec<Option<f32>>,
    finish: Option<(FinishReason, Option<StopReason>, Usage)>,
}

fn collect(mut s: tessera_engine::serve::RequestStream) -> Outcome {
    let mut o = Outcome::default();
    while let Some(e) = s.blocking_next() {
        match e {
            Event::PromptLogprobs(p) => o.prompt_logprobs = p.iter().map(|t| t.logprob).collect(),
            Event::Delta { text, tokens } => {
                o.text.push_str(&text);
                o.ids.extend(tokens.iter().map(|t| t.id));
                o.logprobs.extend(tokens.iter().filter_map(|t| t.logprob));
            }
            Event::Finished { reason, stop_reason, usage } => o.finish = Some((reason, stop_reason, usage)),
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
    o
}

fn run_alone(e: &Engine, reqs: &[GenRequest]) -> Vec<Outcome> {
    reqs.iter().map(|r| collect(e.submit(r.clone()).unwrap())).collect()
}

fn run_together(e: &Engine, reqs: &[GenRequest]) -> Vec<Outcome> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let handles: Vec<_> = streams.into_iter().map(|s| std::thread::spawn(move || collect(s))).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn metric(e: &Engine, name: &str) -> f64 {
    e.registry()
        .gather()
        .iter()
        .find(|f| f.get_name() == name)
        .map(|f| {
            // Unset fields read as 0: a gauge has no counter value and vice versa.
            let m = &f.get_metric()[0];
            m.get_gauge().get_value() + m.get_counter().get_value()
        })
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// A scattered block table filled in two chunks (the first ending mid-block) gives the logits
/// of one pass over a sequence's own cache, bit for bit: attention computes every query row
/// the same way whatever chunk it is in, and the default model's kernels compute every token's
/// rows independently of the others.
#[test]
fn paged_cache_matches_a_local_cache() {
    let m = &model().model;
    let cfg = m.config();
    let prompt = tokens(&PROMPTS[1].repeat(6));
    let mut contiguous = m.local_kv(cfg.max_position_embeddings);
    let want = m.forward(&mut [SeqInput { tokens: &prompt, kv: &mut contiguous, logits_from: Some(0) }]).unwrap().swap_remove(0);
    let pool = BlockPool::new(m.kv_layout(KvDtype::default(), 16, 0).unwrap(), 64);
    // A scattered block table: blocks need not be contiguous or ordered.
    let table: Vec<u32> = (0..prompt.len().div_ceil(16) as u32).map(|i| 63 - 3 * i).collect();
    let mut paged = PagedSeqKv::new(&pool, &table, 0, 0);
    let (a, b) = prompt.split_at(37); // two chunks, the first ending mid-block
    m.forward(&mut [SeqInput { tokens: a, kv: &mut paged, logits_from: None }]).unwrap();
    let got = m.forward(&mut [SeqInput { tokens: b, kv: &mut paged, logits_from: Some(0) }]).unwrap().swap_remove(0);
    assert_eq!(paged.len(), prompt.len());
    let v = cfg.vocab_size;
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert!(bits(&got) == bits(&want[37 * v..]), "the second chunk's logits differ from the one-pass logits");
}

/// The engine's greedy output is the single-sequence generator's.
#[test]
fn engine_generates_what_generate_does() {
    let e = engine(no_cache());
    let lm = model();
    let prompt = tokens(PROMPTS[1]);
    let want = greedy_reference(&lm.model, lm.model.local_kv(prompt.len() + 40), &prompt, 40);
    let got = collect(e.submit(greedy("a", prompt.clone(), 40)).unwrap());
    assert_eq!(got.ids, want);
    assert_eq!(got.text, lm.tokenizer.decode(&want));
    let (reason, _, usage) = got.finish.unwrap();
    assert_eq!((reason, usage.prompt_tokens, usage.completion_tokens), (FinishReason::Length, prompt.len(), 40));
    e.shutdown(Duration::from_secs(1));
}

/// Requests run together produce exactly what they produce alone, including long prompts
/// prefilled in chunks beside other requests' decodes.
#[test]
fn batching_does_not_change_results() {
    // A small budget forces multi-chunk prefills interleaved with decodes.
    let e = engine(EngineConfig { max_num_batched_tokens: 64 + 16, ..no_cache() });
    let mut reqs: Vec<GenRequest> = PROMPTS.iter().enumerate().map(|(i, p)| greedy(&i.to_string(), tokens(p), 24)).collect();
    reqs.push(greedy("long", tokens(&PROMPTS[1].repeat(12)), 24));
    let mut sampled = greedy("seeded", tokens(PROMPTS[2]), 24);
    sampled.sampling = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(42), ..SamplingParams::default() };
    reqs.push(sampled);
    let alone = run_alone(&e, &reqs);
    let together = run_together(&e, &reqs);
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a.ids, t.ids);
        assert_eq!(a.text, t.text);
    }
    assert!(metric(&e, "tessera_kv_cache_blocks_used") == 0.0);
}

/// Compressed KV caches (HQMQ keys with Med3x outliers and TQ3_0 values; QJL keys with FP8
/// values) run through the engine: requests run together produce exactly what they produce
/// alone, and the engine's paged cache gives what the single-sequence generator's own cache
/// in the same formats gives.
#[test]
fn compressed_kv_caches_batch_invariantly() {
    for dtype in ["k=hqmq-s192-r6-med3,v=tq3_0", "k=qjl1,v=fp8"] {
        let (k, v) = dtype.split_once(',').unwrap();
        let dtype = KvDtype { k: k[2..].parse().unwrap(), v: v[2..].parse().unwrap() };
        let e = engine(EngineConfig { max_num_batched_tokens: 64 + 16, kv_dtype: dtype.into(), ..no_cache() });
        assert_eq!(e.info().kv_cache_type, dtype.to_string());
        let mut reqs: Vec<GenRequest> = PROMPTS.iter().enumerate().map(|(i, p)| greedy(&i.to_string(), tokens(p), 12)).collect();
        reqs.push(greedy("long", tokens(&PROMPTS[1].repeat(8)), 12));
        let alone = run_alone(&e, &reqs);
        let together = run_together(&e, &reqs);
        for (a, t) in alone.iter().zip(&together) {
            assert_eq!(a.ids, t.ids, "{dtype}");
        }
        let lm = model();
        let layout = lm.kv_layout(dtype, 16, 0).unwrap();
        let prompt = tokens(PROMPTS[1]);
        let want = greedy_reference(&lm.model, LocalKv::new(layout, prompt.len() + 12), &prompt, 12);
        assert_eq!(alone[1].ids, want, "{dtype}");
        e.shutdown(Duration::from_secs(1));
    }
}

/// Compressed formats hold more tokens in the same memory: the pool's blocks scale with the
/// format's compression.
#[test]
fn kv_pool_capacity_scales_with_compression() {
    let lm = Arc::new(LoadedModel::load(&default_model_path(), LinearPolicy::DEFAULT).unwrap());
    let bytes = 64 << 20;
    let blocks = |d: &str| {
        let e = Engine::start(lm.clone(), EngineConfig { kv_cache_bytes: bytes, kv_dtype: KvDtype::both(d.parse().unwrap()).into(), ..EngineConfig::default() }).unwrap();
        let n = e.info().num_blocks;
        e.shutdown(Duration::from_secs(1));
        n
    };
    let bf16 = blocks("bf16");
    for (f, ratio) in [("f32", 0.5), ("int8", 128.0 / 68.0), ("tq3_0", 128.0 / 28.0)] {
        let got = blocks(f) as f64 / bf16 as f64;
        // Blocks are padded to 64 bytes and counts floored: within 1%.
        assert!((got / ratio - 1.0).abs() < 0.01, "{f}: {got} vs {ratio}");
    }
}

/// A shared prefix is served from the cache: counted in usage and metrics, same output.
#[test]
fn prefix_cache_reuses_full_blocks() {
    let e = engine(EngineConfig::default());
    let prompt = tokens(&PROMPTS[1].repeat(4));
    let first = collect(e.submit(greedy("a", prompt.clone(), 8)).unwrap());
    let second = collect(e.submit(greedy("b", prompt.clone(), 8)).unwrap());
    assert_eq!(first.finish.as_ref().unwrap().2.cached_tokens, 0);
    let cached = second.finish.as_ref().unwrap().2.cached_tokens;
    assert_eq!(cached, (prompt.len() - 1) / 16 * 16, "every full block but the one holding the last token");
    assert_eq!(first.text, second.text);
    assert_eq!(metric(&e, "tessera_prefix_cache_hits_total"), cached as f64);
    assert_eq!(metric(&e, "tessera_prefix_cache_queries_total"), 2.0 * prompt.len() as f64);
    // A prompt sharing the first block only.
    let mut other = prompt.clone();
    other[20] = tokens(" dog")[0];
    let third = collect(e.submit(greedy("c", other, 4)).unwrap());
    assert_eq!(third.finish.unwrap().2.cached_tokens, 16);
}

/// Greedy ids and the bits of their logprobs: what "bit-identical" compares.
fn greedy_bits(e: &Engine, id: &str, prompt: &[u32], max_tokens: usize) -> (Vec<u32>, Vec<u32>, usize) {
    let mut r = greedy(id, prompt.to_vec(), max_tokens);
    r.sampling.logprobs = Some(0);
    let o = collect(e.submit(r).unwrap());
    let cached = o.finish.as_ref().unwrap().2.cached_tokens;
    (o.ids, o.logprobs.iter().map(|l| l.to_bits()).collect(), cached)
}

/// docs/serving.md's promise, for every KV format whose scores do not depend on what is cached:
/// a prompt's greedy tokens and their logprobs are bit-identical whether it is computed in one
/// chunk, in chunks of other sizes, or after a prefix-cache hit of any length (a whole block,
/// several, all but the last token's block) under either block size (the whole grid for the
/// default f32 cache, one chunking and one hit for each other format). Before attention computed
/// every query row one way, a hit's recomputed tail took the decode path and the same prompt
/// whole the prefill path, and the fisherman prompt diverged after about 20 tokens.
#[test]
fn prefix_hits_and_chunking_do_not_change_results() {
    let model = Arc::new(LoadedModel::load(&default_model_path(), LinearPolicy::DEFAULT).unwrap());
    // The default format over the whole grid; the others over one chunking and one hit.
    prefix_and_chunking_invariance(model, &["f32", "bf16", "int8", "fp8_e4m3", "tq3_0", "hqmq-s96-r4", "k=hqmq-s96-r4-sink4,v=hqmq-s96-r4", "k=qjl1-w0-s0,v=bf16"]);
}

/// The same promise for GGUF k-quants, whose integer kernels compute a token's outputs the
/// same way at every batch size: tiny random Llamas in llama.cpp's Q4_K_M mix (Q4_K and Q6_K
/// matrices, a Q6_K tied output), its Q3_K_M mix (Q3_K, Q4_K, Q5_K, Q6_K) and in Q2_K, over
/// the whole grid of the default cache format.
#[test]
fn prefix_hits_and_chunking_do_not_change_results_with_k_quants() {
    for (name, mix, kernels) in [
        ("q4_k_m", QuantMix::Q4KM, &["cpu.q4_kx8", "cpu.q6_kx8"][..]),
        ("q3_k_m", QuantMix::Q3KM, &["cpu.q3_kx8", "cpu.q4_kx8", "cpu.q5_kx8", "cpu.q6_kx8"][..]),
        ("q2_k", QuantMix::Uniform(GgmlType::Q2K), &["cpu.q2_kx8"][..]),
    ] {
        let path = std::env::temp_dir().join(format!("tessera-serve-{name}-{}.gguf", std::process::id()));
        let opts = RandomLlamaOptions { shape: LlamaShape::TINY, mix, embedding: None, seed: 1, tokenizer: default_model_path() };
        write_random_llama(&opts, &path).unwrap();
        let model = LoadedModel::load(&path, LinearPolicy::DEFAULT).unwrap();
        std::fs::remove_file(&path).unwrap();
        let plan: Vec<String> = model.model.plan().iter().map(|p| p.kernel.clone()).collect();
        for k in kernels {
            assert!(plan.iter().any(|p| p.starts_with(k)), "{name}: no {k} in {plan:?}");
        }
        prefix_and_chunking_invariance(Arc::new(model), &["f32"]);
    }
}

/// The same promise under tensor parallelism (issue 24): the default model over two ranks,
/// each with its own pool of its KV heads, keeps greedy tokens and logprob bits through every
/// chunking and prefix hit (the all-reduce sums in rank order whatever the batch), for the
/// default cache, a compressed one and one with an exact sink (each rank's part of it travels
/// with the prefix cache's first block); and it serves what the whole model serves: greedy
/// tokens of the four prompts equal to one rank's, or parting only where the two choices'
/// logprobs are within 0.5 (a near-tie: on this int8-activation path, logits of one and two
/// ranks differ by up to about a unit, measured in `tensor_parallel`, whose module docs say why).
#[test]
fn tensor_parallel_serving_keeps_the_promises() {
    use tessera_engine::parallel::TpOptions;
    let tp = Arc::new(LoadedModel::load_parallel(&default_model_path(), LinearPolicy::DEFAULT, &TpOptions { size: 2, cpu_bind: None }).unwrap());
    let one = engine(no_cache());
    let two = Engine::start(tp.clone(), no_cache()).unwrap();
    assert!(two.info().plan.iter().any(|e| e.shard.as_deref() == Some("rank 1/2: columns 384..576 of 576")));
    for (i, p) in PROMPTS.iter().enumerate() {
        let (a, b) = (greedy_bits(&one, "one", &tokens(p), 16), greedy_bits(&two, "two", &tokens(p), 16));
        match a.0.iter().zip(&b.0).position(|(x, y)| x != y) {
            Some(at) => {
                let gap = (f32::from_bits(a.1[at]) - f32::from_bits(b.1[at])).abs();
                eprintln!("prompt {i}: TP=2 parts from TP=1 at token {at} (logprobs {:.4} and {:.4})", f32::from_bits(a.1[at]), f32::from_bits(b.1[at]));
                assert!(gap < 0.5, "prompt {i}: TP=2 parts from TP=1 at token {at} with a logprob gap of {gap}");
            }
            None => eprintln!("prompt {i}: 16 greedy tokens equal"),
        }
    }
    prefix_and_chunking_invariance(tp, &["f32", "hqmq-s96-r4", "k=hqmq-s96-r4-sink4,v=hqmq-s96-r4"]);
}

/// Greedy tokens and logprob bits of two prompts equal in one chunk, in chunks of other sizes
/// and after prefix hits, for each KV format in `formats` (the first, `f32`, over the whole
/// grid of chunkings, hits and block sizes).
fn prefix_and_chunking_invariance(model: Arc<LoadedModel>, formats: &[&str]) {
    let start = |kv: &KvDtype, chunk: usize, block_size: usize, prefix_caching: bool| {
        // The chunk is max_num_batched_tokens - max_num_seqs.
        let cfg = EngineConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: chunk + 4,
            block_size,
            kv_cache_bytes: 64 << 20,
            prefix_caching,
            kv_dtype: (*kv).into(),
            ..EngineConfig::default()
        };
        Engine::start(Arc::clone(&model), cfg).unwrap()
    };
    let fisherman = tokens("Once upon a time in a small village by the sea, there lived a fisherman who");
    let long = tokens(&PROMPTS[1].repeat(3));
    for &name in formats {
        let kv = match name.split_once(',') {
            Some((k, v)) => KvDtype { k: k[2..].parse().unwrap(), v: v[2..].parse().unwrap() },
            None => KvDtype { k: name.parse().unwrap(), v: name.parse().unwrap() },
        };
        let grid = name == "f32";
        let prompts: &[&Vec<u32>] = if grid { &[&fisherman, &long] } else { &[&long] };
        let block_sizes: &[usize] = if grid { &[16, 32] } else { &[16] };
        for prompt in prompts {
            let n = 24;
            // Chunkings and hits are compared under one block size: tiles are blocks, and a
            // format whose value hook sums a tile at a time (TQ3_0) rounds by tile.
            for &block_size in block_sizes {
                let reference = {
                    let e = start(&kv, 508, block_size, false);
                    let (ids, bits, _) = greedy_bits(&e, "ref", prompt, n);
                    (ids, bits)
                };
                let chunks: &[usize] = if grid { &[5, 13] } else { &[13] };
                for &chunk in chunks {
                    let e = start(&kv, chunk, block_size, false);
                    let (ids, bits, _) = greedy_bits(&e, "chunked", prompt, n);
                    assert_eq!((ids, bits), reference, "{name}: chunks of {chunk} vs one chunk ({} tokens, block {block_size})", prompt.len());
                }
                // Prefix hits: a first request caches the prompt's first `warm` tokens, the
                // second computes what is left (every hit length on the grid).
                let full = (prompt.len() - 1) / block_size * block_size;
                let hits: Vec<(usize, usize)> = if grid {
                    [508, 7].iter().flat_map(|&c| (block_size..=full).step_by(block_size).map(move |w| (c, w))).collect()
                } else {
                    vec![(508, full)]
                };
                for (chunk, warm) in hits {
                    let e = start(&kv, chunk, block_size, true);
                    greedy_bits(&e, "warm", &prompt[..warm], 1);
                    let (ids, bits, cached) = greedy_bits(&e, "hit", prompt, n);
                    assert_eq!(cached, warm, "{name}: the hit's length");
                    assert_eq!((ids, bits), reference, "{name}: a {warm}-token hit (block {block_size}, chunk {chunk}, {} tokens)", prompt.len());
                }
            }
        }
    }
}

/// QJL keys with exact sink and window keys under prefix caching: the sink's keys come back
/// with the cached first block (without them the hit would be dropped), and a hit leaves at
/// least a window of the prompt to compute, so the last prompt token scores its whole window
/// exactly.
#[test]
fn prefix_hits_with_exact_qjl_keys_leave_a_window_to_compute() {
    let dtype = KvDtype { k: "qjl1-w64-s4".parse().unwrap(), v: "bf16".parse().unwrap() };
    let e = engine(EngineConfig { kv_dtype: dtype.into(), ..EngineConfig::default() });
    let prompt = tokens(&PROMPTS[1].repeat(8));
    assert!(prompt.len() > 64 + 32, "{}", prompt.len());
    let first = collect(e.submit(greedy("a", prompt.clone(), 4)).unwrap());
    let second = collect(e.submit(greedy("b", prompt.clone(), 4)).unwrap());
    assert_eq!(first.finish.unwrap().2.cached_tokens, 0);
    let cached = second.finish.unwrap().2.cached_tokens;
    assert_eq!(cached, (prompt.len() - 64) / 16 * 16, "full blocks up to a window before the end");
    assert!(cached > 0 && cached < (prompt.len() - 1) / 16 * 16);
    assert_eq!(second.ids.len(), 4);
    e.shutdown(Duration::from_secs(1));
}

/// Keys a lossy key format keeps exactly are scored exactly: on a prompt of 16 tokens, all of
/// them in an HQMQ sink of 16 (`hqmq-s96-r4-sink16`) or in a QJL window of 128
/// (`qjl1-w128-s0`), with f32 values, the prompt's logprobs are those of an f32 cache, while HQMQ
/// keys without the sink move them by far more. Both formats store keys centered and QJL also
/// balanced (the layout's calibrated key transform), which moves each query's scores by one
/// constant: exact only in exact arithmetic. So the model takes f32 activations
/// ([`f32_activation_model`]) and the bound is 1e-3. Measured: 1.5e-5 (sink), 1.8e-5
/// (window), 1.39 without the sink; a kept key scored through the codec would be near the last.
#[test]
fn exact_keys_are_scored_exactly() {
    let [sink, window, plain] = prompt_logprob_gaps(&f32_activation_model(None), ["hqmq-s96-r4-sink16", "qjl1-w128-s0", "hqmq-s96-r4"]);
    eprintln!("largest prompt logprob gap to the f32 cache: hqmq sink {sink:.2e}, qjl1 window {window:.2e}, no sink {plain:.2e}");
    assert!(sink < 1e-3 && window < 1e-3, "exact keys were not scored exactly: gaps {sink}, {window}");
    assert!(plain > 10.0 * sink.max(window).max(1e-5), "HQMQ keys without a sink should move the logprobs: gap {plain}");
}

/// The same under tensor parallelism, where each rank keeps and scores its own KV heads' exact
/// keys: on two ranks, the sink and the window give the prompt logprobs of the two ranks' f32
/// cache (bound as in [`exact_keys_are_scored_exactly`]). Measured: 1.3e-5, 1.5e-5, and 1.39
/// without the sink.
#[test]
fn tensor_parallel_ranks_score_their_exact_keys() {
    let [sink, window, plain] = prompt_logprob_gaps(&f32_activation_model(Some(2)), ["hqmq-s96-r4-sink16", "qjl1-w128-s0", "hqmq-s96-r4"]);
    eprintln!("two ranks, largest prompt logprob gap to their f32 cache: hqmq sink {sink:.2e}, qjl1 window {window:.2e}, no sink {plain:.2e}");
    assert!(sink < 1e-3 && window < 1e-3, "exact keys were not scored exactly on two ranks: gaps {sink}, {window}");
    assert!(plain > 10.0 * sink.max(window).max(1e-5), "HQMQ keys without a sink should move the logprobs: gap {plain}");
}

/// The default model with f32 activations in every linear layer (`LinearPolicy::ALWAYS_GEMM`),
/// on `ranks` tensor-parallel ranks (`None`: one). The default path quantizes each token's
/// activations to int8 (as llama.cpp's integer dots do), which turns a rounding-level change in
/// attention into whole int8 steps downstream: a uniform key center of 0.001 moves the default
/// model's logits by up to 0.98 and this one's by 8.4e-5 (measured, `kv-quality.md`). Tests of
/// what is exact up to rounding run here.
fn f32_activation_model(ranks: Option<usize>) -> Arc<LoadedModel> {
    use tessera_engine::parallel::TpOptions;
    let policy = LinearPolicy::ALWAYS_GEMM;
    Arc::new(match ranks {
        None => LoadedModel::load(&default_model_path(), policy).unwrap(),
        Some(size) => LoadedModel::load_parallel(&default_model_path(), policy, &TpOptions { size, cpu_bind: None }).unwrap(),
    })
}

/// For each key format in `keys` (f32 values), the largest gap between the prompt logprobs of
/// a 16-token prompt and those with an f32 cache, served by `model`.
fn prompt_logprob_gaps<const N: usize>(model: &Arc<LoadedModel>, keys: [&str; N]) -> [f32; N] {
    let prompt = tokens(&PROMPTS[1].repeat(2))[..16].to_vec();
    let logprobs = |k: &str| {
        let cfg = EngineConfig { kv_dtype: KvDtype { k: k.parse().unwrap(), v: "f32".parse().unwrap() }.into(), ..no_cache() };
        let e = Engine::start(model.clone(), cfg).unwrap();
        let mut r = greedy("p", prompt.clone(), 1);
        r.prompt_logprobs = Some(0);
        let o = collect(e.submit(r).unwrap());
        e.shutdown(Duration::from_secs(1));
        o.prompt_logprobs.into_iter().skip(1).map(Option::unwrap).collect::<Vec<f32>>()
    };
    let exact = logprobs("f32");
    keys.map(|k| logprobs(k).iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max))
}

/// With too few blocks for everyone, the newest sequences are preempted and recomputed;
/// every request still completes with its full length and the pool drains.
#[test]
fn preemption_recomputes_and_completes() {
    let m = model();
    let bytes_per_block = m.model.config().num_layers * 2 * 16 * m.model.kv_width() * 4;
    // 12 blocks = 192 tokens for 4 requests needing ~60-90 tokens each.
    let e = engine(EngineConfig { kv_cache_bytes: 12 * bytes_per_block, ..no_cache() });
    let reqs: Vec<GenRequest> = PROMPTS.iter().enumerate().map(|(i, p)| greedy(&i.to_string(), tokens(p), 60)).collect();
    let out = run_together(&e, &reqs);
    for o in &out {
        let (reason, _, usage) = o.finish.clone().unwrap();
        assert_eq!((reason, usage.completion_tokens, o.ids.len()), (FinishReason::Length, 60, 60));
    }
    assert!(metric(&e, "tessera_num_preemptions_total") > 0.0, "the pool was too small for all four");
    assert_eq!(metric(&e, "tessera_kv_cache_blocks_used"), 0.0);
    assert_eq!(e.info().max_model_len, 12 * 16);
    let too_long = e.submit(greedy("x", tokens(PROMPTS[0]), 190));
    assert!(matches!(too_long, Err(SubmitError::TooLong { max_model_len: 192, .. })), "{:?}", too_long.err());
}

/// Prompt logprobs (echo scoring) equal a direct forward pass's log-softmax. Both use the
/// float (GEMM) kernels: with int8 activations, a one-ulp difference can move an activation
/// to the next int8 step, which would blur the comparison.
#[test]
fn prompt_logprobs_match_a_direct_forward_pass() {
    let e = engine_with(LinearPolicy::ALWAYS_GEMM, EngineConfig { max_num_batched_tokens: 48, ..EngineConfig::default() });
    let lm = e.model().clone();
    let prompt = tokens(&PROMPTS[1].repeat(3));
    let mut req = GenRequest::new("p", prompt.clone(), SamplingParams::greedy(), 0);
    req.prompt_logprobs = Some(2);
    let got = collect(e.submit(req).unwrap());
    let cfg = lm.model.config();
    let mut kv = lm.model.local_kv(cfg.max_position_embeddings);
    let all: Vec<f32> = prompt
        .chunks(48 - 16)
        .flat_map(|c| lm.model.forward(&mut [SeqInput { tokens: c, kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0))
        .collect();
    assert_eq!(got.prompt_logprobs.len(), prompt.len());
    assert_eq!(got.prompt_logprobs[0], None);
    for (i, lp) in got.prompt_logprobs.iter().enumerate().skip(1) {
        let row = &all[(i - 1) * cfg.vocab_size..i * cfg.vocab_size];
        let want = (row[prompt[i] as usize] as f64 - logsumexp(row)) as f32;
        // Paged vs contiguous prefill attention: only the f32 accumulation order differs.
        assert!((lp.unwrap() - want).abs() < 1e-4, "token {i}: {lp:?} vs {want}");
    }
    let (reason, _, usage) = got.finish.unwrap();
    assert_eq!((reason, usage.completion_tokens), (FinishReason::Length, 0));
    assert!(got.ids.is_empty());
}

/// A scoring request (`score_from`, as perplexity sends) reports the prompt tokens it skips
/// with no logprob and, after the first, no text (nobody reads them; each cost a tokenizer
/// call); the first token and every scored one carry their text, as echo shows it.
#[test]
fn skipped_prompt_tokens_are_not_decoded() {
    let e = engine(no_cache());
    let tok = &e.model().tokenizer;
    let prompt = tokens(PROMPTS[1]);
    let from = prompt.len() / 2;
    let mut req = GenRequest::new("s", prompt.clone(), SamplingParams::greedy(), 0);
    req.prompt_logprobs = Some(0);
    req.score_from = from;
    let mut stream = e.submit(req).unwrap();
    let mut got = None;
    while let Some(event) = stream.blocking_next() {
        if let Event::PromptLogprobs(p) = event {
            got = Some(p);
        }
    }
    let got = got.expect("prompt logprobs");
    assert_eq!(got.iter().map(|t| t.id).collect::<Vec<_>>(), prompt);
    for (i, t) in got.iter().enumerate() {
        assert_eq!(t.logprob.is_some(), i >= from, "token {i}");
        let want = if i > 0 && i < from { String::new() } else { tok.decode(&[prompt[i]]) };
        assert!(!tok.decode(&[prompt[i]]).is_empty(), "token {i} decodes to text");
        assert_eq!(t.text, want, "token {i}");
    }
}

/// Stop strings end generation, are never emitted, and match across token boundaries.
#[test]
fn stop_strings_cut_the_text() {
    let e = engine(no_cache());
    let prompt = tokens(PROMPTS[1]);
    let full = collect(e.submit(greedy("a", prompt.clone(), 40)).unwrap()).text;
    // A stop string spanning at least two tokens, starting mid-output.
    let start = full.char_indices().nth(full.chars().count() / 3).unwrap().0;
    let end = full[start..].char_indices().nth(6).map(|(i, _)| start + i).unwrap_or(full.len());
    let stop = full[start..end].to_string();
    let mut req = greedy("b", prompt, 40);
    req.stop = vec!["no such text".into(), stop.clone()];
    let got = collect(e.submit(req).unwrap());
    let cut = full.find(&stop).unwrap();
    assert_eq!(got.text, full[..cut]);
    let (reason, why, _) = got.finish.unwrap();
    assert_eq!((reason, why), (FinishReason::Stop, Some(StopReason::Text(stop))));
}

#[test]
fn held_back_text_is_released_when_no_stop_follows() {
    let tok = &model().tokenizer;
    let mut out = OutputText::new(&["Hello world".into()]);
    let ids = tok.encode(" say Hello there").unwrap();
    let mut shown = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let (t, hit) = out.push(tok, id, true);
        assert!(hit.is_none());
        shown.push_str(&t);
        if tok.decode(&ids[..=i]).ends_with("Hello") {
            assert!(!shown.ends_with("Hello"), "a possible stop-string start is held back");
        }
    }
    shown.push_str(&out.finish(tok, true).0);
    assert_eq!(shown, tok.decode(&ids));
}

/// min_tokens suppresses EOS; stop token ids end generation.
#[test]
fn min_tokens_and_stop_token_ids() {
    let e = engine(no_cache());
    let lm = model();
    let eos = lm.weights.checkpoint.special.eos[0];
    // A chat-formatted question the model answers briefly and ends with EOS.
    let prompt = tokens("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n");
    let mut r = GenRequest::new("a", prompt.clone(), SamplingParams::greedy(), 200);
    let natural = collect(e.submit(r.clone()).unwrap());
    let (reason, why, usage) = natural.finish.unwrap();
    assert_eq!((reason, why), (FinishReason::Stop, Some(StopReason::Token(eos))));
    let n = usage.completion_tokens;
    assert!(n < 100);
    r.min_tokens = n + 5;
    let longer = collect(e.submit(r.clone()).unwrap());
    assert!(longer.finish.unwrap().2.completion_tokens >= n + 5);
    assert!(!longer.ids[..n + 4].contains(&eos));
    // The natural output's second token as a stop id ends there (not emitted as text).
    r.min_tokens = 0;
    r.stop_token_ids = vec![natural.ids[1]];
    let cut = collect(e.submit(r).unwrap());
    assert_eq!(cut.ids, natural.ids[..2]);
    assert_eq!(cut.text, lm.tokenizer.decode(&natural.ids[..1]));
}

/// Dropping a stream aborts its request and frees its blocks within a step; a full queue
/// refuses new requests while accepted ones finish.
#[test]
fn abort_frees_blocks_and_queue_overflow_is_refused() {
    let e = engine(EngineConfig { max_num_seqs: 1, max_num_batched_tokens: 64, max_waiting: 1, ..EngineConfig::default() });
    let mut s = e.submit(greedy("a", tokens(PROMPTS[1]), 400)).unwrap();
    assert!(matches!(s.blocking_next(), Some(Event::Delta { .. })));
    let queued = e.submit(greedy("b", tokens(PROMPTS[0]), 4)).unwrap();
    assert_eq!(e.submit(greedy("c", tokens(PROMPTS[0]), 4)).err(), Some(SubmitError::QueueFull { waiting: 1 }));
    // The gauge is set at the end of the step that sent the first token: wait for it.
    let t = Instant::now();
    while metric(&e, "tessera_kv_cache_blocks_used") == 0.0 {
        assert!(t.elapsed() < Duration::from_secs(5), "no KV blocks in use while a request runs");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(s);
    let done = collect(queued);
    assert_eq!(done.finish.unwrap().2.completion_tokens, 4);
    let t = Instant::now();
    while metric(&e, "tessera_kv_cache_blocks_used") != 0.0 {
        assert!(t.elapsed() < Duration::from_secs(5), "blocks not freed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(metric(&e, "tessera_num_requests_running"), 0.0);
    assert!(e.is_running());
    e.shutdown(Duration::from_secs(1));
    assert!(!e.is_running());
    assert_eq!(e.submit(greedy("d", tokens(PROMPTS[0]), 4)).err(), Some(SubmitError::ShuttingDown));
}

/// Shutdown lets running requests finish within the grace period, then aborts the rest.
#[test]
fn shutdown_aborts_after_the_grace_period() {
    let e = engine(no_cache());
    let s = e.submit(greedy("a", tokens(PROMPTS[1]), 4000)).unwrap();
    let short = e.submit(greedy("b", tokens(PROMPTS[0]), 3)).unwrap();
    let t = Instant::now();
    e.shutdown(Duration::from_secs(2));
    assert!(t.elapsed() < Duration::from_secs(6));
    assert_eq!(collect(short).finish.unwrap().0, FinishReason::Length);
    assert_eq!(collect(s).finish.unwrap().0, FinishReason::Abort);
}

/// The sum of a histogram's observations.
fn histogram_sum(e: &Engine, name: &str) -> f64 {
    let families = e.registry().gather();
    let f = families.iter().find(|f| f.get_name() == name).unwrap_or_else(|| panic!("no metric {name}"));
    f.get_metric()[0].get_histogram().get_sample_sum()
}

/// Tokens the engine has run through the model (prefill chunks and decodes).
fn forwarded(e: &Engine) -> usize {
    histogram_sum(e, "tessera_iteration_tokens") as usize
}

/// `n` sampled choices of one prompt, as the server builds them: choice `i` seeds `42 + i`.
fn choices(prompt: &[u32], n: usize, max_tokens: usize, logprobs: Option<usize>) -> Vec<GenRequest> {
    (0..n)
        .map(|i| {
            let sampling = SamplingParams { temperature: 1.5, seed: Some(42 + i as u64), logprobs, ..SamplingParams::default() };
            let mut r = GenRequest::new(format!("c{i}"), prompt.to_vec(), sampling, max_tokens);
            r.ignore_eos = true;
            r.prompt_logprobs = logprobs;
            r
        })
        .collect()
}

fn run_choices(e: &Engine, reqs: Vec<GenRequest>) -> Vec<Outcome> {
    let streams = e.submit_all(reqs).unwrap();
    let handles: Vec<_> = streams.into_iter().map(|s| std::thread::spawn(move || collect(s))).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn assert_same(got: &[Outcome], want: &[Outcome], case: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.ids, w.ids, "{case}: choice {i}");
        assert_eq!(g.text, w.text, "{case}: choice {i}");
        assert_eq!(g.logprobs, w.logprobs, "{case}: choice {i}");
        assert_eq!(g.prompt_logprobs, w.prompt_logprobs, "{case}: choice {i}");
        assert_eq!(g.finish, w.finish, "{case}: choice {i}");
    }
}

/// The choices of one request share its prompt's prefill: the prompt runs through the model
/// once (echo + logprobs included, its logprobs computed once), then each choice decodes on
/// its own, and every choice is exactly what it is as a request of its own with its seed.
/// Prompts ending mid-block (the fork copies the partial block) and on a block boundary, a
/// prefill in several chunks, and QJL keys (whose exact keys the fork copies too).
#[test]
fn choices_share_one_prefill_and_equal_separate_requests() {
    let qjl = KvDtype { k: "qjl1-w64-s4".parse().unwrap(), v: "bf16".parse().unwrap() };
    for (kv, kv_name) in [(KvDtype::default(), "default"), (qjl, "qjl1")] {
        let e = engine(EngineConfig { max_num_batched_tokens: 64 + 16, kv_dtype: kv.into(), ..no_cache() });
        let long = tokens(&PROMPTS[1].repeat(8));
        let aligned = long[..long.len() / 16 * 16 - 16].to_vec();
        assert!(!long.len().is_multiple_of(16) && aligned.len() > 64, "{}", long.len());
        let mut varied = 0;
        for (prompt, n, logprobs) in [(&long, 4, Some(2)), (&aligned, 3, Some(0)), (&long, 3, None), (&aligned, 2, None)] {
            let case = format!("{kv_name}, {} prompt tokens, n={n}, logprobs {logprobs:?}", prompt.len());
            let (p, max_tokens) = (prompt.len(), 6);
            let reqs = choices(prompt, n, max_tokens, logprobs);
            let before = forwarded(&e);
            let alone: Vec<Outcome> = reqs.iter().map(|r| collect(e.submit(r.clone()).unwrap())).collect();
            assert_eq!(forwarded(&e) - before, n * (p + max_tokens - 1), "{case}: each request alone computes its prompt");
            let (before, prompt_before) = (forwarded(&e), metric(&e, "tessera_prompt_tokens_total"));
            let together = run_choices(&e, reqs);
            assert_eq!(forwarded(&e) - before, p + n * (max_tokens - 1), "{case}: one prefill, then n decodes");
            assert_eq!(metric(&e, "tessera_prompt_tokens_total") - prompt_before, p as f64, "{case}");
            assert_same(&together, &alone, &case);
            if logprobs.is_some() {
                assert_eq!(together[0].prompt_logprobs.len(), p, "{case}");
            }
            let distinct: std::collections::HashSet<_> = together.iter().map(|o| o.ids.clone()).collect();
            varied += usize::from(distinct.len() > 1);
            assert_eq!(metric(&e, "tessera_kv_cache_blocks_used"), 0.0, "{case}");
        }
        assert!(varied > 0, "{kv_name}: the seeds give different continuations");
        // Scoring only (echo with max_tokens 0): the prompt's logprobs once for every choice.
        let mut reqs = choices(&long, 3, 0, Some(1));
        reqs.iter_mut().for_each(|r| r.sampling = SamplingParams::greedy());
        let alone = collect(e.submit(reqs[0].clone()).unwrap());
        let before = forwarded(&e);
        let together = run_choices(&e, reqs);
        assert_eq!(forwarded(&e) - before, long.len());
        for o in &together {
            assert_eq!((&o.prompt_logprobs, &o.finish), (&alone.prompt_logprobs, &alone.finish));
        }
        e.shutdown(Duration::from_secs(1));
    }
}

/// When the choice computing the shared prompt goes away before its prefill ends, the next
/// choice takes over the prefill; the others still fork from it and finish as they would alone.
#[test]
fn aborting_the_prefilling_choice_hands_the_prefill_to_the_next() {
    let e = engine(EngineConfig { max_num_batched_tokens: 32 + 16, ..no_cache() });
    let prompt = tokens(&PROMPTS[1].repeat(10));
    let reqs = choices(&prompt, 3, 5, Some(1));
    let alone: Vec<Outcome> = reqs[1..].iter().map(|r| collect(e.submit(r.clone()).unwrap())).collect();
    let mut streams = e.submit_all(reqs).unwrap().into_iter();
    let first = streams.next().unwrap();
    drop(first); // aborted while waiting or in the middle of its prefill
    let rest: Vec<Outcome> = streams.map(collect).collect();
    assert_same(&rest, &alone, "after the abort");
    let t = Instant::now();
    while metric(&e, "tessera_kv_cache_blocks_used") != 0.0 {
        assert!(t.elapsed() < Duration::from_secs(5), "blocks not freed");
        std::thread::sleep(Duration::from_millis(5));
    }
    e.shutdown(Duration::from_secs(1));
}

/// A request with more sequences than the waiting queue holds is refused as such at once
/// (nothing queued), whatever is running; one that fits only later is `QueueFull`.
#[test]
fn more_choices_than_the_queue_holds_are_refused_up_front() {
    let e = engine(EngineConfig { max_waiting: 4, max_num_seqs: 1, max_num_batched_tokens: 64, ..no_cache() });
    let prompt = tokens(PROMPTS[0]);
    let five = choices(&prompt, 5, 2, None);
    assert_eq!(e.submit_all(five.clone()).err(), Some(SubmitError::TooManyChoices { choices: 5, max_waiting: 4 }));
    // Choices that need no engine work take no slot.
    let mut scoring_free = five.clone();
    scoring_free[4].max_tokens = 0;
    scoring_free[4].prompt_logprobs = None;
    let out = run_choices(&e, scoring_free);
    assert!(out[..4].iter().all(|o| o.ids.len() == 2) && out[4].ids.is_empty());
    // Four fit the queue, but not beside a running request that holds a slot.
    let busy = e.submit(greedy("busy", prompt.clone(), 400)).unwrap();
    let more = e.submit(greedy("queued", prompt.clone(), 2)).unwrap();
    assert!(matches!(e.submit_all(five[..4].to_vec()).err(), Some(SubmitError::QueueFull { .. })));
    drop(busy);
    assert_eq!(collect(more).ids.len(), 2);
    assert_eq!(run_choices(&e, five[..4].to_vec()).len(), 4, "refusals leaked no queue slot");
    e.shutdown(Duration::from_secs(1));
}

/// Forks under a pool too small for every choice at once: each choice still completes in
/// full (forked, or computing its prompt itself when no block was free for the copy, or
/// preempted and recomputed), and the pool drains.
#[test]
fn choices_complete_under_block_pressure() {
    let m = model();
    let bytes_per_block = m.model.config().num_layers * 2 * 16 * m.model.kv_width() * 4;
    let e = engine(EngineConfig { kv_cache_bytes: 12 * bytes_per_block, ..no_cache() });
    let prompt = tokens(PROMPTS[1]);
    assert!(!prompt.len().is_multiple_of(16));
    let out = run_choices(&e, choices(&prompt, 6, 60, None));
    for o in &out {
        let (reason, _, usage) = o.finish.clone().unwrap();
        assert_eq!((reason, usage.completion_tokens, o.ids.len()), (FinishReason::Length, 60, 60));
    }
    assert!(metric(&e, "tessera_num_preemptions_total") > 0.0, "the pool was too small for all six");
    assert_eq!(metric(&e, "tessera_kv_cache_blocks_used"), 0.0);
    e.shutdown(Duration::from_secs(1));
}
