//! A KV-cache format as users name it (`--kv-cache-dtype`): a registered family and its
//! parameters, and which (role, head size) it supports.

use super::family::{ExactKeyParams, KvFamily, KvParams};
use super::{KvGeometry, KvRegistry, KvRole};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

/// A KV-cache storage format: its family (a registry row, declared in the family's folder) and
/// its parameters in that family. Cheap to copy, compared and hashed by family name and
/// parameters. The built-in formats without parameters are associated constants declared in
/// their folders (`KvFormat::F32`, `KvFormat::BF16`, ...); any format parses from its name.
#[derive(Clone, Copy)]
pub struct KvFormat {
    family: &'static dyn KvFamily,
    params: KvParams,
}

/// Why a format name or a (format, role, geometry) combination is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvFormatError {
    /// Not a known format name.
    #[error("unknown KV-cache dtype {name:?}: expected {expected}")]
    Unknown {
        /// The name as given.
        name: String,
        /// The names the registry knows ([`KvRegistry::syntax`]).
        expected: String,
    },
    /// A keys-only format asked to store values.
    #[error("{0} compresses keys only; store values in another format (e.g. --kv-cache-dtype-k {0} --kv-cache-dtype-v bf16)")]
    KeysOnly(KvFormat),
    /// A format that keeps exact keys (a sink) asked to store values, which have none.
    #[error("{0} keeps a sequence's first keys exactly, which values cannot: give it for keys only (--kv-cache-dtype-k {0}) and values a format without a sink (--kv-cache-dtype-v)")]
    ExactKeysForValues(KvFormat),
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
    /// The format of `family` with `params`.
    pub const fn new(family: &'static dyn KvFamily, params: KvParams) -> Self {
        KvFormat { family, params }
    }

    /// The family's format with default parameters (`KvParams(0)`), e.g. a one-format family.
    pub const fn from_family(family: &'static dyn KvFamily) -> Self {
        KvFormat::new(family, KvParams(0))
    }

    /// Its family (the registry row).
    pub fn family(&self) -> &'static dyn KvFamily {
        self.family
    }

    /// Its parameters in its family.
    pub fn params(&self) -> KvParams {
        self.params
    }

    /// Every built-in format a user can name, for tests, tables and benchmarks.
    pub fn all() -> Vec<KvFormat> {
        KvRegistry::builtin().all()
    }

    /// Whether it stores keys only.
    pub fn keys_only(&self) -> bool {
        self.family.keys_only(self.params)
    }

    /// The keys it keeps exactly beside its pages (QJL's sink and window), if any.
    pub fn exact_keys(&self) -> Option<ExactKeyParams> {
        self.family.exact_keys(self.params)
    }

    /// Checks that this format can store `role` for heads of `geom`.
    pub fn check(&self, geom: KvGeometry, role: KvRole) -> Result<(), KvFormatError> {
        if role == KvRole::Value && self.keys_only() {
            return Err(KvFormatError::KeysOnly(*self));
        }
        if role == KvRole::Value && self.exact_keys().is_some() {
            return Err(KvFormatError::ExactKeysForValues(*self));
        }
        let multiple = self.family.head_dim_multiple(self.params);
        if !geom.head_dim.is_multiple_of(multiple) || geom.head_dim == 0 {
            return Err(KvFormatError::HeadDim { format: *self, multiple, head_dim: geom.head_dim });
        }
        Ok(())
    }
}

impl PartialEq for KvFormat {
    fn eq(&self, other: &Self) -> bool {
        self.family.family() == other.family.family() && self.params == other.params
    }
}

impl Eq for KvFormat {}

impl Hash for KvFormat {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.family.family().hash(state);
        self.params.hash(state);
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.family.write_name(self.params, f)
    }
}

impl fmt::Debug for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KvFormat({self})")
    }
}

impl FromStr for KvFormat {
    type Err = KvFormatError;

    /// A built-in format by name or alias ([`KvRegistry::parse`] on the built-in registry).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvRegistry::builtin().parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::hqmq::HqmqParams;

    fn qjl(window: u16, sink: u16) -> KvFormat {
        crate::kv::qjl::format(ExactKeyParams { window, sink })
    }

    #[test]
    fn names_round_trip_and_aliases_parse() {
        for f in KvFormat::all() {
            assert_eq!(f.to_string().parse::<KvFormat>().unwrap(), f, "{f}");
        }
        assert_eq!("auto".parse::<KvFormat>().unwrap(), KvFormat::F32);
        assert_eq!("fp8".parse::<KvFormat>().unwrap(), KvFormat::FP8_E4M3);
        assert_eq!("TQ3_0".parse::<KvFormat>().unwrap(), KvFormat::TQ3_0);
        assert_eq!("hmqm_s96_r4".parse::<KvFormat>().unwrap().to_string(), "hqmq-s96-r4");
        assert_eq!("qjl1".parse::<KvFormat>().unwrap(), qjl(128, 4));
        assert_eq!("qjl1-w128-s4".parse::<KvFormat>().unwrap().to_string(), "qjl1");
        assert_eq!("QJL1_W32_S1".parse::<KvFormat>().unwrap(), qjl(32, 1));
        for name in ["hqmq-s96-r4-sink4", "hqmq-s192-r6-med3-sink16", "hqmq-s24-r3-sink1"] {
            assert_eq!(name.parse::<KvFormat>().unwrap().to_string(), name);
        }
        assert_eq!("hmqm_s96_r4_sink4".parse::<KvFormat>().unwrap().exact_keys(), Some(ExactKeyParams { window: 0, sink: 4 }));
        for bad in ["qjl1-w8193-s0", "qjl1-w32-s17", "qjl1-w32", "qjl1-s4-w32", "qjl1-w32-s4-x", "hqmq-s95-r4", "hqmq-s96-r5", "hqmq-s96", "hqmq-s96-r4-med4", "hqmq-s96-r4-sink0", "hqmq-s96-r4-sink17", "hqmq-s96-r4-sink4-med3", "hqmq-s96-r4-sink", "q4_0", ""] {
            assert!(matches!(bad.parse::<KvFormat>(), Err(KvFormatError::Unknown { .. })), "{bad}");
        }
    }

    /// The message users see for an unknown name lists every family's names, as it always has.
    #[test]
    fn unknown_names_list_the_registry() {
        let e = "q4_0".parse::<KvFormat>().unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown KV-cache dtype \"q4_0\": expected auto, f32, bf16, f16, fp8_e4m3 (fp8), int8, qjl1[-w{0..8192}-s{0..16}], tq3_0 or hqmq-s{24,48,96,192}-r{3,4,6}[-med3][-sink{1..16}]"
        );
    }

    #[test]
    fn roles_and_head_dims_are_checked() {
        let g = KvGeometry { head_dim: 64, n_kv_heads: 3 };
        let qjl = qjl(128, 4);
        assert!(qjl.check(g, KvRole::Key).is_ok());
        let e = qjl.check(g, KvRole::Value).unwrap_err();
        assert!(e.to_string().contains("keys only"), "{e}");
        let odd = KvGeometry { head_dim: 48, n_kv_heads: 1 };
        assert!(matches!(KvFormat::TQ3_0.check(odd, KvRole::Key), Err(KvFormatError::HeadDim { multiple: 32, .. })));
        let hqmq = crate::kv::hqmq::format(HqmqParams { secondary: 24, radius_bits: 3, med3: false, sink: 0 });
        assert!(hqmq.check(odd, KvRole::Value).is_ok());
        let sink = crate::kv::hqmq::format(HqmqParams { secondary: 24, radius_bits: 3, med3: false, sink: 4 });
        assert!(sink.check(g, KvRole::Key).is_ok());
        let e = sink.check(g, KvRole::Value).unwrap_err();
        assert!(matches!(e, KvFormatError::ExactKeysForValues(_)) && e.to_string().contains("--kv-cache-dtype-k hqmq-s24-r3-sink4"), "{e}");
    }

    /// Formats compare and hash by family and parameters, and of those `all` lists only the QJL
    /// ones keep exact keys (HQMQ's sink variants are named, not listed).
    #[test]
    fn formats_compare_by_family_and_parameters() {
        use std::collections::HashSet;
        let all = KvFormat::all();
        let distinct: HashSet<KvFormat> = all.iter().copied().collect();
        assert_eq!(distinct.len(), all.len());
        assert_ne!(KvFormat::BF16, KvFormat::F16);
        assert_eq!(qjl(0, 0).exact_keys(), Some(ExactKeyParams { window: 0, sink: 0 }));
        assert!(qjl(0, 0).keys_only() && !KvFormat::INT8.keys_only());
        assert_eq!(all.iter().filter(|f| f.exact_keys().is_some()).count(), 2);
        assert_eq!(format!("{:?}", KvFormat::BF16), "KvFormat(bf16)");
    }
}
