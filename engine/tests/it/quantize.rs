//! `quantize::quantize_dir` against checkpoint-formats.md §2 (compressed-tensors) and §4
//! (Quark), checked by a decoder written here from that document (not calling the packers):
//! exact tensor names/dtypes/shapes, dequantized values within each scheme's error bound,
//! report numbers equal to the ones recomputed here, config.json fields, exclusions copied bit
//! for bit (fnmatch cases including the seed's MoE list), and errors that name the tensor.
//! Run on a small random BF16 directory (two shards, dense and MoE layers, an outlier column,
//! a zero row) and on the bf16 conversion of the default model.

use crate::common;

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use tessera_engine::convert::{to_hf_dir, ConvertOptions};
use tessera_engine::float_dtype::FloatDtype;
use tessera_engine::quantize::report::TensorStats;
use tessera_engine::quantize::{quantize_dir, Format, QuantizeOptions, QuantizeSummary, Recipe, Scheme};
use tessera_engine::weights::ModelWeights;

/// A tensor as stored: dtype, shape, bytes.
type Stored = (Dtype, Vec<usize>, Vec<u8>);

const H: usize = 64;

/// The random model's tensors (name, shape), by shard.
fn layout() -> [Vec<(String, Vec<usize>)>; 2] {
    let t = |n: &str, s: &[usize]| (n.to_string(), s.to_vec());
    let mut second = vec![
        t("model.layers.1.self_attn.o_proj.weight", &[H, H]),
        t("model.layers.1.mlp.gate.weight", &[4, H]),
        t("model.layers.1.mlp.shared_experts.up_proj.weight", &[32, H]),
        t("model.norm.weight", &[H]),
        t("lm_head.weight", &[128, H]),
    ];
    for e in 0..4 {
        second.push(t(&format!("model.layers.1.mlp.experts.{e}.gate_proj.weight"), &[32, H]));
        second.push(t(&format!("model.layers.1.mlp.experts.{e}.up_proj.weight"), &[32, H]));
        second.push(t(&format!("model.layers.1.mlp.experts.{e}.down_proj.weight"), &[H, 32]));
    }
    [
        vec![
            t("model.embed_tokens.weight", &[128, H]),
            t("model.layers.0.input_layernorm.weight", &[H]),
            t("model.layers.0.self_attn.q_proj.weight", &[H, H]),
            t("model.layers.0.self_attn.k_proj.weight", &[32, H]),
            t("model.layers.0.self_attn.v_proj.weight", &[32, H]),
            t("model.layers.0.self_attn.o_proj.weight", &[H, H]),
            t("model.layers.0.post_attention_layernorm.weight", &[H]),
            t("model.layers.0.mlp.gate_proj.weight", &[96, H]),
            t("model.layers.0.mlp.up_proj.weight", &[96, H]),
            t("model.layers.0.mlp.down_proj.weight", &[H, 96]),
        ],
        second,
    ]
}

/// Weights like a trained linear's: N(0, 0.02), column 5 of q_proj an outlier column (x25),
/// row 3 of o_proj all zeros, norms around 1.
fn values(name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let mut v: Vec<f32> = (0..n)
        .map(|_| {
            // Box-Muller.
            let (u1, u2): (f64, f64) = (rng.gen::<f64>().max(1e-12), rng.gen());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * 0.02
        })
        .collect();
    if shape.len() == 1 {
        v.iter_mut().for_each(|x| *x += 1.0);
    }
    if name.contains("layers.0.self_attn.q_proj") {
        (0..shape[0]).for_each(|r| v[r * shape[1] + 5] *= 25.0);
    }
    if name.contains("layers.0.self_attn.o_proj") {
        v[3 * shape[1]..4 * shape[1]].iter_mut().for_each(|x| *x = 0.0);
    }
    v
}

fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

fn write_shard(path: &Path, tensors: &BTreeMap<String, Stored>) {
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

fn shard_name(i: usize) -> String {
    format!("model-{:05}-of-00002.safetensors", i + 1)
}

/// Writes the random BF16 model (two shards + index, config, tokenizer files, a README that
/// must not be copied); `edit` may change a tensor before it is written. Returns its tensors.
fn random_dir(dir: &Path, edit: impl Fn(&str, &mut Stored)) -> BTreeMap<String, Stored> {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut all = BTreeMap::new();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in layout().iter().enumerate() {
        let mut tensors = BTreeMap::new();
        for (name, shape) in shard {
            let bytes = FloatDtype::BF16.encode(&values(name, shape, &mut rng));
            let mut t = (Dtype::BF16, shape.clone(), bytes);
            edit(name, &mut t);
            tensors.insert(name.clone(), t);
            weight_map.insert(name.clone(), shard_name(i));
        }
        write_shard(&dir.join(shard_name(i)), &tensors);
        all.extend(tensors);
    }
    write_json(&dir.join("model.safetensors.index.json"), &json!({ "metadata": {}, "weight_map": weight_map }));
    write_json(
        &dir.join("config.json"),
        &json!({ "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": 2, "torch_dtype": "bfloat16" }),
    );
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "README.md"] {
        std::fs::write(dir.join(f), format!("{{\"file\": \"{f}\"}}")).unwrap();
    }
    all
}

/// Every tensor of an output directory, by name, checked against its index.
fn read_output(dir: &Path) -> BTreeMap<String, Stored> {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let mut out = BTreeMap::new();
    let mut total = 0;
    let files: std::collections::BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    for file in files {
        let bytes = std::fs::read(dir.join(file)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            assert_eq!(map[&name], file, "{name} is in {file}, index says {}", map[&name]);
            total += view.data().len();
            out.insert(name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    assert_eq!(out.len(), map.len(), "index lists tensors that are not in the shards");
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));
    out
}

/// What the output of one quantized linear must look like, from checkpoint-formats.md.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// compressed-tensors pack-quantized int4 with `group` columns per scale (`None`: channel),
    /// with zero points when `asym`.
    CtInt4 { group: Option<usize>, asym: bool },
    /// compressed-tensors int-quantized int8.
    CtInt8,
    /// compressed-tensors float-quantized FP8.
    CtFp8,
    /// Quark W4A8 (FP8 per tensor, INT4 per channel, reorder packing).
    QuarkW4A8,
    /// Quark FP8 per channel.
    QuarkFp8,
    /// Quark int8 per channel.
    QuarkInt8,
}

impl Layout {
    fn of(recipe: Recipe) -> Self {
        use tessera_engine::quantize::{compressed_tensors as ct, quark};
        match recipe {
            Recipe::CompressedTensors(ct::Scheme::Int4 { group, asymmetric, .. }) => Layout::CtInt4 { group, asym: asymmetric },
            Recipe::CompressedTensors(ct::Scheme::Int8) => Layout::CtInt8,
            Recipe::CompressedTensors(ct::Scheme::Fp8) => Layout::CtFp8,
            Recipe::Quark(quark::Scheme::W4A8) => Layout::QuarkW4A8,
            Recipe::Quark(quark::Scheme::Fp8) => Layout::QuarkFp8,
            Recipe::Quark(quark::Scheme::Int8) => Layout::QuarkInt8,
        }
    }

    /// Columns sharing one scale.
    fn block(self, cols: usize) -> usize {
        match self {
            Layout::CtInt4 { group: Some(g), .. } => g,
            _ => cols,
        }
    }

    /// (suffix, dtype, shape) of every tensor written for a `[rows, cols]` weight (BF16 input).
    fn tensors(self, rows: usize, cols: usize) -> Vec<(&'static str, Dtype, Vec<usize>)> {
        match self {
            Layout::CtInt4 { asym, .. } => {
                let groups = cols.div_ceil(self.block(cols));
                let mut t = vec![
                    ("weight_packed", Dtype::I32, vec![rows, cols / 8]),
                    ("weight_scale", Dtype::BF16, vec![rows, groups]),
                    ("weight_shape", Dtype::I64, vec![2]),
                ];
                if asym {
                    t.push(("weight_zero_point", Dtype::I32, vec![rows.div_ceil(8), groups]));
                }
                t
            }
            Layout::CtInt8 => vec![("weight", Dtype::I8, vec![rows, cols]), ("weight_scale", Dtype::BF16, vec![rows, 1])],
            Layout::CtFp8 => vec![("weight", Dtype::F8_E4M3, vec![rows, cols]), ("weight_scale", Dtype::BF16, vec![rows, 1])],
            Layout::QuarkW4A8 => vec![
                ("weight", Dtype::I32, vec![rows, cols / 8]),
                ("weight_scale", Dtype::F32, vec![]),
                ("weight_scale_2", Dtype::F32, vec![rows]),
            ],
            Layout::QuarkFp8 => vec![("weight", Dtype::F8_E4M3, vec![rows, cols]), ("weight_scale", Dtype::F32, vec![rows])],
            Layout::QuarkInt8 => vec![("weight", Dtype::I8, vec![rows, cols]), ("weight_scale", Dtype::F32, vec![rows])],
        }
    }
}

/// OCP E4M3: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal.
fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    assert!(!(e == 15 && m == 7.0), "NaN code written");
    sign * if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

fn f32s(t: &Stored) -> Vec<f32> {
    match t.0 {
        Dtype::F32 => t.2.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        Dtype::BF16 => t.2.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        d => panic!("scale dtype {d:?}"),
    }
}

fn words(t: &Stored) -> Vec<u32> {
    t.2.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Decodes one layer from the doc's description; checks each value's error bound against the
/// input `w`. Returns Ŵ.
fn decode_and_bound(layout: Layout, prefix: &str, out: &BTreeMap<String, Stored>, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let get = |s: &str| out.get(&format!("{prefix}.{s}")).unwrap_or_else(|| panic!("{prefix}.{s} missing"));
    let mut w_hat = vec![0f32; rows * cols];
    match layout {
        Layout::CtInt4 { .. } | Layout::CtInt8 | Layout::QuarkInt8 => {
            let (q, div, qmin, qmax): (Vec<i32>, f32, i32, i32) = if let Layout::CtInt4 { .. } = layout {
                let shape: Vec<i64> = get("weight_shape").2.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
                assert_eq!(shape, vec![rows as i64, cols as i64]);
                // Word k of a row holds columns 8k..8k+7, column 8k+j in nibble j, stored as q + 8.
                (words(get("weight_packed")).iter().flat_map(|&x| (0..8).map(move |j| ((x >> (4 * j)) & 0xF) as i32 - 8)).collect(), 7.5, -8, 7)
            } else {
                (get("weight").2.iter().map(|&b| b as i8 as i32).collect(), 127.0, -127, 127)
            };
            let scales = f32s(get("weight_scale"));
            let block = layout.block(cols);
            let groups = cols.div_ceil(block);
            if let Layout::CtInt4 { asym: true, .. } = layout {
                // Zero point of row r, group g: nibble r % 8 of word [r / 8, g], stored as zp + 8.
                let zw = words(get("weight_zero_point"));
                let nib = |r: usize, g: usize| ((zw[(r / 8) * groups + g] >> (4 * (r % 8))) & 0xF) as i32;
                for r in rows..rows.div_ceil(8) * 8 {
                    (0..groups).for_each(|g| assert_eq!(nib(r, g), 0, "{prefix}: padding nibble of row {r}"));
                }
                for r in 0..rows {
                    for (g, wg) in w[r * cols..(r + 1) * cols].chunks(block).enumerate() {
                        let (s, zp) = (scales[r * groups + g], nib(r, g) - 8);
                        // The range includes 0; scale over 15 steps, zp = qmin - round(min / scale).
                        let (lo, hi) = wg.iter().fold((0f32, 0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                        assert_eq!(s, bf16::from_f32(((hi - lo) / 15.0).max(f32::EPSILON)).to_f32(), "{prefix} row {r} group {g}: scale rule");
                        assert_eq!(zp, ((-lo / s).round_ties_even() as i32 - 8).clamp(-8, 7), "{prefix} row {r} group {g}: zero point");
                        let exact = (hi - lo) as f64 / 15.0;
                        let bound = 0.5 * s as f64 + 15.0 * (exact - s as f64).max(0.0) + 1e-6 * s as f64;
                        for (j, &x) in wg.iter().enumerate() {
                            let i = r * cols + g * block + j;
                            assert_eq!(q[i], ((x / s).round_ties_even() as i32 + zp).clamp(-8, 7), "{prefix}[{i}]: q rule");
                            w_hat[i] = (q[i] - zp) as f32 * s;
                            let e = (x as f64 - w_hat[i] as f64).abs();
                            assert!(e <= bound, "{prefix}[{i}]: |{x} - {}| = {e} > {bound}", w_hat[i]);
                        }
                    }
                }
                return w_hat;
            }
            for r in 0..rows {
                for (g, wg) in w[r * cols..(r + 1) * cols].chunks(block).enumerate() {
                    let s = scales[r * groups + g];
                    let amax = wg.iter().fold(0f32, |m, x| m.max(x.abs()));
                    // compressed-tensors writes scales in the input's dtype (BF16 here), Quark in F32.
                    let rule = (amax / div).max(f32::EPSILON);
                    let rule = if let Layout::QuarkInt8 = layout { rule } else { bf16::from_f32(rule).to_f32() };
                    assert_eq!(s, rule, "{prefix} row {r} group {g}: scale rule");
                    let exact = amax as f64 / div as f64;
                    let bound = 0.5 * s as f64 + div as f64 * (exact - s as f64).max(0.0) + 1e-6 * s as f64;
                    for (j, &x) in wg.iter().enumerate() {
                        let i = r * cols + g * block + j;
                        assert!((qmin..=qmax).contains(&q[i]), "{prefix}[{i}] = {} out of range", q[i]);
                        w_hat[i] = q[i] as f32 * s;
                        // With an f32 scale the product q · s itself rounds (half an f32 ulp).
                        let bound = bound + w_hat[i].abs() as f64 * 2f64.powi(-24);
                        let e = (x as f64 - w_hat[i] as f64).abs();
                        assert!(e <= bound, "{prefix}[{i}]: |{x} - {}| = {e} > {bound}", w_hat[i]);
                    }
                }
            }
        }
        Layout::CtFp8 | Layout::QuarkFp8 => {
            let codes = &get("weight").2;
            let scales = f32s(get("weight_scale"));
            assert_eq!(scales.len(), rows);
            for (r, &s) in scales.iter().enumerate() {
                for c in 0..cols {
                    let i = r * cols + c;
                    w_hat[i] = e4m3(codes[i]) * s;
                    // Normal range: half a 3-bit-mantissa ulp, 2^-4 relative; subnormals: 2^-10 * scale.
                    let bound = (w[i].abs() as f64 * 2f64.powi(-4)).max(s as f64 * 2f64.powi(-10)) * (1.0 + 1e-6);
                    let e = (w[i] as f64 - w_hat[i] as f64).abs();
                    assert!(e <= bound, "{prefix}[{i}]: |{} - {}| = {e} > {bound}", w[i], w_hat[i]);
                }
            }
        }
        Layout::QuarkW4A8 => {
            let s0 = f32s(get("weight_scale"));
            assert_eq!(s0.len(), 1);
            let s2 = f32s(get("weight_scale_2"));
            // Element k of each group of 8 sits in nibble [0,4,1,5,2,6,3,7][k], two's complement.
            let nib = [0, 4, 1, 5, 2, 6, 3, 7];
            let q: Vec<i32> = words(get("weight"))
                .iter()
                .flat_map(|&x| nib.map(|n| {
                    let v = ((x >> (4 * n)) & 0xF) as i32;
                    if v >= 8 { v - 16 } else { v }
                }))
                .collect();
            assert_eq!(s2.len(), rows);
            for (r, &s2r) in s2.iter().enumerate() {
                for c in 0..cols {
                    let i = r * cols + c;
                    w_hat[i] = q[i] as f32 * s2r * s0[0];
                    let fp8 = (w[i].abs() as f64 * 2f64.powi(-4)).max(s0[0] as f64 * 2f64.powi(-10));
                    let bound = (fp8 + 0.5 * s2r as f64 * s0[0] as f64) * (1.0 + 1e-5);
                    let e = (w[i] as f64 - w_hat[i] as f64).abs();
                    assert!(e <= bound, "{prefix}[{i}]: |{} - {}| = {e} > {bound}", w[i], w_hat[i]);
                }
            }
        }
    }
    w_hat
}

/// Report numbers recomputed from the independent decode.
fn check_stats(st: &TensorStats, w: &[f32], w_hat: &[f32], cols: usize, block: usize) {
    let n = w.len() as f64;
    let err: Vec<f64> = w.iter().zip(w_hat).map(|(&a, &b)| (a as f64 - b as f64).abs()).collect();
    let norm = w.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let sq: f64 = err.iter().map(|e| e * e).sum();
    // The decoders may round Ŵ's products in a different order: f32 noise, 1e-6 relative.
    let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-30), "{}: {what} {a} vs {b}", st.name);
    close(st.rmse, (sq / n).sqrt(), "rmse");
    close(st.mae, err.iter().sum::<f64>() / n, "mae");
    close(st.max_abs_err, err.iter().cloned().fold(0.0, f64::max), "max_abs_err");
    close(st.rel_err, sq.sqrt() / norm, "rel_err");
    let zc = w.iter().zip(w_hat).filter(|(&a, &b)| a != 0.0 && b == 0.0).count() as u64;
    assert_eq!(st.zero_collapse, zc, "{}: zero collapse", st.name);
    let spiky = w
        .chunks(cols)
        .flat_map(|row| row.chunks(block))
        .filter(|b| {
            // The largest magnitude against the RMS of the others.
            let k = (0..b.len()).max_by(|&i, &j| b[i].abs().total_cmp(&b[j].abs())).unwrap();
            let others: f64 = b.iter().enumerate().filter(|&(i, _)| i != k).map(|(_, &x)| x as f64 * x as f64).sum();
            b[k].abs() as f64 > 8.0 * (others / (b.len() - 1) as f64).sqrt()
        })
        .count() as u64;
    assert_eq!((st.spiky_blocks, st.blocks), (spiky, (w.len() / cols * cols.div_ceil(block)) as u64), "{}: spiky blocks", st.name);
    assert_eq!(st.shape, [w.len() / cols, cols]);
}

/// Checks every output tensor of a run: quantized layers have exactly the documented tensors
/// and decode within bounds to what the report says; everything else is a bit-identical copy.
/// Returns the names of the quantized modules.
fn check_output(recipe: Recipe, input: &BTreeMap<String, Stored>, dir: &Path, s: &QuantizeSummary) -> Vec<String> {
    let out = read_output(dir);
    let layout = Layout::of(recipe);
    let stats: BTreeMap<&str, &TensorStats> = s.report.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut quantized = Vec::new();
    let mut expected_names = Vec::new();
    for (name, t) in input {
        if let Some(st) = stats.get(name.as_str()) {
            let prefix = name.strip_suffix(".weight").unwrap();
            let (rows, cols) = (t.1[0], t.1[1]);
            for (suffix, dtype, shape) in layout.tensors(rows, cols) {
                let full = format!("{prefix}.{suffix}");
                let got = out.get(&full).unwrap_or_else(|| panic!("{full} missing"));
                assert_eq!((got.0, &got.1), (dtype, &shape), "{full}");
                expected_names.push(full);
            }
            let w = f32s(t);
            let w_hat = decode_and_bound(layout, prefix, &out, &w, rows, cols);
            check_stats(st, &w, &w_hat, cols, layout.block(cols));
            quantized.push(prefix.to_string());
        } else {
            assert_eq!(out.get(name), Some(t), "{name} must be copied unchanged");
            expected_names.push(name.clone());
        }
    }
    expected_names.sort();
    assert_eq!(out.keys().cloned().collect::<Vec<_>>(), expected_names, "exactly the documented tensors");
    assert_eq!(s.report.tensors.len(), quantized.len());
    quantized
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn run(input: &Path, out: &Path, recipe: Recipe, exclude: &[&str], experts_only: bool) -> Result<QuantizeSummary, String> {
    run_with_head(input, out, recipe, exclude, experts_only, None)
}

fn run_with_head(input: &Path, out: &Path, recipe: Recipe, exclude: &[&str], experts_only: bool, head: Option<Recipe>) -> Result<QuantizeSummary, String> {
    let opts = QuantizeOptions {
        input: input.into(),
        output: out.into(),
        recipe,
        exclude: exclude.iter().map(|s| s.to_string()).collect(),
        experts_only,
        calibrated: None,
        mse_observer: false,
        head,
        progress: Default::default(),
    };
    quantize_dir(&opts).map_err(|e| e.to_string())
}

/// `--lm-head`: the output head quantized by its own recipe in the model's format (a second
/// compressed-tensors group targeting it, a Quark `layer_quant_config` entry), every other
/// tensor as without it; a tied head written untied from the embedding.
#[test]
fn output_head_gets_its_own_recipe_and_a_tied_one_is_untied() {
    let dir = tempfile::tempdir().unwrap();
    let input = random_dir(dir.path(), |_, _| {});
    let body_ignored = ["model.layers.1.mlp.gate"];
    for body in [Recipe::resolve(Scheme::W4A16, None, Some(32), false).unwrap(), Recipe::resolve(Scheme::W4A8, None, None, false).unwrap()] {
        let head = Recipe::head(Scheme::W8A8Int8, &body).unwrap();
        assert_eq!(head.format(), body.format());
        let (plain, with_head) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        run(dir.path(), plain.path(), body, &[], false).unwrap();
        let s = run_with_head(dir.path(), with_head.path(), body, &[], false, Some(head)).unwrap();
        assert_eq!(s.ignored, body_ignored);
        assert_eq!(s.report.tensors.len(), 22, "21 projections and the head");
        let (a, b) = (read_output(plain.path()), read_output(with_head.path()));
        let head_names: Vec<&String> = b.keys().filter(|n| n.starts_with("lm_head.")).collect();
        assert_eq!(head_names, ["lm_head.weight", "lm_head.weight_scale"]);
        for (name, t) in &b {
            if !name.starts_with("lm_head.") {
                assert_eq!(a.get(name), Some(t), "{name}: the body does not depend on the head's recipe");
            }
        }
        decode_and_bound(Layout::of(head), "lm_head", &b, &f32s(&input["lm_head.weight"]), 128, H);
        let q = &config(with_head.path())["quantization_config"];
        match body.format() {
            Format::CompressedTensors => {
                assert_eq!(q["ignore"], json!(body_ignored));
                assert_eq!(q["format"], "mixed-precision", "two groups of different formats");
                let g = &q["config_groups"]["group_1"];
                assert_eq!((g["targets"].clone(), g["format"].as_str()), (json!(["lm_head"]), Some("int-quantized")));
                assert_eq!((g["weights"]["num_bits"].as_u64(), g["input_activations"]["strategy"].as_str()), (Some(8), Some("token")));
            }
            Format::Quark => {
                assert_eq!(q["exclude"], json!(body_ignored));
                let l = &q["layer_quant_config"]["lm_head"];
                assert_eq!((l["weight"]["dtype"].as_str(), l["weight"]["qscheme"].as_str()), (Some("int8"), Some("per_channel")));
                assert_eq!((l["input_tensors"]["dtype"].as_str(), l["input_tensors"]["is_dynamic"].as_bool()), (Some("int8"), Some(true)));
            }
        }
    }

    // Tied: the config ties the head to the embedding and no shard stores it.
    let tied = tempfile::tempdir().unwrap();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in layout().iter().enumerate() {
        let tensors: BTreeMap<String, Stored> = shard.iter().filter(|(n, _)| n != "lm_head.weight").map(|(n, _)| (n.clone(), input[n].clone())).collect();
        weight_map.extend(tensors.keys().map(|n| (n.clone(), shard_name(i))));
        write_shard(&tied.path().join(shard_name(i)), &tensors);
    }
    write_json(&tied.path().join("model.safetensors.index.json"), &json!({ "metadata": {}, "weight_map": weight_map }));
    let tied_config = json!({ "model_type": "llama", "hidden_size": H, "tie_word_embeddings": true });
    write_json(&tied.path().join("config.json"), &tied_config);
    let int8 = Recipe::resolve(Scheme::W8A8Int8, None, None, false).unwrap();
    let out = tempfile::tempdir().unwrap();
    run_with_head(tied.path(), out.path(), int8, &[], false, Some(int8)).unwrap();
    let b = read_output(out.path());
    assert_eq!(b["model.embed_tokens.weight"], input["model.embed_tokens.weight"], "the embedding stays as it is");
    decode_and_bound(Layout::CtInt8, "lm_head", &b, &f32s(&input["model.embed_tokens.weight"]), 128, H);
    let cfg = config(out.path());
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert_eq!(cfg["quantization_config"]["config_groups"]["group_1"]["targets"], json!(["lm_head"]));
    assert_eq!(cfg["quantization_config"]["format"], "int-quantized", "one format in both groups");
    // Without --lm-head a tied model stays tied.
    let plain = tempfile::tempdir().unwrap();
    run(tied.path(), plain.path(), int8, &[], false).unwrap();
    assert_eq!(config(plain.path())["tie_word_embeddings"], true);
    assert!(!read_output(plain.path()).contains_key("lm_head.weight"));

    // A tied config whose shards also store a head is contradictory: refused, naming the tensor.
    write_json(&dir.path().join("config.json"), &tied_config);
    let e = run_with_head(dir.path(), out.path(), int8, &[], false, Some(int8)).unwrap_err();
    assert!(e.contains("lm_head.weight") && e.contains("ties"), "{e}");
    // A head recipe in another format than the model's is refused.
    let quark_fp8 = Recipe::resolve(Scheme::W8A8Fp8, Some(Format::Quark), None, false).unwrap();
    let e = run_with_head(tied.path(), out.path(), int8, &[], false, Some(quark_fp8)).unwrap_err();
    assert!(e.contains("output head's recipe is in quark format"), "{e}");
    // --lm-head contradicted by --experts-only or an --exclude matching the head.
    let e = run_with_head(tied.path(), out.path(), int8, &[], true, Some(int8)).unwrap_err();
    assert!(e.contains("--experts-only"), "{e}");
    let e = run_with_head(tied.path(), out.path(), int8, &["lm_*"], false, Some(int8)).unwrap_err();
    assert!(e.contains("\"lm_*\" matches lm_head"), "{e}");
    // Neither tied nor stored: there is no head to quantize.
    write_json(&tied.path().join("config.json"), &json!({ "model_type": "llama", "hidden_size": H }));
    let e = run_with_head(tied.path(), out.path(), int8, &[], false, Some(int8)).unwrap_err();
    assert!(e.contains("no shard holds lm_head.weight"), "{e}");
}

/// The seven scheme/format pairs (w4a16 with group 32: the random model has 96-column layers).
fn recipes(group: usize) -> Vec<Recipe> {
    [
        (Scheme::W4A16, None, Some(group)),
        (Scheme::W4A8, None, None),
        (Scheme::W4A8, Some(Format::CompressedTensors), None),
        (Scheme::W8A8Int8, None, None),
        (Scheme::W8A8Fp8, None, None),
        (Scheme::W8A8Fp8, Some(Format::Quark), None),
        (Scheme::W8A8Int8, Some(Format::Quark), None),
    ]
    .into_iter()
    .map(|(s, f, g)| Recipe::resolve(s, f, g, false).unwrap())
    .collect()
}

/// Every linear module of the random model that is not quantized by default.
const DEFAULT_IGNORED: [&str; 2] = ["lm_head", "model.layers.1.mlp.gate"];

#[test]
fn every_scheme_writes_the_documented_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let input = random_dir(dir.path(), |_, _| {});
    for recipe in recipes(32) {
        let out = tempfile::tempdir().unwrap();
        let s = run(dir.path(), out.path(), recipe, &[], false).unwrap();
        assert_eq!(s.shards, vec![shard_name(0), shard_name(1)]);
        let quantized = check_output(recipe, &input, out.path(), &s);
        // Every `*_proj` is quantized; router, lm_head, embeddings and norms are not.
        assert_eq!(quantized.len(), 21, "{recipe:?}: {quantized:?}");
        assert_eq!(s.ignored, DEFAULT_IGNORED);
        assert_eq!(s.copied_files, ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]);
        assert!(!out.path().join("README.md").exists());

        let cfg = config(out.path());
        assert_eq!(cfg["hidden_size"], H, "the rest of config.json is kept");
        let q = &cfg["quantization_config"];
        match Layout::of(recipe) {
            Layout::QuarkW4A8 | Layout::QuarkFp8 | Layout::QuarkInt8 => {
                assert_eq!(q["quant_method"], "quark");
                assert_eq!(q["exclude"], json!(DEFAULT_IGNORED));
                assert_eq!(q["layer_quant_config"], json!({}));
                assert_eq!(q["layer_type_quant_config"], json!({}));
                assert_eq!(q["export"]["pack_method"], "reorder");
                assert_eq!(q["export"]["weight_format"], "real_quantized");
                let g = &q["global_quant_config"];
                let input = &g["input_tensors"];
                // Quark writes a per-token spec as per_channel on axis 1.
                let act = if let Layout::QuarkInt8 = Layout::of(recipe) { ("int8", "per_channel", Some(1)) } else { ("fp8_e4m3", "per_tensor", None) };
                assert_eq!((input["dtype"].as_str(), input["qscheme"].as_str(), input["ch_axis"].as_i64()), (Some(act.0), Some(act.1), act.2));
                assert_eq!(input["is_dynamic"].as_bool(), Some(true));
                assert!(g["output_tensors"].is_null() && g["bias"].is_null());
                if let Layout::QuarkW4A8 = Layout::of(recipe) {
                    let w = g["weight"].as_array().unwrap();
                    assert_eq!(w.len(), 2);
                    assert_eq!((w[0]["dtype"].as_str(), w[0]["qscheme"].as_str(), w[0]["is_dynamic"].as_bool()), (Some("fp8_e4m3"), Some("per_tensor"), Some(false)));
                    assert_eq!((w[1]["dtype"].as_str(), w[1]["qscheme"].as_str(), w[1]["ch_axis"].as_i64()), (Some("int4"), Some("per_channel"), Some(0)));
                    assert_eq!((w[1]["symmetric"].as_bool(), w[1]["round_method"].as_str(), w[1]["scale_type"].as_str()), (Some(true), Some("half_even"), Some("float32")));
                } else {
                    let w = &g["weight"];
                    let dtype = if let Layout::QuarkInt8 = Layout::of(recipe) { "int8" } else { "fp8_e4m3" };
                    assert_eq!((w["dtype"].as_str(), w["qscheme"].as_str(), w["ch_axis"].as_i64()), (Some(dtype), Some("per_channel"), Some(0)));
                }
            }
            layout => {
                assert_eq!(q["quant_method"], "compressed-tensors");
                assert_eq!(q["quantization_status"], "compressed");
                assert_eq!(q["ignore"], json!(DEFAULT_IGNORED));
                assert!(q["kv_cache_scheme"].is_null());
                let g = &q["config_groups"]["group_0"];
                assert_eq!(g["targets"], json!(["Linear"]));
                assert_eq!(g["format"], q["format"]);
                let (w, a) = (&g["weights"], &g["input_activations"]);
                assert_eq!(w["symmetric"], true);
                assert_eq!(w["dynamic"], false);
                let (format, bits, ty, strategy, group, act) = match layout {
                    Layout::CtInt4 { group: Some(g), .. } => ("pack-quantized", 4, "int", "group", json!(g), None),
                    Layout::CtInt4 { group: None, .. } => ("pack-quantized", 4, "int", "channel", Value::Null, Some("int")),
                    Layout::CtInt8 => ("int-quantized", 8, "int", "channel", Value::Null, Some("int")),
                    _ => ("float-quantized", 8, "float", "channel", Value::Null, Some("float")),
                };
                assert_eq!((q["format"].as_str(), w["num_bits"].as_u64(), w["type"].as_str()), (Some(format), Some(bits), Some(ty)));
                assert_eq!((w["strategy"].as_str(), &w["group_size"]), (Some(strategy), &group));
                match act {
                    None => assert!(a.is_null()),
                    Some(t) => {
                        assert_eq!((a["num_bits"].as_u64(), a["type"].as_str(), a["strategy"].as_str()), (Some(8), Some(t), Some("token")));
                        assert_eq!((a["dynamic"].as_bool(), a["symmetric"].as_bool()), (Some(true), Some(true)));
                    }
                }
            }
        }
        // safetensors header metadata: transformers' {"format": "pt"} for compressed-tensors, none for Quark.
        let bytes = std::fs::read(out.path().join(shard_name(0))).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().is_some(), recipe.format() == Format::CompressedTensors);
    }
}

/// The seed's MoE-only exclude list, `--experts-only`, and single fnmatch patterns.
#[test]
fn exclusions_are_fnmatch_on_module_names_and_copied_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let input = random_dir(dir.path(), |_, _| {});
    let recipe = Recipe::resolve(Scheme::W4A8, None, None, false).unwrap();
    let seed = ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj", "*shared_experts*", "*mm_projector*", "*vision_tower*"];
    let experts: Vec<String> =
        (0..4).flat_map(|e| ["down_proj", "gate_proj", "up_proj"].map(|p| format!("model.layers.1.mlp.experts.{e}.{p}"))).collect();
    let non_experts = [
        "lm_head",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.1.self_attn.o_proj",
    ];
    for (exclude, experts_only) in [(&seed[..], false), (&[][..], true)] {
        let out = tempfile::tempdir().unwrap();
        let s = run(dir.path(), out.path(), recipe, exclude, experts_only).unwrap();
        let mut quantized = check_output(recipe, &input, out.path(), &s);
        quantized.sort();
        assert_eq!(quantized, experts);
        assert_eq!(s.ignored, non_experts);
        assert_eq!(config(out.path())["quantization_config"]["exclude"], json!(non_experts));
        let unmatched: Vec<&str> = if experts_only { vec![] } else { vec!["*mm_projector*", "*vision_tower*"] };
        assert_eq!(s.unmatched_patterns, unmatched);
    }

    // `*mlp.gate` is the router only; `*mlp.up_proj` the dense MLP only, not experts.N.up_proj.
    let recipe = Recipe::resolve(Scheme::W8A8Int8, None, None, false).unwrap();
    let out = tempfile::tempdir().unwrap();
    let s = run(dir.path(), out.path(), recipe, &["*mlp.gate", "*mlp.up_proj", "model.layers.?.self_attn.[kv]_proj"], false).unwrap();
    let quantized = check_output(recipe, &input, out.path(), &s);
    assert!(quantized.contains(&"model.layers.0.mlp.gate_proj".to_string()));
    assert!(quantized.contains(&"model.layers.1.mlp.experts.3.up_proj".to_string()));
    assert!(quantized.contains(&"model.layers.1.mlp.shared_experts.up_proj".to_string()));
    assert!(quantized.contains(&"model.layers.0.self_attn.q_proj".to_string()));
    assert_eq!(
        s.ignored,
        ["lm_head", "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate"]
    );
}

#[test]
fn bad_input_is_an_error_naming_what_is_wrong() {
    let w4a16 = |g| Recipe::resolve(Scheme::W4A16, None, Some(g), false).unwrap();
    let err = |dir: &Path, recipe| {
        let out = tempfile::tempdir().unwrap();
        run(dir, out.path(), recipe, &[], false).unwrap_err()
    };

    // A group size that does not divide a layer's columns is not an error: the last group of
    // each row is short (96 columns in groups of 64: 64 + 32), as compressed-tensors writes.
    let dir = tempfile::tempdir().unwrap();
    random_dir(dir.path(), |_, _| {});
    let out = tempfile::tempdir().unwrap();
    run(dir.path(), out.path(), w4a16(64), &[], false).unwrap();
    let files: Vec<_> = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "safetensors")).collect();
    let set = tessera_engine::checkpoint::TensorSet::open(&files).unwrap();
    let scale = set.take("model.layers.0.mlp.down_proj.weight_scale", "test").unwrap();
    assert_eq!(scale.shape[1], 2, "ceil(96 / 64) groups per row");

    // A shard named by the index is missing.
    std::fs::remove_file(dir.path().join(shard_name(1))).unwrap();
    let e = err(dir.path(), w4a16(32));
    assert!(e.contains(&shard_name(1)), "{e}");

    // A non-float weight, and a non-finite one.
    let dir = tempfile::tempdir().unwrap();
    random_dir(dir.path(), |name, t| {
        if name == "model.layers.0.self_attn.k_proj.weight" {
            *t = (Dtype::I8, t.1.clone(), vec![1; t.1.iter().product()]);
        }
    });
    let e = err(dir.path(), w4a16(32));
    assert!(e.contains("model.layers.0.self_attn.k_proj.weight") && e.contains("I8"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    random_dir(dir.path(), |name, t| {
        if name == "model.layers.1.mlp.experts.2.up_proj.weight" {
            t.2[10..12].copy_from_slice(&bf16::NAN.to_le_bytes());
        }
    });
    let e = err(dir.path(), Recipe::resolve(Scheme::W8A8Fp8, None, None, false).unwrap());
    assert!(e.contains("model.layers.1.mlp.experts.2.up_proj.weight") && e.contains("index 5"), "{e}");

    // An already quantized input, and the output written over the input.
    let cfg = dir.path().join("config.json");
    write_json(&cfg, &json!({ "model_type": "llama", "quantization_config": { "quant_method": "fp8" } }));
    assert!(err(dir.path(), w4a16(32)).contains("quantization_config"));
    let e = run(dir.path(), dir.path(), w4a16(32), &[], false).unwrap_err();
    assert!(e.contains("config.json") || e.contains("input directory"), "{e}");

    // Meaningless option combinations.
    let usage = |s, f, g| Recipe::resolve(s, f, g, false).unwrap_err().to_string();
    assert!(usage(Scheme::W4A16, Some(Format::Quark), None).contains("compressed-tensors"));
    assert!(usage(Scheme::W8A8Fp8, None, Some(32)).contains("--group-size"));
    assert!(usage(Scheme::W4A8, None, Some(64)).contains("--group-size"));
    assert!(usage(Scheme::W4A16, None, Some(12)).contains("multiple of 8"));
    let asym = |s, f| Recipe::resolve(s, f, None, true).unwrap_err().to_string();
    for (s, f, named) in [
        (Scheme::W4A8, None, "w4a8 in quark format"),
        (Scheme::W8A8Int8, None, "w8a8-int8 in compressed-tensors format"),
        (Scheme::W8A8Fp8, Some(Format::Quark), "w8a8-fp8 in quark format"),
    ] {
        let e = asym(s, f);
        assert!(e.contains("--asymmetric") && e.contains(named) && e.contains("symmetric only"), "{e}");
    }
    assert!(asym(Scheme::W4A16, Some(Format::Quark)).contains("compressed-tensors"));
}

/// Without `--group-size`, w4a16 takes 128 columns per scale where 128 divides every linear
/// weight's input width, else the largest of 64 and 32 that does (128 when none does); the
/// router does not count (it is not quantized), the output head does.
#[test]
fn the_fitted_group_size_divides_every_linear_input() {
    let fitted = |cols: usize, router_cols: usize| {
        let dir = tempfile::tempdir().unwrap();
        random_dir(dir.path(), |name, t| {
            if t.1.len() == 2 && name.ends_with("proj.weight") || name == "lm_head.weight" || name == "model.layers.1.mlp.gate.weight" {
                let c = if name.ends_with(".mlp.gate.weight") { router_cols } else { cols };
                *t = (Dtype::BF16, vec![8, c], vec![0x3c; 8 * c * 2]);
            }
        });
        tessera_engine::quantize::fitted_group_size(dir.path()).unwrap()
    };
    assert_eq!(fitted(256, 40), (128, None));
    assert_eq!(fitted(576, 256), (64, Some(("lm_head.weight".to_string(), 576))));
    assert_eq!(fitted(96, 256), (32, Some(("lm_head.weight".to_string(), 96))));
    assert_eq!(fitted(40, 256), (128, Some(("lm_head.weight".to_string(), 40))));
    // The random model as it is: 64-, 96- and 32-column layers.
    let dir = tempfile::tempdir().unwrap();
    random_dir(dir.path(), |_, _| {});
    assert_eq!(tessera_engine::quantize::fitted_group_size(dir.path()).unwrap(), (32, Some(("lm_head.weight".to_string(), 64))));
}

/// `--asymmetric` (W4A16_ASYM, and W4A8 with zero points in compressed-tensors): the documented
/// tensors and config, values from the doc's decoder (ragged groups: 96 columns in groups of
/// 64; zero-point padding: k_proj with 20 rows; an all-positive row), and Tessera's loader
/// dequantizing the checkpoint to exactly those values.
#[test]
fn asymmetric_int4_matches_the_doc_and_the_loader() {
    use tessera_engine::checkpoint::TensorSet;
    use tessera_engine::schemes::from_config;
    use tessera_kernels::cpu::CpuCaps;
    use tessera_kernels::linear::LinearPolicy;

    let dir = tempfile::tempdir().unwrap();
    let input = random_dir(dir.path(), |name, t| {
        if name == "model.layers.0.self_attn.k_proj.weight" {
            let mut w: Vec<f32> = (0..20 * H).map(|i| ((i * 37 % 101) as f32 - 40.0) * 1e-3).collect();
            w[..H].iter_mut().for_each(|x| *x = x.abs() + 0.01);
            *t = (Dtype::BF16, vec![20, H], FloatDtype::BF16.encode(&w));
        }
    });
    for (scheme, format, group) in [(Scheme::W4A16, None, Some(64)), (Scheme::W4A8, Some(Format::CompressedTensors), None)] {
        let recipe = Recipe::resolve(scheme, format, group, true).unwrap();
        let out = tempfile::tempdir().unwrap();
        let s = run(dir.path(), out.path(), recipe, &[], false).unwrap();
        assert_eq!(s.report.scheme, format!("{}-asym", scheme.name()));
        let quantized = check_output(recipe, &input, out.path(), &s);
        assert_eq!(quantized.len(), 21);
        let q = &config(out.path())["quantization_config"];
        let w = &q["config_groups"]["group_0"]["weights"];
        assert_eq!((q["format"].as_str(), w["symmetric"].as_bool(), w["num_bits"].as_u64()), (Some("pack-quantized"), Some(false), Some(4)));
        assert_eq!(w["group_size"], json!(group));

        let stored = read_output(out.path());
        let scheme_q = from_config(q).unwrap();
        let files: Vec<_> = s.shards.iter().map(|f| out.path().join(f)).collect();
        let set = TensorSet::open(&files).unwrap();
        for module in &quantized {
            let t = &input[&format!("{module}.weight")];
            let (rows, cols) = (t.1[0], t.1[1]);
            let w_hat = decode_and_bound(Layout::of(recipe), module, &stored, &f32s(t), rows, cols);
            let lin = scheme_q.load_linear(module, &set).unwrap().unwrap_or_else(|| panic!("{module}: not quantized"));
            assert!(lin.matrix.storage().starts_with("int4") && lin.matrix.storage().ends_with("asym"), "{module}: {}", lin.matrix.storage());
            let op = lin.matrix.clone().op(lin.act, None, &CpuCaps::detect(), LinearPolicy::DEFAULT).unwrap();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                op.dequantize_row(r, &mut row);
                assert_eq!(row, w_hat[r * cols..(r + 1) * cols], "{module} row {r}: loader vs doc decoder");
            }
        }
    }
}

/// The bf16 conversion of the default model through every scheme: documented tensors, values
/// within bounds, report numbers reproduced; prints the histogram-gate summaries.
#[test]
fn default_model_all_schemes() {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("quantize-default");
    let _ = std::fs::remove_dir_all(&base);
    let hf = base.join("bf16");
    let ck = ModelWeights::open(&common::default_model_path()).unwrap().checkpoint;
    // Three shards, so the run exercises shard-by-shard processing on a real model.
    to_hf_dir(&ck, &hf, &ConvertOptions { dtype: FloatDtype::BF16, max_shard_bytes: Some(100 << 20) }).unwrap();
    drop(ck);
    let input = read_output(&hf);
    for recipe in recipes(64) {
        let out = base.join("out");
        let s = run(&hf, &out, recipe, &[], false).unwrap();
        assert_eq!(s.shards.len(), 3);
        let quantized = check_output(recipe, &input, &out, &s);
        assert_eq!(quantized.len(), 30 * 7);
        assert_eq!(s.ignored, ["lm_head"]);
        eprint!("{}", s.report.summary(3));
        std::fs::remove_dir_all(&out).unwrap();
    }
    std::fs::remove_dir_all(&base).unwrap();
}
