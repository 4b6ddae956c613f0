//! The float storage types of Hugging Face checkpoints (F32, F16, BF16): rounding, encoding to
//! and decoding from little-endian safetensors bytes, and their names in config.json.

use half::{bf16, f16};
use safetensors::Dtype;

/// A float storage type of safetensors weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDtype {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatDtype {
    /// The float type of a safetensors dtype, `None` for integer and FP8 types.
    pub fn from_safetensors(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F32 => Some(FloatDtype::F32),
            Dtype::F16 => Some(FloatDtype::F16),
            Dtype::BF16 => Some(FloatDtype::BF16),
            _ => None,
        }
    }

    /// The safetensors dtype.
    pub fn safetensors(self) -> Dtype {
        match self {
            FloatDtype::F32 => Dtype::F32,
            FloatDtype::F16 => Dtype::F16,
            FloatDtype::BF16 => Dtype::BF16,
        }
    }

    /// The name config.json's `torch_dtype` uses (`float32`, `float16`, `bfloat16`).
    pub fn torch_name(self) -> &'static str {
        match self {
            FloatDtype::F32 => "float32",
            FloatDtype::F16 => "float16",
            FloatDtype::BF16 => "bfloat16",
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            FloatDtype::F32 => 4,
            FloatDtype::F16 | FloatDtype::BF16 => 2,
        }
    }

    /// `x` rounded to this type (round to nearest even), as f32.
    pub fn round(self, x: f32) -> f32 {
        match self {
            FloatDtype::F32 => x,
            FloatDtype::F16 => f16::from_f32(x).to_f32(),
            FloatDtype::BF16 => bf16::from_f32(x).to_f32(),
        }
    }

    /// Appends `values` rounded to this type as little-endian bytes.
    pub fn encode_into(self, values: &[f32], out: &mut Vec<u8>) {
        out.reserve(values.len() * self.size());
        match self {
            FloatDtype::F32 => values.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            FloatDtype::F16 => values.iter().for_each(|x| out.extend_from_slice(&f16::from_f32(*x).to_le_bytes())),
            FloatDtype::BF16 => values.iter().for_each(|x| out.extend_from_slice(&bf16::from_f32(*x).to_le_bytes())),
        }
    }

    /// `values` rounded to this type as little-endian bytes.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(values, &mut out);
        out
    }

    /// Decodes little-endian bytes of this type (a trailing partial value is ignored).
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            FloatDtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            FloatDtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            FloatDtype::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }
    }
}
