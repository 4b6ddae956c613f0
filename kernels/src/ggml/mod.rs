//! GGML block formats: types, scalar dequantization, activation quantization.

pub mod act_quant;
pub mod dequant;
pub mod types;

pub use dequant::dequantize_row;
pub use types::{GgmlType, TypeError, QK_K};
