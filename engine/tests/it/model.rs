//! The default model against an independent reference: a numpy float64 forward pass over
//! weights dequantized by Python `gguf` (engine/tests/fixtures/make_reference_logits.py), which
//! uses llama.cpp's interleaved RoPE on the GGUF rows as stored, so it also checks that the
//! loader's Q/K un-permutation is right.

use crate::common;

use common::{fixture, model, model_with};
use serde_json::Value;
use tessera_engine::kv_cache::{LocalKv, SequenceKv};
use tessera_engine::model::{LlamaModel, SeqInput};
use tessera_engine::LoadedModel;
use tessera_engine::perplexity::{perplexity, PerplexityOptions};
use tessera_engine::sample::argmax;
use tessera_kernels::linear::LinearPolicy;

struct Case {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    logits: Vec<Vec<f32>>,
    greedy_continuation: Vec<u32>,
}

fn cases() -> (Value, Vec<Case>) {
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(fixture("model/reference_logits.json")).unwrap()).unwrap();
    let raw = std::fs::read(fixture("model/reference_logits.f32")).unwrap();
    let floats: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let ids = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let cases = spec["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let vocab = c["vocab"].as_u64().unwrap() as usize;
            let off = c["offset_floats"].as_u64().unwrap() as usize;
            let positions: Vec<usize> = c["positions"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            let logits = (0..positions.len()).map(|k| floats[off + k * vocab..off + (k + 1) * vocab].to_vec()).collect();
            Case { tokens: ids(&c["tokens"]), positions, logits, greedy_continuation: ids(&c["greedy_continuation_10"]) }
        })
        .collect();
    (spec, cases)
}

fn forward_all(m: &LlamaModel, tokens: &[u32]) -> Vec<f32> {
    let cfg = m.config();
    let mut kv = m.local_kv(cfg.max_position_embeddings);
    m.forward(&mut [SeqInput { tokens, kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0)
}

/// Max |difference| over a logits row, relative to the row's spread (max - min).
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let spread = want.iter().cloned().fold(f32::MIN, f32::max) - want.iter().cloned().fold(f32::MAX, f32::min);
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / spread
}

/// Float path (f32 activations, dequantized weights) vs the f64 reference: only f32
/// rounding separates them; measured <= 2e-6 of the logit spread, bound 1e-4.
/// Int8-activation path (llama.cpp's arithmetic): activation quantization adds error;
/// measured <= 2.5e-2 of the spread, bound 4e-2, and the argmax must agree.
#[test]
fn logits_match_independent_reference() {
    let vocab = model().model.config().vocab_size;
    let float = model_with(LinearPolicy::ALWAYS_GEMM);
    let int8 = model_with(LinearPolicy::ALWAYS_DOT);
    for c in cases().1 {
        for (m, bound, name) in [(&float.model, 1e-4, "float"), (&int8.model, 4e-2, "int8-act")] {
            let all = forward_all(m, &c.tokens);
            for (p, want) in c.positions.iter().zip(&c.logits) {
                let got = &all[p * vocab..(p + 1) * vocab];
                let e = rel_err(got, want);
                eprintln!("{name} len {} pos {p}: max |err| / spread = {e:.2e}", c.tokens.len());
                assert!(e < bound, "{name}: {} tokens, position {p}: relative error {e}", c.tokens.len());
                assert_eq!(argmax(got), argmax(want), "{name}: argmax at position {p}");
            }
        }
    }
}

/// Greedy continuation on the float path equals the reference's for all 10 tokens (its
/// smallest top-1/top-2 gap is 0.025 logits, far above the float path's ~1e-5 error), and the
/// default (int8-activation decode) path is deterministic run to run.
#[test]
fn greedy_generation_matches_reference_and_is_deterministic() {
    let float = model_with(LinearPolicy::ALWAYS_GEMM);
    let greedy = |m: &LlamaModel, prompt: &[u32], n: usize| {
        let cfg = m.config();
        let mut kv = m.local_kv(cfg.max_position_embeddings);
        let mut logits =
            m.forward(&mut [SeqInput { tokens: prompt, kv: &mut kv, logits_from: Some(prompt.len() - 1) }]).unwrap().swap_remove(0);
        let mut out = Vec::new();
        for _ in 0..n {
            let t = argmax(&logits);
            out.push(t);
            logits = m.forward(&mut [SeqInput { tokens: &[t], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0);
        }
        out
    };
    for c in cases().1 {
        assert_eq!(greedy(&float.model, &c.tokens, 10), c.greedy_continuation, "float-path greedy continuation");
        let a = greedy(&model().model, &c.tokens, 10);
        assert_eq!(a, greedy(&model().model, &c.tokens, 10), "greedy output must be deterministic");
    }
}

/// A batch of sequences of different lengths, and chunked prefill, give the same logits as
/// each sequence alone in one pass (same float kernels, so up to f32 reassociation).
#[test]
fn batched_and_chunked_forward_equal_single_sequence() {
    let lm = model_with(LinearPolicy::ALWAYS_GEMM);
    let m = &lm.model;
    let vocab = m.config().vocab_size;
    let (_, cs) = cases();
    let seqs: Vec<&[u32]> = cs.iter().map(|c| c.tokens.as_slice()).collect();
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| forward_all(m, s)).collect();

    let mut caches: Vec<LocalKv> = seqs.iter().map(|_| m.local_kv(4096)).collect();
    let mut batch: Vec<SeqInput<'_>> =
        seqs.iter().zip(caches.iter_mut()).map(|(s, kv)| SeqInput { tokens: s, kv, logits_from: Some(0) }).collect();
    let batched = m.forward(&mut batch).unwrap();
    for (b, a) in batched.iter().zip(&alone) {
        for (rb, ra) in b.chunks(vocab).zip(a.chunks(vocab)) {
            assert!(rel_err(rb, ra) < 1e-4, "batched vs alone: {}", rel_err(rb, ra));
        }
    }

    // Chunked prefill of the longest sequence: 37 + 50 + 13 tokens.
    let long = seqs.iter().max_by_key(|s| s.len()).unwrap();
    let mut kv = m.local_kv(4096);
    let mut rows = Vec::new();
    let mut at = 0;
    for n in [37, 50, long.len() - 87] {
        rows.extend(m.forward(&mut [SeqInput { tokens: &long[at..at + n], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0));
        at += n;
    }
    assert_eq!(kv.len(), long.len());
    let a = &alone[seqs.iter().position(|s| s.len() == long.len()).unwrap()];
    for (rc, ra) in rows.chunks(vocab).zip(a.chunks(vocab)) {
        assert!(rel_err(rc, ra) < 1e-4, "chunked vs one pass: {}", rel_err(rc, ra));
    }
}

/// The first two perplexity windows equal the numpy reference's figure: the float path must
/// land within 0.05% (f32 vs f64 arithmetic only).
#[test]
fn perplexity_matches_reference_on_two_chunks() {
    let (spec, _) = cases();
    let want = spec["perplexity"]["ppl_first_2_chunks"].as_f64().unwrap();
    let lm = model_with(LinearPolicy::ALWAYS_GEMM);
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/pride_and_prejudice.txt")).unwrap();
    let tokens = lm.tokenizer.encode(&text).unwrap();
    let first: Vec<u32> = spec["perplexity"]["first_tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    assert_eq!(tokens[..first.len()], first[..], "corpus tokenization");
    let opts = PerplexityOptions { chunks: Some(2), ..PerplexityOptions::new(512, 2) };
    let r = perplexity(std::sync::Arc::new(lm), &tokens, &opts, |_| {}).unwrap();
    assert_eq!((r.chunks, r.count), (2, 510));
    let rel = (r.ppl() - want).abs() / want;
    assert!(rel < 5e-4, "ppl {} vs reference {want} ({:.3}%)", r.ppl(), rel * 100.0);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let m = &model().model;
    let mut kv = m.local_kv(16);
    let e = m.forward(&mut [SeqInput { tokens: &[1, 999_999], kv: &mut kv, logits_from: None }]).unwrap_err();
    assert!(e.to_string().contains("999999"), "{e}");
    let long = vec![1u32; 17];
    let e = m.forward(&mut [SeqInput { tokens: &long, kv: &mut kv, logits_from: None }]).unwrap_err();
    assert!(e.to_string().contains("capacity"), "{e}");
    assert_eq!(kv.len(), 0, "a refused batch leaves the cache untouched");
}

/// Forward passes from several threads at once (sharing the kernel pool and its scratch
/// buffers) give exactly the results of running them one by one.
#[test]
fn concurrent_forward_passes_do_not_interfere() {
    let lm = model_with(LinearPolicy::ALWAYS_GEMM);
    let m = &lm.model;
    let (_, cs) = cases();
    let sequential: Vec<Vec<f32>> = cs.iter().map(|c| forward_all(m, &c.tokens)).collect();
    for _ in 0..3 {
        let concurrent: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = cs.iter().map(|c| s.spawn(|| forward_all(m, &c.tokens))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(concurrent, sequential);
    }
}

/// Batching does not change results: with the default policy (the integer GEMM at every
/// length) and with one that switches paths per sequence (integer GEMM below 32 tokens, the
/// f32 GEMM from 32), every sequence's logits are bit-identical alone, batched together,
/// and batched with another sequence's long prefill.
#[test]
fn batching_does_not_change_results() {
    let switching = model_with(LinearPolicy { gemm_min_tokens: 32, integer_gemm_min_tokens: 32, ..LinearPolicy::DEFAULT });
    for lm in [&**model(), &switching] {
        batching_invariance(&lm.model);
    }
}

fn batching_invariance(m: &LlamaModel) {
    let (_, cs) = cases();
    let prompts: Vec<&[u32]> = cs.iter().map(|c| c.tokens.as_slice()).collect();
    let new_kv = || m.local_kv(1024);
    let steps = 4;

    // Alone: prefill, then greedy steps; every logits row recorded.
    let alone: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .map(|p| {
            let mut kv = new_kv();
            let mut rows = vec![m.forward(&mut [SeqInput { tokens: p, kv: &mut kv, logits_from: Some(p.len() - 1) }]).unwrap().swap_remove(0)];
            for _ in 0..steps {
                let t = argmax(rows.last().unwrap());
                rows.push(m.forward(&mut [SeqInput { tokens: &[t], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0));
            }
            rows
        })
        .collect();

    // Together: one prefill batch, then decode steps batched.
    let mut kvs: Vec<LocalKv> = prompts.iter().map(|_| new_kv()).collect();
    let mut batch: Vec<SeqInput<'_>> =
        prompts.iter().zip(kvs.iter_mut()).map(|(p, kv)| SeqInput { tokens: p, kv, logits_from: Some(p.len() - 1) }).collect();
    let mut last = m.forward(&mut batch).unwrap();
    drop(batch);
    for step in 0..=steps {
        for (i, (l, a)) in last.iter().zip(&alone).enumerate() {
            assert!(*l == a[step], "sequence {i} step {step}: batched logits differ from alone");
        }
        if step == steps {
            break;
        }
        let next: Vec<u32> = last.iter().map(|l| argmax(l)).collect();
        let mut batch: Vec<SeqInput<'_>> = next
            .iter()
            .zip(kvs.iter_mut())
            .map(|(t, kv)| SeqInput { tokens: std::slice::from_ref(t), kv, logits_from: Some(0) })
            .collect();
        last = m.forward(&mut batch).unwrap();
    }

    // Staggered: sequence 1 decodes in the same pass as sequence 3's 100-token prefill.
    let (mut kv1, mut kv3) = (new_kv(), new_kv());
    let first = m.forward(&mut [SeqInput { tokens: prompts[1], kv: &mut kv1, logits_from: Some(prompts[1].len() - 1) }]).unwrap();
    let t = argmax(&first[0]);
    let mixed = m
        .forward(&mut [
            SeqInput { tokens: &[t], kv: &mut kv1, logits_from: Some(0) },
            SeqInput { tokens: prompts[3], kv: &mut kv3, logits_from: Some(prompts[3].len() - 1) },
        ])
        .unwrap();
    assert!(mixed[0] == alone[1][1], "decode step next to a long prefill differs from alone");
    assert!(mixed[1] == alone[3][0], "long prefill next to a decode step differs from alone");
}

/// The key transform (centering and balancing) leaves attention unchanged: with keys stored
/// exactly (f32) but shifted by large random per-layer centers and divided by random
/// per-channel scales (0.25 to 4), the logits equal the untransformed ones up to f32 rounding
/// of the transformed keys, queries and scores (bound 1e-4 of the logit spread), on the
/// prefill path and on a decode step. The float path is used: with int8 activations a
/// perturbation of 1e-6 already flips roundings (measured: 2.6% of the spread), which would
/// hide what this test is about.
#[test]
fn key_transform_is_invisible_to_attention() {
    use rand::{Rng, SeedableRng};
    let lm = model_with(LinearPolicy::ALWAYS_GEMM);
    let m = &lm.model;
    let tokens = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it rests.").unwrap();
    let plain = forward_all(m, &tokens);
    let mut layout = m.kv_layout(tessera_engine::kv_cache::KvDtype::default(), tessera_engine::kv_cache::DEFAULT_BLOCK_SIZE, 0).unwrap();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut random = |f: &mut dyn FnMut(&mut rand_chacha::ChaCha8Rng) -> f32| -> Vec<Vec<f32>> {
        (0..m.config().num_layers).map(|_| (0..m.kv_width()).map(|_| f(&mut r)).collect()).collect()
    };
    let centers = random(&mut |r| r.gen_range(-4.0..4.0));
    let scales = random(&mut |r| 2f32.powf(r.gen_range(-2.0..2.0)));
    let transform = tessera_engine::kv_cache::KeyTransform { centers, scales: Some(scales) };
    std::sync::Arc::get_mut(&mut layout).unwrap().set_key_transform(transform).unwrap();
    assert!(layout.describe().contains("keys centered and balanced"));
    let n = tokens.len();
    let vocab = m.config().vocab_size;
    let mut kv = LocalKv::new(layout, n);
    let prefill = m.forward(&mut [SeqInput { tokens: &tokens[..n - 1], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0);
    let step = m.forward(&mut [SeqInput { tokens: &tokens[n - 1..], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0);
    let transformed = [prefill, step].concat();
    for (t, (a, b)) in transformed.chunks(vocab).zip(plain.chunks(vocab)).enumerate() {
        let e = rel_err(a, b);
        assert!(e < 1e-4, "token {t}: transformed keys moved the logits by {e} of the spread");
    }
}

/// The calibration's centers equal the mean of the keys an f32 cache holds after the same
/// forward pass, read back page by page (an independent path), and centering on them removes
/// a large share of the key energy (what the compressed formats gain from). Balancing scales
/// come with the formats that spread their error over a head (tq3_0, qjl1), not with HQMQ.
#[test]
fn key_calibration_centers_are_the_cached_keys_mean() {
    use tessera_engine::kv_cache::KvDtype;
    use tessera_engine::model::key_calibration;
    let lm = model();
    let m = &lm.model;
    let tokens = lm.tokenizer.encode(key_calibration::CALIBRATION_TEXT).unwrap();
    let layout = |f: &str| m.kv_layout(KvDtype::both(f.parse().unwrap()), 16, 0).unwrap();
    let t = key_calibration::measure(m, &layout("tq3_0"), &tokens).unwrap();
    assert!(t.scales.is_some());
    assert!(layout("hqmq-s96-r4").wants_key_centers() && !layout("hqmq-s96-r4").wants_key_balance());
    let means = t.centers;
    let mut kv = m.local_kv(tokens.len());
    m.forward(&mut [SeqInput { tokens: &tokens, kv: &mut kv, logits_from: None }]).unwrap();
    let (hd, heads) = (m.config().head_dim, m.config().num_kv_heads);
    for (layer, mean) in means.iter().enumerate() {
        let view = kv.view(layer, tokens.len());
        let (mut sum, mut energy, mut row) = (vec![0f64; hd * heads], vec![0f64; 2], vec![0f32; hd]);
        let mut keys = Vec::new();
        for tile in &view.tiles {
            let pb = view.k.page_bytes(tile.slots);
            for slot in 0..tile.len {
                for g in 0..heads {
                    let page = tessera_kernels::kv::KvPage { bytes: &tile.keys[g * pb..(g + 1) * pb], tokens: tile.slots };
                    view.k.decode(g, page, slot..slot + 1, &mut row);
                    keys.extend_from_slice(&row);
                    row.iter().enumerate().for_each(|(c, &x)| sum[g * hd + c] += x as f64);
                }
            }
        }
        let n = tokens.len() as f64;
        for (c, (&got, s)) in mean.iter().zip(&sum).enumerate() {
            assert!((got as f64 - s / n).abs() <= 1e-5 * (1.0 + (s / n).abs()), "layer {layer} channel {c}: {got} vs {}", s / n);
        }
        for k in keys.chunks(hd * heads) {
            energy[0] += k.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
            energy[1] += k.iter().zip(mean).map(|(&x, &m)| (x as f64 - m as f64).powi(2)).sum::<f64>();
        }
        assert!(energy[1] < 0.8 * energy[0], "layer {layer}: centering kept {:.2} of the key energy", energy[1] / energy[0]);
    }
}

/// The key calibration generalizes: on text it never saw (Persuasion's chapter 20, 330k
/// characters into the book, past every window the calibration's constants were chosen on;
/// `scripts/heldout-texts.sh` extracts the whole book), TQ3_0 keys calibrated on the built-in
/// text track the f32 cache nearly as well as keys calibrated on that very chapter. Mean KL
/// per token over the second half of 1,024 tokens (as perplexity scores a window), f32
/// values, one pass each, measured: 0.0658 built-in, 0.0574 calibrated on the chapter itself
/// (1.15x); the calibration text's ~330-token first version gave 0.0768 (1.34x), so the
/// bound of 1.25x tells them apart.
#[test]
fn key_calibration_generalizes_to_held_out_text() {
    use tessera_engine::model::key_calibration;
    let lm = model();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/persuasion_chapter20.txt")).unwrap();
    let kl = Tq3KeysKl::new(lm, &text);
    let built_in = kl.calibrated_on(&lm.tokenizer.encode(key_calibration::CALIBRATION_TEXT).unwrap(), true);
    let itself = kl.calibrated_on(&kl.tokens, true);
    eprintln!("mean KL vs the f32 cache: built-in calibration {built_in:.5}, calibrated on the chapter itself {itself:.5}");
    assert!(built_in < 1.25 * itself, "the built-in calibration generalizes poorly: KL {built_in} vs {itself} calibrated on the text itself");
}

/// How far TQ3_0 keys (f32 values) move a model's predictions from an f32 cache's: mean KL
/// per token over the second half of the first 1,024 tokens of a text, as perplexity scores a
/// window.
struct Tq3KeysKl<'a> {
    lm: &'a LoadedModel,
    tokens: Vec<u32>,
    exact: Vec<Vec<f64>>,
}

impl<'a> Tq3KeysKl<'a> {
    fn new(lm: &'a LoadedModel, text: &str) -> Self {
        let mut tokens = lm.tokenizer.encode(text).unwrap();
        assert!(tokens.len() >= 1024, "{} tokens", tokens.len());
        tokens.truncate(1024);
        let mut kl = Tq3KeysKl { lm, tokens, exact: Vec::new() };
        kl.exact = kl.log_probs(lm.model.kv_layout(tessera_engine::kv_cache::KvDtype::default(), 16, 0).unwrap());
        kl
    }

    fn log_probs(&self, layout: std::sync::Arc<tessera_engine::kv_cache::KvLayout>) -> Vec<Vec<f64>> {
        let m = &self.lm.model;
        let mut kv = LocalKv::new(layout, self.tokens.len());
        let logits = m.forward(&mut [SeqInput { tokens: &self.tokens, kv: &mut kv, logits_from: Some(512) }]).unwrap().swap_remove(0);
        common::log_softmax_rows(&logits, m.config().vocab_size)
    }

    /// The mean KL with keys centered (and balanced when `balanced`) by statistics measured
    /// on `calibration`.
    fn calibrated_on(&self, calibration: &[u32], balanced: bool) -> f64 {
        use tessera_engine::kv_cache::KvDtype;
        use tessera_engine::model::key_calibration;
        use tessera_kernels::kv::KvFormat;
        let m = &self.lm.model;
        let mut layout = m.kv_layout(KvDtype { k: KvFormat::TQ3_0, v: KvFormat::F32 }, 16, 0).unwrap();
        let mut t = key_calibration::measure(m, &layout, calibration).unwrap();
        if !balanced {
            t.scales = None;
        }
        std::sync::Arc::get_mut(&mut layout).unwrap().set_key_transform(t).unwrap();
        common::mean_kl(&self.exact, &self.log_probs(layout))
    }
}

/// Balancing pays: with TQ3_0 keys (f32 values), the second half of 1,024 tokens of the
/// corpus (not the calibration text) gets logits closer to the f32 cache's when the keys are
/// centered and balanced than when they are only centered. Mean KL per token, measured: 0.0629
/// balanced vs 0.0983 centered only; the bound asks for a 10% gain. (Over the first 256
/// tokens alone, the positions the earlier ~330-token calibration text covered, the new text's
/// balancing does not help: 0.151 vs 0.148. Perplexity scores windows' second halves, where
/// it does: tq3_0 on Persuasion at ctx 1024, 33.87 balanced vs 35.01 centered only.)
#[test]
fn balanced_tq3_keys_track_the_float_cache_better() {
    use tessera_engine::model::key_calibration;
    let lm = model();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/pride_and_prejudice.txt")).unwrap();
    let kl = Tq3KeysKl::new(lm, &text[..8000]);
    let calibration = lm.tokenizer.encode(key_calibration::CALIBRATION_TEXT).unwrap();
    let (centered, balanced) = (kl.calibrated_on(&calibration, false), kl.calibrated_on(&calibration, true));
    eprintln!("mean KL vs the f32 cache: centered {centered:.5}, centered and balanced {balanced:.5}");
    assert!(balanced < 0.9 * centered, "balancing did not help: KL {balanced} vs {centered} centered only");
}
