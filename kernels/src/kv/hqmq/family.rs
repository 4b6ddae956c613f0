//! HQMQ's registry row: `hqmq-s<S>-r<B>[-med3][-sink<N>]` (the paper's `hmqm_s96_r4` spelling
//! is accepted too).

use super::HqmqCodec;
use crate::kv::{CodecOptions, ExactKeyParams, KvCodec, KvFamily, KvFormat, KvGeometry, KvParams, KvRole, MAX_SINK};
use std::fmt;

/// HQMQ parameters: secondary codebook size, radius bits and Med3x outlier extraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HqmqParams {
    /// Secondary unit quaternions per (layer, head, role): 24, 48, 96 or 192.
    pub secondary: usize,
    /// Radius bits: 3, 4 or 6.
    pub radius_bits: u32,
    /// Whether chunks with norm > 3x the token's median chunk norm are kept as fp16.
    pub med3: bool,
    /// Leading positions of a sequence whose keys are kept exactly beside the pages (an
    /// attention sink, as `qjl1` keeps; keys only). The first tokens take much of the
    /// attention, so their keys' codec error costs most: on the license texts at ctx 1024,
    /// hqmq-s96-r4 loses +7.08% against bf16 without a sink and +5.49% with four; but with
    /// HQMQ values the default model then missed a passphrase 4-5k tokens back that it found
    /// without the sink (docs/benchmarks/kv-quality.md), so no name has a sink by default.
    pub sink: u16,
}

/// Secondary codebook sizes a name may ask for.
const SECONDARY: [usize; 4] = [24, 48, 96, 192];
/// Radius bits a name may ask for.
const RADIUS_BITS: [u32; 3] = [3, 4, 6];

/// The HQMQ family: its parameters are [`HqmqParams`].
pub struct Hqmq;

/// The HQMQ format with `p`.
pub fn format(p: HqmqParams) -> KvFormat {
    KvFormat::new(&Hqmq, KvParams(p.secondary as u64 | u64::from(p.radius_bits) << 16 | u64::from(p.med3) << 32 | u64::from(p.sink) << 40))
}

fn params(p: KvParams) -> HqmqParams {
    HqmqParams {
        secondary: (p.0 & 0xFFFF) as usize,
        radius_bits: ((p.0 >> 16) & 0xFFFF) as u32,
        med3: (p.0 >> 32) & 0xFF != 0,
        sink: (p.0 >> 40) as u16,
    }
}

impl KvFamily for Hqmq {
    fn family(&self) -> &'static str {
        "hqmq"
    }
    fn syntax(&self) -> &'static str {
        "hqmq-s{24,48,96,192}-r{3,4,6}[-med3][-sink{1..16}]"
    }
    fn parse(&self, name: &str) -> Option<KvParams> {
        let rest = name.strip_prefix("hqmq-").or_else(|| name.strip_prefix("hmqm-"))?;
        let mut parts = rest.split('-');
        let secondary = parts.next()?.strip_prefix('s')?.parse().ok()?;
        let radius_bits = parts.next()?.strip_prefix('r')?.parse().ok()?;
        let (mut med3, mut sink) = (false, 0);
        let mut next = parts.next();
        if next == Some("med3") {
            med3 = true;
            next = parts.next();
        }
        if let Some(part) = next {
            sink = part.strip_prefix("sink")?.parse().ok()?;
            if !(1..=MAX_SINK).contains(&sink) {
                return None;
            }
        }
        if parts.next().is_some() || !SECONDARY.contains(&secondary) || !RADIUS_BITS.contains(&radius_bits) {
            return None;
        }
        Some(format(HqmqParams { secondary, radius_bits, med3, sink }).params())
    }
    fn write_name(&self, p: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = params(p);
        write!(f, "hqmq-s{}-r{}{}", p.secondary, p.radius_bits, if p.med3 { "-med3" } else { "" })?;
        if p.sink > 0 {
            write!(f, "-sink{}", p.sink)?;
        }
        Ok(())
    }
    fn formats(&self) -> Vec<KvParams> {
        let mut v = Vec::new();
        for secondary in SECONDARY {
            for radius_bits in RADIUS_BITS {
                for med3 in [false, true] {
                    v.push(format(HqmqParams { secondary, radius_bits, med3, sink: 0 }).params());
                }
            }
        }
        v
    }
    /// Whole 4-value chunks (quaternions) per head.
    fn head_dim_multiple(&self, _params: KvParams) -> usize {
        4
    }
    fn codec(&self, p: KvParams, geom: KvGeometry, role: KvRole, opts: CodecOptions) -> Box<dyn KvCodec> {
        Box::new(HqmqCodec::new(geom, params(p), role, opts))
    }
    fn exact_keys(&self, p: KvParams) -> Option<ExactKeyParams> {
        let sink = params(p).sink;
        (sink > 0).then_some(ExactKeyParams { window: 0, sink })
    }
}
