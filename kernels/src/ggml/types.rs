//! GGML tensor element types: ids, block geometry and byte sizes.

use std::fmt;

/// Elements per block of the k-quant family.
pub const QK_K: usize = 256;

/// A GGML element type as stored in GGUF files.
///
/// Only the types Tessera can decode are listed; other ids are reported by
/// [`GgmlType::from_id`] as unsupported with their llama.cpp name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 4-bit, 32-value blocks, f16 scale, offset -8.
    Q4_0,
    /// 4-bit, 32-value blocks, f16 scale and f16 min.
    Q4_1,
    /// 5-bit, 32-value blocks, f16 scale, offset -16.
    Q5_0,
    /// 5-bit, 32-value blocks, f16 scale and f16 min.
    Q5_1,
    /// 8-bit, 32-value blocks, f16 scale.
    Q8_0,
    /// 8-bit, 32-value blocks, f16 scale and f16 `d * sum(q)` (activation format).
    Q8_1,
    /// 2-bit k-quant (256-value super-blocks).
    Q2K,
    /// 3-bit k-quant.
    Q3K,
    /// 4-bit k-quant.
    Q4K,
    /// 5-bit k-quant.
    Q5K,
    /// 6-bit k-quant.
    Q6K,
    /// 8-bit k-quant (f32 scale, activation format).
    Q8K,
}

/// Why a GGML type id cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TypeError {
    /// A type llama.cpp defines that Tessera does not decode (yet).
    #[error("ggml type {name} (id {id}) is not supported")]
    Unsupported {
        /// Numeric type id.
        id: u32,
        /// llama.cpp's name for it.
        name: &'static str,
    },
    /// An id no GGML version defines.
    #[error("unknown ggml type id {0}")]
    Unknown(u32),
}

impl GgmlType {
    /// Every supported type, in id order.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::BF16,
    ];

    /// Decodes a GGUF tensor type id.
    pub fn from_id(id: u32) -> Result<Self, TypeError> {
        if let Some(t) = Self::ALL.iter().find(|t| t.id() == id) {
            return Ok(*t);
        }
        let name = match id {
            4 => "Q4_2 (removed)",
            5 => "Q4_3 (removed)",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return Err(TypeError::Unknown(id)),
        };
        Err(TypeError::Unsupported { id, name })
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Q8K => 15,
            GgmlType::BF16 => 30,
        }
    }

    /// llama.cpp's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::Q8K => "Q8_K",
        }
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1 => 32,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q8K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::Q8K => 292,
        }
    }

    /// Bytes of a row of `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    /// Rows `rows` and columns `cols` of a row-major `[_, width]` matrix of this type held in
    /// `data`, as a new buffer of the same type (a tensor-parallel shard: blocks copied, never
    /// re-quantized). The column cut must fall on block boundaries.
    pub fn slice_matrix(self, width: usize, data: &[u8], rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Result<Vec<u8>, String> {
        let bs = self.block_size();
        let rb = self.row_bytes(width).ok_or_else(|| format!("{width} columns are not whole {} blocks of {bs}", self.name()))?;
        if cols.start >= cols.end || cols.end > width || rows.end * rb > data.len() {
            return Err(format!("shard rows {rows:?} x cols {cols:?} outside a {}x{width} {} matrix", data.len() / rb.max(1), self.name()));
        }
        if !cols.start.is_multiple_of(bs) || !cols.end.is_multiple_of(bs) {
            return Err(format!("input columns {cols:?} cut a {} block of {bs} values", self.name()));
        }
        let (b0, b1) = (cols.start / bs * self.type_size(), cols.end / bs * self.type_size());
        Ok(rows.flat_map(|r| &data[r * rb + b0..r * rb + b1]).copied().collect())
    }

    /// Whether this is a plain float type (no blocks).
    pub fn is_float(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
