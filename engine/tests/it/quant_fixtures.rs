//! Quantized checkpoints written by independent implementations (compressed-tensors, AMD
//! Quark, and numpy packers written from the format specs; see
//! `tests/fixtures/quant/README.md` and `engine/tests/fixtures/make_quant_fixtures.py`) load
//! through Tessera's schemes and dequantize to the weights those implementations compute.

use crate::common;

use std::collections::BTreeSet;
use tessera_engine::checkpoint::TensorSet;
use tessera_engine::schemes::transform::{self, Side};
use tessera_engine::schemes::{from_config, QuantizedWeight};
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::{forward_fused, LinearPolicy};

/// Loads one fixture case: every module of `expected.safetensors` through the scheme.
fn check_case(case: &str) -> Vec<QuantizedWeight> {
    let dir = common::fixture("quant").join(case);
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let scheme = from_config(&cfg["quantization_config"]).unwrap_or_else(|e| panic!("{case}: {e}"));
    let set = TensorSet::open(&[dir.join("model.safetensors")]).unwrap();
    let expected = TensorSet::open(&[dir.join("expected.safetensors")]).unwrap();
    let transforms = transform::parse(cfg["quantization_config"].get("transform_config")).unwrap_or_else(|e| panic!("{case}: {e}"));
    let modules: BTreeSet<String> = expected.names().filter(|n| ![".original", ".x", ".y"].iter().any(|s| n.ends_with(s))).map(str::to_owned).collect();
    assert!(!modules.is_empty(), "{case}: no expected modules");
    let mut loaded = Vec::new();
    let mut transformed = Vec::new();
    let mut tied = transform::TiedCopies::default();
    for module in &modules {
        if let Some((_, _, needle)) = UNSUPPORTED.iter().find(|(c, m, _)| *c == case && m == module) {
            let e = scheme.load_linear(module, &set).expect_err("unsupported layer loads").to_string();
            assert!(e.contains(needle) && e.contains(module.as_str()), "{case} {module}: {e}");
            continue;
        }
        let q = scheme.load_linear(module, &set).unwrap_or_else(|e| panic!("{case} {module}: {e}")).unwrap_or_else(|| panic!("{case} {module}: not quantized"));
        let want = expected.take(module, "test").unwrap();
        let want_v = want.to_f32().unwrap();
        let (rows, cols) = (want.shape[0], want.shape[1]);
        assert_eq!([q.matrix.rows(), q.matrix.cols()], [rows, cols], "{case} {module}: shape");
        // The weight in input-column order (act-order permutation undone).
        let op = q.matrix.clone().op(q.act, q.perm.clone(), &CpuCaps::detect(), LinearPolicy::DEFAULT).unwrap();
        let amax = want_v.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            op.dequantize_row(r, &mut row);
            for (c, (&got, &w)) in row.iter().zip(&want_v[r * cols..(r + 1) * cols]).enumerate() {
                // Both sides multiply the same integers/E4M3 values by the same f32 scales,
                // possibly in a different association order (Quark's two scales are folded
                // into one here): a few ulps of the value, far below one quantization step.
                let tol = 4.0 * f32::EPSILON * w.abs() + 1e-7 * amax;
                assert!((got - w).abs() <= tol, "{case} {module}[{r}, {c}]: {got} vs {w}");
            }
        }
        let mut online = |side: Side, width: usize| transforms.as_ref().and_then(|t| t.online_for(module, side, &set, Some(width), &mut tied).unwrap_or_else(|e| panic!("{case} {module}: {e}")));
        let (before, after) = (online(Side::Input, cols), online(Side::Output, rows));
        assert_eq!(before.is_some() || after.is_some(), expected.contains(&format!("{module}.x")), "{case} {module}: online transform");
        if before.is_some() || after.is_some() {
            // The library's online transforms around the layer, against Tessera's (fast or
            // dense) on the same random inputs: times the decompressed weight in f64, both
            // sides sum f32 products in a different order (1e-5 of the output's scale);
            // through the layer's kernel, which runs W4A16 on bf16-rounded activations here
            // (2^-8 relative per value: 5e-3 of the scale).
            let x = expected.take(&format!("{module}.x"), "test").unwrap().to_f32().unwrap();
            let want = expected.take(&format!("{module}.y"), "test").unwrap().to_f32().unwrap();
            let m = x.len() / cols;
            let mut xt = x.clone();
            if let Some(t) = &before {
                t.apply(&mut xt, cols);
            }
            let mut exact: Vec<f32> =
                (0..m * rows).map(|i| (0..cols).map(|c| xt[(i / rows) * cols + c] as f64 * want_v[(i % rows) * cols + c] as f64).sum::<f64>() as f32).collect();
            let mut y = vec![0f32; m * rows];
            forward_fused(&[(&*op, 0)], &xt, &[m], &mut y, rows);
            if let Some(u) = &after {
                u.apply(&mut exact, rows);
                u.apply(&mut y, rows);
            }
            let ymax = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let max_err = |got: &[f32]| got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(max_err(&exact) <= 1e-5 * ymax, "{case} {module}: transform differs by {} (scale {ymax})", max_err(&exact));
            assert!(max_err(&y) <= 5e-3 * ymax, "{case} {module}: kernel output differs by {} (scale {ymax})", max_err(&y));
            transformed.push((module.clone(), before.map(|t| t.describe()), after.map(|t| t.describe())));
        }
        loaded.push(q);
    }
    if case == "ct_w4a16_transforms" {
        // SpinQuant's R4 (Sylvester, blocks of 128) runs as the fast transform; QuIP's
        // randomized, permuted Hadamard as a dense block.
        let want = [("model.layers.0.mlp.down_proj", Some("hadamard/128"), None), ("model.layers.0.self_attn.q_proj", Some("dense/256"), None)];
        assert_eq!(transformed, want.map(|(m, a, b): (&str, Option<&str>, Option<&str>)| (m.to_string(), a.map(str::to_string), b.map(str::to_string))));
    }
    if case == "ct_w4a16_quip" {
        // QuIP's both sides, randomized and permuted: dense blocks of the layers' widths. The
        // input matrix is stored once, under up_proj's name (tied), and q_proj takes it.
        let want = [("model.layers.0.mlp.up_proj", Some("dense/256"), Some("dense/96")), ("model.layers.0.self_attn.q_proj", Some("dense/256"), Some("dense/128"))];
        assert_eq!(transformed, want.map(|(m, a, b): (&str, Option<&str>, Option<&str>)| (m.to_string(), a.map(str::to_string), b.map(str::to_string))));
        assert!(!set.names().any(|n| n.contains("q_proj.v_input")), "the fixture ties q_proj's input matrix");
    }
    // Modules the config leaves unquantized load as None, and every quantized module's
    // tensors were consumed.
    for t in set.untaken() {
        let module = t.name.rsplit_once('.').unwrap().0;
        let unsupported = UNSUPPORTED.iter().any(|(c, m, _)| *c == case && *m == module);
        assert!(!modules.contains(module) || unsupported, "{case}: {} left unused", t.name);
        if t.name.ends_with(".weight") && t.shape.len() == 2 && !t.name.contains("embed") {
            assert!(scheme.load_linear(module, &set).unwrap().is_none(), "{case}: {module} should be unquantized");
        }
    }
    loaded
}

/// Fixture layers whose scheme has no CPU kernel: loading them must fail with this message
/// (naming the layer), never fall back silently. 8-bit weight-only (W8A16, asymmetric int8)
/// has no kernel.
const UNSUPPORTED: &[(&str, &str, &str)] =
    &[("ct_w4a16_g32_asym", "model.layers.0.mlp.down_proj", "8-bit Int weights and unquantized activations has no CPU kernel")];

fn cases() -> Vec<String> {
    let dir = common::fixture("quant");
    let mut v: Vec<String> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.path().is_dir()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn every_fixture_dequantizes_like_its_writer() {
    let cases = cases();
    assert!(cases.len() >= 10, "fixtures missing: {cases:?}");
    for case in &cases {
        let loaded = check_case(case);
        eprintln!("{case}: {} layers, e.g. {} [{}] {}", loaded.len(), loaded[0].scheme, loaded[0].matrix.storage(), loaded[0].act.name());
    }
}

#[test]
fn schemes_pick_the_documented_kernels() {
    let kind = |case: &str| {
        let q = &check_case(case)[0];
        (q.matrix.storage(), q.act.name(), q.perm.is_some())
    };
    assert_eq!(kind("ct_w4a16_g128_sym"), ("int4 g128 sym".into(), "f32", false));
    assert!(kind("ct_w4a16_actorder").2, "act-order g_idx gives an input permutation");
    assert!(kind("gptq_g128_actorder").2);
    assert_eq!(kind("ct_w8a8_int8"), ("int8 channel".into(), "int8/token", false));
    assert_eq!(kind("ct_fp8_dynamic"), ("fp8 channel".into(), "fp8/token", false));
    assert_eq!(kind("fp8_block_deepseek").0, "fp8 block 128x128");
    assert_eq!(kind("quark_w4a8"), ("int4 channel sym".into(), "int8/token", false));
    assert_eq!(kind("quark_fp8"), ("fp8 channel".into(), "fp8/token", false));
}

/// The config in `case` with `edit` applied, checked to fail mentioning `needle`.
fn expect_config_error(case: &str, edit: impl FnOnce(&mut serde_json::Value), needle: &str) {
    let dir = common::fixture("quant").join(case);
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg["quantization_config"]);
    let set = TensorSet::open(&[dir.join("model.safetensors")]).unwrap();
    let err = match from_config(&cfg["quantization_config"]) {
        Err(e) => e.to_string(),
        Ok(s) => {
            let modules: BTreeSet<String> =
                set.names().filter_map(|n| n.rsplit_once('.')).map(|(m, _)| m.to_owned()).filter(|m| m.ends_with("_proj")).collect();
            modules.iter().find_map(|m| s.load_linear(m, &set).err()).map(|e| e.to_string()).unwrap_or_else(|| panic!("{case}: no error"))
        }
    };
    assert!(err.contains(needle), "{case}: error {err:?} lacks {needle:?}");
}

#[test]
fn metadata_that_disagrees_with_tensors_fails_naming_the_layer() {
    // The seed's warning: a single-stage int4 spec is not the two-stage W4A8 recipe; a
    // two-stage list that is neither form is refused.
    expect_config_error(
        "quark_w4a8",
        |q| q["global_quant_config"]["weight"][0]["dtype"] = "int8".into(),
        "is not the W4A8 recipe",
    );
    expect_config_error("quark_w4a8", |q| q["global_quant_config"]["weight"] = serde_json::json!("int4"), "neither a spec nor a list");
    // Metadata says asymmetric, but the checkpoint has no zero points.
    expect_config_error(
        "ct_w4a16_g128_sym",
        |q| q["config_groups"]["group_0"]["weights"]["symmetric"] = false.into(),
        "weight_zero_point: missing",
    );
    // Metadata says group 64, the scale tensor has group-128 columns.
    expect_config_error(
        "ct_w4a16_g128_sym",
        |q| q["config_groups"]["group_0"]["weights"]["group_size"] = 64.into(),
        "weight_scale: shape",
    );
    // Metadata says per-tensor, the checkpoint has per-channel scales.
    expect_config_error("ct_w8a8_int8", |q| q["config_groups"]["group_0"]["weights"]["strategy"] = "tensor".into(), "weight_scale: shape");
    // No kernel for the combination: an error naming the layer, not a fallback.
    expect_config_error("ct_w8a8_int8", |q| q["config_groups"]["group_0"]["format"] = "pack-quantized".into(), "has no CPU kernel (layer model.layers.0");
    expect_config_error("fp8_block_deepseek", |q| q["weight_block_size"] = serde_json::json!([64, 64]), "weight_scale_inv: shape");
    expect_config_error("gptq_sym_g128", |q| q["bits"] = 3.into(), "3-bit");
    expect_config_error("awq_g128", |q| q["quant_method"] = "squeezellm".into(), "not supported");
}

#[test]
fn missing_scale_names_the_tensor() {
    let dir = common::fixture("quant").join("quark_w4a8");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let scheme = from_config(&cfg["quantization_config"]).unwrap();
    // A set holding only the packed weight of one layer: the scale is reported by name.
    let full = TensorSet::open(&[dir.join("model.safetensors")]).unwrap();
    let module = "model.layers.0.mlp.gate_proj";
    let mut only = TensorSet::default();
    only.insert(full.take(&format!("{module}.weight"), "test").unwrap().clone()).unwrap();
    let err = scheme.load_linear(module, &only).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.gate_proj.weight_scale") && err.contains("missing"), "{err}");
}
