//! TQ3_0's registry row.

use super::{Tq3Codec, BLOCK};
use crate::kv::{CodecOptions, KvCodec, KvFamily, KvFormat, KvGeometry, KvParams, KvRole};
use std::fmt;

/// The TQ3_0 family: one format, no parameters.
pub struct Tq3_0;

impl KvFormat {
    /// TQ3_0: 32-value blocks, WHT32, 2-bit codebook, residual signs, fp16 scale.
    pub const TQ3_0: KvFormat = KvFormat::from_family(&Tq3_0);
}

impl KvFamily for Tq3_0 {
    fn family(&self) -> &'static str {
        "tq3_0"
    }
    fn syntax(&self) -> &'static str {
        "tq3_0"
    }
    fn parse(&self, name: &str) -> Option<KvParams> {
        matches!(name, "tq3-0" | "tq3").then_some(KvParams(0))
    }
    fn write_name(&self, _params: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tq3_0")
    }
    fn formats(&self) -> Vec<KvParams> {
        vec![KvParams(0)]
    }
    /// Whole blocks of 32 values per head.
    fn head_dim_multiple(&self, _params: KvParams) -> usize {
        BLOCK
    }
    fn codec(&self, _params: KvParams, geom: KvGeometry, _role: KvRole, _opts: CodecOptions) -> Box<dyn KvCodec> {
        Box::new(Tq3Codec::new(geom))
    }
}
