//! The 8-bit formats' registry row: fp8_e4m3 and int8 (a scale per token and head, or the
//! checkpoint's static scale).

use super::{cuda, Byte8, Scaled8Codec};
use crate::kv::{CodecOptions, KvCodec, KvCuda, KvFamily, KvFormat, KvGeometry, KvParams, KvRole};
use std::fmt;

/// The 8-bit family: parameter 0 is FP8 E4M3, 1 int8.
pub struct Scaled8;

impl KvFormat {
    /// FP8 E4M3 with a scale per token and head (or the checkpoint's per-tensor scale).
    pub const FP8_E4M3: KvFormat = KvFormat::new(&Scaled8, KvParams(0));
    /// int8 with a scale per token and head (or the checkpoint's per-tensor scale).
    pub const INT8: KvFormat = KvFormat::new(&Scaled8, KvParams(1));
}

fn kind(params: KvParams) -> Byte8 {
    if params.0 == 0 { Byte8::Fp8E4m3 } else { Byte8::Int8 }
}

impl KvFamily for Scaled8 {
    fn family(&self) -> &'static str {
        "scaled8"
    }
    fn syntax(&self) -> &'static str {
        "fp8_e4m3 (fp8), int8"
    }
    fn parse(&self, name: &str) -> Option<KvParams> {
        Some(KvParams(match name {
            "fp8" | "fp8-e4m3" | "float8-e4m3fn" => 0,
            "int8" | "i8" => 1,
            _ => return None,
        }))
    }
    fn write_name(&self, params: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match kind(params) {
            Byte8::Fp8E4m3 => "fp8_e4m3",
            Byte8::Int8 => "int8",
        })
    }
    fn formats(&self) -> Vec<KvParams> {
        vec![KvParams(0), KvParams(1)]
    }
    fn codec(&self, params: KvParams, geom: KvGeometry, _role: KvRole, opts: CodecOptions) -> Box<dyn KvCodec> {
        Box::new(Scaled8Codec::new(geom, kind(params), opts.static_scale))
    }
    fn cuda(&self) -> Option<&'static KvCuda> {
        Some(&cuda::CUDA)
    }
    fn cuda_page(&self, params: KvParams, static_scale: bool) -> Option<usize> {
        Some(2 * params.0 as usize + usize::from(static_scale))
    }
}
