//! GGUF reader: a file written by an independent writer (Python `gguf`, see
//! engine/tests/fixtures/make_gguf_fixture.py) and corrupted files built by this test.

use crate::common;

use common::{default_model_path, fixture};
use serde_json::Value;
use tessera_engine::checkpoint::gguf::{parse_bytes, GgufError, GgufFile, MetaValue};
use tessera_kernels::ggml::dequantize_row;

/// Compares a value with the fixture's entry; floats by their exact bit pattern (`bits`).
fn json_matches(v: &MetaValue, ty: &str, want: &Value, bits: Option<&Value>) -> bool {
    let hex = |b: Option<&Value>| b.and_then(Value::as_str).and_then(|s| u64::from_str_radix(&s[2..], 16).ok());
    match (v, ty) {
        (MetaValue::F32(x), "FLOAT32") if bits.is_some() => hex(bits) == Some(x.to_bits() as u64),
        (MetaValue::F64(x), "FLOAT64") if bits.is_some() => hex(bits) == Some(x.to_bits()),
        (MetaValue::String(s), "STRING") => want.as_str() == Some(s),
        (MetaValue::Bool(b), "BOOL") => want.as_bool() == Some(*b),
        (MetaValue::F32(x), "FLOAT32") => want.as_f64() == Some(*x as f64),
        (MetaValue::F64(x), "FLOAT64") => want.as_f64() == Some(*x),
        (MetaValue::I8(_) | MetaValue::I16(_) | MetaValue::I32(_) | MetaValue::I64(_), t) if t.starts_with("INT") => {
            let got = match *v {
                MetaValue::I8(x) => x as i64,
                MetaValue::I16(x) => x as i64,
                MetaValue::I32(x) => x as i64,
                MetaValue::I64(x) => x,
                _ => unreachable!(),
            };
            want.as_i64() == Some(got) && t == v.type_name().to_uppercase()
        }
        (_, t) if t.starts_with("UINT") => want.as_u64() == v.as_u64() && t == v.type_name().to_uppercase(),
        _ => false,
    }
}

#[test]
fn reads_independently_written_file() {
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(fixture("gguf/independent.json")).unwrap()).unwrap();
    let f = GgufFile::open(&fixture("gguf/independent.gguf")).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.alignment as u64, spec["alignment"].as_u64().unwrap());
    let meta = spec["metadata"].as_array().unwrap();
    assert_eq!(f.metadata.len(), meta.len());
    for m in meta {
        let key = m["key"].as_str().unwrap();
        let v = f.get(key).unwrap_or_else(|| panic!("missing key {key}"));
        let ty = m["type"].as_str().unwrap();
        let ok = if ty == "ARRAY" {
            let et = m["element_type"].as_str().unwrap();
            let want = m["value"].as_array().unwrap();
            let got = v.as_array().unwrap();
            let bits = m.get("bits").and_then(Value::as_array);
            got.len() == want.len()
                && got.iter().zip(want).enumerate().all(|(i, (g, w))| json_matches(g, et, w, bits.map(|b| &b[i])))
        } else {
            json_matches(v, ty, &m["value"], m.get("bits"))
        };
        assert!(ok, "metadata {key}: got {v:?}, want {} {}", ty, m["value"]);
    }
    let tensors = spec["tensors"].as_array().unwrap();
    assert_eq!(f.tensors.len(), tensors.len());
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let got = f.tensors.iter().find(|x| x.name == name).unwrap();
        assert_eq!(got.ty.name(), t["type"].as_str().unwrap(), "{name}");
        let shape: Vec<usize> = t["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(got.dims, shape, "{name}");
        assert_eq!(got.nbytes as u64, t["n_bytes"].as_u64().unwrap(), "{name}");
        assert_eq!(got.offset as u64, spec["data_offset"].as_u64().unwrap() + t["offset"].as_u64().unwrap(), "{name}");
    }
}

/// Every block type dequantized by Tessera equals Python gguf's dequantization of the same
/// random blocks. Both compute `d * q (+ m)` in f32 from the same f16 scales; differences
/// can only come from operation order, so the tolerance is a few f32 ulps.
#[test]
fn dequantization_matches_python_gguf_for_every_type() {
    let f = GgufFile::open(&fixture("gguf/independent.gguf")).unwrap();
    let mut checked = Vec::new();
    for t in f.tensors.iter().filter(|t| t.name.ends_with(".data")) {
        let base = t.name.trim_end_matches(".data");
        let exp = f.tensors.iter().find(|x| x.name == format!("{base}.expected")).unwrap();
        let n: usize = t.dims.iter().product();
        let mut got = vec![0f32; n];
        let mut want = vec![0f32; n];
        dequantize_row(t.ty, f.tensor_data(t), &mut got);
        dequantize_row(exp.ty, f.tensor_data(exp), &mut want);
        assert!(want.iter().any(|&v| v != 0.0), "{base}: expected values are all zero");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 2e-6 * w.abs().max(1e-3), "{}: element {i}: {g} vs {w}", t.ty);
        }
        checked.push(t.ty.name());
    }
    checked.sort();
    assert_eq!(
        checked,
        ["BF16", "F16", "F32", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K"]
    );
}

/// Builds GGUF v3 bytes: one string key, then tensors `(name, n_dims dims, type, offset)`,
/// then `data_len` bytes of data after 32-byte alignment.
struct Builder {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data_len: usize,
}

impl Builder {
    fn new() -> Self {
        let mut b = Builder { kv: Vec::new(), n_kv: 0, infos: Vec::new(), n_tensors: 0, data_len: 0 };
        b.kv_string("general.architecture", "llama");
        b
    }
    fn kv_string(&mut self, k: &str, v: &str) -> &mut Self {
        self.kv.extend((k.len() as u64).to_le_bytes());
        self.kv.extend(k.as_bytes());
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        self.kv.extend(v.as_bytes());
        self.n_kv += 1;
        self
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.infos.extend((name.len() as u64).to_le_bytes());
        self.infos.extend(name.as_bytes());
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }
    fn data(&mut self, n: usize) -> &mut Self {
        self.data_len = n;
        self
    }
    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        out.resize(out.len().next_multiple_of(32), 0);
        out.extend((0..self.data_len).map(|i| (i * 7 + 3) as u8));
        out
    }
}

fn err(bytes: &[u8]) -> GgufError {
    parse_bytes(bytes).expect_err("malformed file must be rejected")
}

#[test]
fn a_valid_built_file_parses() {
    // Q4_1 64x2: 2 rows of 2 blocks of 20 bytes.
    let bytes = Builder::new().tensor("w", &[64, 2], 3, 0).tensor("n", &[64], 0, 96).data(96 + 256).build();
    let h = parse_bytes(&bytes).unwrap();
    assert_eq!((h.version, h.alignment, h.tensors.len()), (3, 32, 2));
    assert_eq!(h.metadata["general.architecture"].as_str(), Some("llama"));
    assert_eq!(h.tensors[0].nbytes, 80);
}

#[test]
fn corrupted_files_give_their_error() {
    let good = Builder::new().tensor("blk.0.w", &[64, 2], 3, 0).data(80).build();

    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    assert!(matches!(err(&bad_magic), GgufError::BadMagic(_)));

    let mut bad_version = good.clone();
    bad_version[4] = 9;
    assert_eq!(err(&bad_version), GgufError::BadVersion(9));

    // Truncated anywhere: header, metadata, tensor info, or data.
    for cut in [3, 10, 30, 60, good.len() - 1] {
        let e = err(&good[..cut]);
        assert!(matches!(e, GgufError::Truncated { .. } | GgufError::AbsurdCount { .. } | GgufError::Tensor { .. }), "cut {cut}: {e:?}");
    }
    let e = err(&good[..good.len() - 1]).to_string();
    assert!(e.contains("blk.0.w") && e.contains("past the end"), "{e}");

    let unknown_type = Builder::new().tensor("blk.0.w", &[64, 2], 77, 0).data(80).build();
    let e = err(&unknown_type);
    assert!(e.to_string().contains("blk.0.w") && e.to_string().contains("unknown ggml type id 77"), "{e}");
    let iq_type = Builder::new().tensor("blk.0.w", &[256, 2], 16, 0).data(4096).build();
    assert!(err(&iq_type).to_string().contains("IQ2_XXS"), "{}", err(&iq_type));

    let misaligned = Builder::new().tensor("blk.0.w", &[64, 2], 3, 0).tensor("blk.1.w", &[32], 0, 81).data(400).build();
    let e = err(&misaligned).to_string();
    assert!(e.contains("blk.1.w") && e.contains("not aligned"), "{e}");

    let overlapping = Builder::new().tensor("a", &[64, 2], 3, 0).tensor("b", &[32], 0, 64).data(400).build();
    let e = err(&overlapping).to_string();
    assert!(e.contains("overlaps") && e.contains("\"a\""), "{e}");

    let not_whole_blocks = Builder::new().tensor("blk.0.w", &[48, 2], 3, 0).data(80).build();
    assert!(err(&not_whole_blocks).to_string().contains("not a multiple of Q4_1's block size 32"));

    let zero_dim = Builder::new().tensor("z", &[0, 2], 0, 0).data(0).build();
    assert!(err(&zero_dim).to_string().contains("dimension 0 is 0"));

    let too_many_dims = Builder::new().tensor("z", &[1, 1, 1, 1, 1], 0, 0).data(4).build();
    assert!(err(&too_many_dims).to_string().contains("5 dimensions"));

    let dup = Builder::new().tensor("a", &[32], 0, 0).tensor("a", &[32], 0, 128).data(256).build();
    assert!(err(&dup).to_string().contains("duplicate tensor name"));

    // Element count overflow: never allocated, never wrapped.
    let huge = Builder::new().tensor("h", &[1 << 40, 1 << 40], 0, 0).data(64).build();
    let e = err(&huge).to_string();
    assert!(e.contains("overflows") || e.contains("past the end"), "{e}");

    // Absurd counts: tensor_count and kv_count far beyond the file, and a huge string length.
    let mut many_tensors = good.clone();
    many_tensors[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(err(&many_tensors), GgufError::AbsurdCount { .. }));
    let mut many_kv = good.clone();
    many_kv[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(err(&many_kv), GgufError::AbsurdCount { .. }));
    let mut long_key = good.clone();
    long_key[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert!(matches!(err(&long_key), GgufError::Truncated { .. }));

    let mut bad_align = Builder::new();
    bad_align.kv.extend((17u64).to_le_bytes());
    bad_align.kv.extend(b"general.alignment");
    bad_align.kv.extend(4u32.to_le_bytes());
    bad_align.kv.extend(48u32.to_le_bytes());
    bad_align.n_kv += 1;
    assert!(err(&bad_align.build()).to_string().contains("power of two"));
}

#[test]
fn default_model_parses_with_expected_types() {
    let f = GgufFile::open(&default_model_path()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.tensors.len(), 272);
    let embd = f.tensors.iter().find(|t| t.name == "token_embd.weight").unwrap();
    assert_eq!((embd.ty.name(), embd.dims.as_slice()), ("Q8_0", &[576usize, 49152][..]));
}


/// Random damage to a valid file (byte flips, truncations, inflated counts and lengths) is
/// always either accepted or rejected with an error: the reader never panics and never
/// allocates from an unchecked count (an absurd allocation would abort the test).
#[test]
fn random_corruptions_never_panic() {
    use rand::{Rng, SeedableRng};
    let good = std::fs::read(fixture("gguf/independent.gguf")).unwrap();
    let header_end = 3072; // data_offset in independent.json: damage the header, where parsing happens
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let (mut accepted, mut rejected) = (0, 0);
    for _ in 0..3000 {
        let mut b = good.clone();
        match rng.gen_range(0..4) {
            0 => {
                for _ in 0..rng.gen_range(1..8) {
                    let i = rng.gen_range(0..header_end);
                    b[i] ^= 1 << rng.gen_range(0..8);
                }
            }
            1 => b.truncate(rng.gen_range(0..good.len())),
            2 => {
                // A u64 somewhere in the header set to a huge value (a count, length or dimension).
                let i = rng.gen_range(0..header_end - 8);
                b[i..i + 8].copy_from_slice(&(u64::MAX >> rng.gen_range(0..40)).to_le_bytes());
            }
            _ => {
                let i = rng.gen_range(0..header_end);
                b[i] = rng.gen();
            }
        }
        match std::panic::catch_unwind(|| parse_bytes(&b)) {
            Ok(Ok(_)) => accepted += 1,
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                rejected += 1;
            }
            Err(_) => panic!("parser panicked on a corrupted file"),
        }
    }
    assert!(rejected > 1000, "most corruptions are detected ({accepted} accepted, {rejected} rejected)");
}
