//! The plain formats' registry row: f32 (also `auto`, the compute type), bf16 and f16.

use super::{cuda, F32Codec, Half16, Half16Codec};
use crate::kv::{CodecOptions, KvCodec, KvCuda, KvFamily, KvFormat, KvGeometry, KvParams, KvRole};
use std::fmt;

/// The plain family: parameter 0 is f32, 1 bf16, 2 f16 (also the index of its CUDA page).
pub struct Plain;

/// Canonical names, by parameter.
const NAMES: [&str; 3] = ["f32", "bf16", "f16"];

impl KvFormat {
    /// f32, the engine's compute type (`auto`).
    pub const F32: KvFormat = KvFormat::new(&Plain, KvParams(0));
    /// bfloat16.
    pub const BF16: KvFormat = KvFormat::new(&Plain, KvParams(1));
    /// IEEE half.
    pub const F16: KvFormat = KvFormat::new(&Plain, KvParams(2));
}

impl KvFamily for Plain {
    fn family(&self) -> &'static str {
        "plain"
    }
    fn syntax(&self) -> &'static str {
        "auto, f32, bf16, f16"
    }
    fn parse(&self, name: &str) -> Option<KvParams> {
        Some(KvParams(match name {
            "auto" | "f32" | "float32" => 0,
            "bf16" | "bfloat16" => 1,
            "f16" | "fp16" | "float16" | "half" => 2,
            _ => return None,
        }))
    }
    fn write_name(&self, params: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(NAMES[params.0 as usize])
    }
    fn formats(&self) -> Vec<KvParams> {
        (0..NAMES.len() as u64).map(KvParams).collect()
    }
    fn codec(&self, params: KvParams, geom: KvGeometry, _role: KvRole, _opts: CodecOptions) -> Box<dyn KvCodec> {
        match params.0 {
            0 => Box::new(F32Codec::new(geom)),
            1 => Box::new(Half16Codec::new(geom, Half16::Bf16)),
            _ => Box::new(Half16Codec::new(geom, Half16::F16)),
        }
    }
    fn cuda(&self) -> Option<&'static KvCuda> {
        Some(&cuda::CUDA)
    }
    /// A checkpoint's static scale does not apply, as on the CPU.
    fn cuda_page(&self, params: KvParams, _static_scale: bool) -> Option<usize> {
        Some(params.0 as usize)
    }
}
