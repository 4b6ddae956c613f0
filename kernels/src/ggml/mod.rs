//! GGML block formats: types, scalar dequantization, weight and activation quantization.

pub mod act_quant;
pub mod dequant;
pub mod quantize;
pub mod types;

pub use dequant::dequantize_row;
pub use types::{GgmlType, TypeError, QK_K};
