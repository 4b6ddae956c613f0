//! Writing GGUF (version 3) files: metadata, tensor headers, then each tensor's bytes as a
//! caller produces them, one at a time, so a file larger than memory can be written.

use super::gguf::MetaValue;
use std::io::{self, Write};
use tessera_kernels::ggml::GgmlType;

/// Data alignment of the files written (GGUF's default `general.alignment`).
const ALIGNMENT: usize = 32;

/// A tensor to be written: name, type and shape in row-major order (`[rows, cols]`, or
/// `[n]`; written reversed, as GGUF's `ne` lists the contiguous dimension first).
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// Tensor name (llama.cpp's, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Storage type.
    pub ty: GgmlType,
    /// Shape, outermost dimension first.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Bytes of the tensor's data (the last dimension must be whole blocks).
    pub fn nbytes(&self) -> usize {
        let (&cols, outer) = self.shape.split_last().expect("at least one dimension");
        let rows: usize = outer.iter().product();
        rows * self.ty.row_bytes(cols).expect("whole blocks")
    }
}

fn string(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// GGUF's type id of a metadata value.
fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn value(w: &mut impl Write, v: &MetaValue) -> io::Result<()> {
    match v {
        MetaValue::U8(x) => w.write_all(&[*x]),
        MetaValue::I8(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::U16(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::I16(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::U32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::I32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::F32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::Bool(x) => w.write_all(&[u8::from(*x)]),
        MetaValue::String(s) => string(w, s),
        MetaValue::Array(items) => {
            // An empty array's element type is not recoverable; any type reads back as empty.
            w.write_all(&items.first().map_or(0, value_type).to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|i| value(w, i))
        }
        MetaValue::U64(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::I64(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// Writes a GGUF file to `w`: `metadata` in order, the headers of `tensors`, then each
/// tensor's data, which `data(i, buf)` fills (`buf` comes zeroed, `tensors[i].nbytes()` long).
pub fn write_gguf<W: Write>(
    mut w: W,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorSpec],
    mut data: impl FnMut(usize, &mut [u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mut head = Vec::new();
    head.extend_from_slice(b"GGUF");
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        string(&mut head, k)?;
        head.extend_from_slice(&value_type(v).to_le_bytes());
        value(&mut head, v)?;
    }
    let mut offset = 0usize;
    for t in tensors {
        string(&mut head, &t.name)?;
        head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            head.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        head.extend_from_slice(&t.ty.id().to_le_bytes());
        head.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = (offset + t.nbytes()).next_multiple_of(ALIGNMENT);
    }
    head.resize(head.len().next_multiple_of(ALIGNMENT), 0);
    w.write_all(&head)?;
    let mut buf = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let n = t.nbytes();
        buf.clear();
        buf.resize(n.next_multiple_of(ALIGNMENT), 0);
        data(i, &mut buf[..n])?;
        w.write_all(&buf)?;
    }
    w.flush()
}
