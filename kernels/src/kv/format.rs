//! KV-cache format names, as users write them (`--kv-cache-dtype`), and which (role, head
//! size) each supports.

use super::{KvGeometry, KvRole};
use std::fmt;
use std::str::FromStr;

/// HQMQ parameters: secondary codebook size, radius bits and Med3x outlier extraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HqmqParams {
    /// Secondary unit quaternions per (layer, head, role): 24, 48, 96 or 192.
    pub secondary: usize,
    /// Radius bits: 3, 4 or 6.
    pub radius_bits: u32,
    /// Whether chunks with norm > 3x the token's median chunk norm are kept as fp16.
    pub med3: bool,
}

/// QJL's exact keys: besides every key's 1-bit sketch, the sequence keeps the keys of its
/// first `sink` positions (the attention sink) and of the `window` positions before each
/// query exactly, and attention scores those keys exactly, as the QJL reference keeps its
/// most recent tokens unquantized (its `buffer_size`, 128). `qjl1-w0-s0` is the pure 1-bit
/// cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QjlParams {
    /// Positions before (and including) a query whose keys it scores exactly.
    pub window: u16,
    /// Leading positions of the sequence whose keys every query scores exactly (at most
    /// [`QjlParams::MAX_SINK`]).
    pub sink: u16,
}

impl QjlParams {
    /// `qjl1`'s window: the QJL reference's buffer of unquantized recent keys.
    pub const DEFAULT_WINDOW: u16 = 128;
    /// `qjl1`'s sink: StreamingLLM's four attention-sink tokens.
    pub const DEFAULT_SINK: u16 = 4;
    /// The longest sink a name may ask for (it must also fit the cache's first block, which
    /// the layout checks).
    pub const MAX_SINK: u16 = 16;
    /// The longest window a name may ask for.
    pub const MAX_WINDOW: u16 = 8192;
}

impl Default for QjlParams {
    fn default() -> Self {
        QjlParams { window: Self::DEFAULT_WINDOW, sink: Self::DEFAULT_SINK }
    }
}

/// A KV-cache storage format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// f32, the engine's compute type (`auto`).
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// FP8 E4M3 with a scale per token and head (or the checkpoint's per-tensor scale).
    Fp8E4m3,
    /// int8 with a scale per token and head (or the checkpoint's per-tensor scale).
    Int8,
    /// QJL: 1-bit JL sketch of each key plus its bf16 norm (keys only), with exact keys for
    /// a sink and a recent window.
    Qjl1(QjlParams),
    /// TQ3_0: 32-value blocks, WHT32, 2-bit codebook, residual signs, fp16 scale.
    Tq3_0,
    /// Hurwitz quaternion multiplicative quantization.
    Hqmq(HqmqParams),
}

/// Why a format name or a (format, role, geometry) combination is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvFormatError {
    /// Not a known format name.
    #[error("unknown KV-cache dtype {0:?}: expected auto, f32, bf16, f16, fp8_e4m3 (fp8), int8, qjl1[-w{{0..8192}}-s{{0..16}}], tq3_0 or hqmq-s{{24,48,96,192}}-r{{3,4,6}}[-med3]")]
    Unknown(String),
    /// A keys-only format asked to store values.
    #[error("{0} compresses keys only; store values in another format (e.g. --kv-cache-dtype-k {0} --kv-cache-dtype-v bf16)")]
    KeysOnly(KvFormat),
    /// A sink of exact keys longer than the cache's first block (the prefix cache carries the
    /// sink with that block).
    #[error("{format}'s sink must fit the first KV-cache block ({block_size} tokens)")]
    SinkTooLong {
        /// The format.
        format: KvFormat,
        /// Tokens per block.
        block_size: usize,
    },
    /// The head size does not fit the format's blocks.
    #[error("{format} needs a head dimension that is a multiple of {multiple}; this model's is {head_dim}")]
    HeadDim {
        /// The format.
        format: KvFormat,
        /// Required divisor.
        multiple: usize,
        /// The model's head dimension.
        head_dim: usize,
    },
}

impl KvFormat {
    /// Every format a user can name, for tests, tables and benchmarks.
    pub fn all() -> Vec<KvFormat> {
        let mut v = vec![KvFormat::F32, KvFormat::Bf16, KvFormat::F16, KvFormat::Fp8E4m3, KvFormat::Int8, KvFormat::Qjl1(QjlParams::default()), KvFormat::Tq3_0];
        v.push(KvFormat::Qjl1(QjlParams { window: 0, sink: 0 }));
        for secondary in [24, 48, 96, 192] {
            for radius_bits in [3, 4, 6] {
                for med3 in [false, true] {
                    v.push(KvFormat::Hqmq(HqmqParams { secondary, radius_bits, med3 }));
                }
            }
        }
        v
    }

    /// Checks that this format can store `role` for heads of `geom`.
    pub fn check(&self, geom: KvGeometry, role: KvRole) -> Result<(), KvFormatError> {
        let multiple = match self {
            KvFormat::Qjl1(_) if role == KvRole::Value => return Err(KvFormatError::KeysOnly(*self)),
            KvFormat::Tq3_0 => 32,
            KvFormat::Hqmq(_) => 4,
            _ => 1,
        };
        if !geom.head_dim.is_multiple_of(multiple) || geom.head_dim == 0 {
            return Err(KvFormatError::HeadDim { format: *self, multiple, head_dim: geom.head_dim });
        }
        Ok(())
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvFormat::F32 => f.write_str("f32"),
            KvFormat::Bf16 => f.write_str("bf16"),
            KvFormat::F16 => f.write_str("f16"),
            KvFormat::Fp8E4m3 => f.write_str("fp8_e4m3"),
            KvFormat::Int8 => f.write_str("int8"),
            KvFormat::Qjl1(p) if *p == QjlParams::default() => f.write_str("qjl1"),
            KvFormat::Qjl1(p) => write!(f, "qjl1-w{}-s{}", p.window, p.sink),
            KvFormat::Tq3_0 => f.write_str("tq3_0"),
            KvFormat::Hqmq(p) => write!(f, "hqmq-s{}-r{}{}", p.secondary, p.radius_bits, if p.med3 { "-med3" } else { "" }),
        }
    }
}

impl FromStr for KvFormat {
    type Err = KvFormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase().replace('_', "-");
        let unknown = || KvFormatError::Unknown(s.to_string());
        Ok(match lower.as_str() {
            "auto" | "f32" | "float32" => KvFormat::F32,
            "bf16" | "bfloat16" => KvFormat::Bf16,
            "f16" | "fp16" | "float16" | "half" => KvFormat::F16,
            "fp8" | "fp8-e4m3" | "float8-e4m3fn" => KvFormat::Fp8E4m3,
            "int8" | "i8" => KvFormat::Int8,
            "qjl1" | "qjl" => KvFormat::Qjl1(QjlParams::default()),
            "tq3-0" | "tq3" => KvFormat::Tq3_0,
            other if other.starts_with("qjl1-") => {
                // qjl1-w<W>-s<S>
                let mut parts = other["qjl1-".len()..].split('-');
                let window = parts.next().and_then(|p| p.strip_prefix('w')).and_then(|p| p.parse().ok()).ok_or_else(unknown)?;
                let sink = parts.next().and_then(|p| p.strip_prefix('s')).and_then(|p| p.parse().ok()).ok_or_else(unknown)?;
                if parts.next().is_some() || window > QjlParams::MAX_WINDOW || sink > QjlParams::MAX_SINK {
                    return Err(unknown());
                }
                KvFormat::Qjl1(QjlParams { window, sink })
            }
            other => {
                // hqmq-s<S>-r<B>[-med3] (the paper's hmqm_s96_r4 spelling is accepted too).
                let rest = other.strip_prefix("hqmq-").or_else(|| other.strip_prefix("hmqm-")).ok_or_else(unknown)?;
                let mut parts = rest.split('-');
                let secondary = parts.next().and_then(|p| p.strip_prefix('s')).and_then(|p| p.parse().ok()).ok_or_else(unknown)?;
                let radius_bits = parts.next().and_then(|p| p.strip_prefix('r')).and_then(|p| p.parse().ok()).ok_or_else(unknown)?;
                let med3 = match parts.next() {
                    None => false,
                    Some("med3") => true,
                    Some(_) => return Err(unknown()),
                };
                if parts.next().is_some() || ![24, 48, 96, 192].contains(&secondary) || ![3, 4, 6].contains(&radius_bits) {
                    return Err(unknown());
                }
                KvFormat::Hqmq(HqmqParams { secondary, radius_bits, med3 })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_aliases_parse() {
        for f in KvFormat::all() {
            assert_eq!(f.to_string().parse::<KvFormat>().unwrap(), f, "{f}");
        }
        assert_eq!("auto".parse::<KvFormat>().unwrap(), KvFormat::F32);
        assert_eq!("fp8".parse::<KvFormat>().unwrap(), KvFormat::Fp8E4m3);
        assert_eq!("TQ3_0".parse::<KvFormat>().unwrap(), KvFormat::Tq3_0);
        assert_eq!("hmqm_s96_r4".parse::<KvFormat>().unwrap().to_string(), "hqmq-s96-r4");
        assert_eq!("qjl1".parse::<KvFormat>().unwrap(), KvFormat::Qjl1(QjlParams { window: 128, sink: 4 }));
        assert_eq!("qjl1-w128-s4".parse::<KvFormat>().unwrap().to_string(), "qjl1");
        assert_eq!("QJL1_W32_S1".parse::<KvFormat>().unwrap(), KvFormat::Qjl1(QjlParams { window: 32, sink: 1 }));
        for bad in ["qjl1-w8193-s0", "qjl1-w32-s17", "qjl1-w32", "qjl1-s4-w32", "qjl1-w32-s4-x", "hqmq-s95-r4", "hqmq-s96-r5", "hqmq-s96", "hqmq-s96-r4-med4", "q4_0", ""] {
            assert!(matches!(bad.parse::<KvFormat>(), Err(KvFormatError::Unknown(_))), "{bad}");
        }
    }

    #[test]
    fn roles_and_head_dims_are_checked() {
        let g = KvGeometry { head_dim: 64, n_kv_heads: 3 };
        let qjl = KvFormat::Qjl1(QjlParams::default());
        assert!(qjl.check(g, KvRole::Key).is_ok());
        let e = qjl.check(g, KvRole::Value).unwrap_err();
        assert!(e.to_string().contains("keys only"), "{e}");
        let odd = KvGeometry { head_dim: 48, n_kv_heads: 1 };
        assert!(matches!(KvFormat::Tq3_0.check(odd, KvRole::Key), Err(KvFormatError::HeadDim { multiple: 32, .. })));
        assert!(KvFormat::Hqmq(HqmqParams { secondary: 24, radius_bits: 3, med3: false }).check(odd, KvRole::Value).is_ok());
    }
}
