//! GGUF v2/v3 reader over a memory map.
//!
//! Strict by design: every count is checked against the bytes that remain before anything
//! is allocated from it, every tensor's byte length is derived from its type and shape and
//! must lie inside the file, aligned, without overlapping another tensor. Errors name the
//! tensor or metadata key and what was wrong.

use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use tessera_kernels::ggml::GgmlType;

/// Maximum tensor rank GGML supports.
const MAX_DIMS: u32 = 4;
/// Default `general.alignment`.
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// uint8
    U8(u8),
    /// int8
    I8(i8),
    /// uint16
    U16(u16),
    /// int16
    I16(i16),
    /// uint32
    U32(u32),
    /// int32
    I32(i32),
    /// uint64
    U64(u64),
    /// int64
    I64(i64),
    /// float32
    F32(f32),
    /// float64
    F64(f64),
    /// bool
    Bool(bool),
    /// UTF-8 string
    String(String),
    /// Homogeneous array
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
    /// GGUF's name for the value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F32(_) => "float32",
            MetaValue::F64(_) => "float64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }
}

impl fmt::Display for MetaValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(a) => write!(f, "[{} x {}]", a.len(), a.first().map_or("?", |v| v.type_name())),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            other => write!(f, "{}", other.as_u64().map_or_else(|| format!("{other:?}"), |v| v.to_string())),
        }
    }
}

/// One tensor's header entry, validated against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensor {
    /// Tensor name.
    pub name: String,
    /// Storage type.
    pub ty: GgmlType,
    /// Dimensions in GGUF order (`ne[0]` is the contiguous row length).
    pub dims: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Byte length, derived from type and shape.
    pub nbytes: usize,
}

/// A parse or validation failure, with where it happened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    /// The file cannot be opened or mapped.
    #[error("{0}")]
    Io(String),
    /// Not a GGUF file.
    #[error("bad magic {0:02x?}: not a GGUF file")]
    BadMagic([u8; 4]),
    /// A version this reader does not handle.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    BadVersion(u32),
    /// The file ends before a structure it declares.
    #[error("truncated file: {what} needs {need} bytes at offset {at}, file has {len}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Bytes needed.
        need: u64,
        /// Offset of the read.
        at: usize,
        /// File length.
        len: usize,
    },
    /// A count larger than the file could possibly hold.
    #[error("absurd count in {what}: {count} (at most {max} fit in the file)")]
    AbsurdCount {
        /// Which count.
        what: String,
        /// Value read.
        count: u64,
        /// Upper bound from the remaining bytes.
        max: u64,
    },
    /// Malformed metadata.
    #[error("metadata key {key:?}: {msg}")]
    Metadata {
        /// Key.
        key: String,
        /// Problem.
        msg: String,
    },
    /// A tensor entry that is inconsistent with its type, shape or the file.
    #[error("tensor {name:?}: {msg}")]
    Tensor {
        /// Tensor name.
        name: String,
        /// Problem.
        msg: String,
    },
}

fn terr(name: &str, msg: impl Into<String>) -> GgufError {
    GgufError::Tensor { name: name.to_string(), msg: msg.into() }
}

/// A parsed GGUF file; tensor data stays in the memory map.
#[derive(Debug)]
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in key order.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<GgufTensor>,
    /// Data alignment.
    pub alignment: usize,
    map: Arc<Mmap>,
}

impl GgufFile {
    /// Opens and validates a GGUF file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path).map_err(|e| GgufError::Io(format!("{}: {e}", path.display())))?;
        // SAFETY: the file is opened read-only; Tessera never writes model files while serving them.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::Io(format!("{}: mmap: {e}", path.display())))?;
        Self::parse(Arc::new(map))
    }

    /// Parses and validates GGUF bytes.
    pub fn parse(map: Arc<Mmap>) -> Result<Self, GgufError> {
        let GgufHeader { version, metadata, tensors, alignment } = parse_bytes(&map)?;
        Ok(GgufFile { version, metadata, tensors, alignment, map })
    }

    /// The memory map holding the file.
    pub fn map(&self) -> &Arc<Mmap> {
        &self.map
    }

    /// A tensor's bytes.
    pub fn tensor_data(&self, t: &GgufTensor) -> &[u8] {
        &self.map[t.offset..t.offset + t.nbytes]
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
}

/// Everything before the tensor data, validated against the file's length.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in key order.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<GgufTensor>,
    /// Data alignment.
    pub alignment: usize,
}

/// Parses GGUF from a byte slice (the memory map, or test buffers).
pub fn parse_bytes(buf: &[u8]) -> Result<GgufHeader, GgufError> {
    let mut r = Reader { buf, pos: 0 };
    let magic: [u8; 4] = r.bytes(4, "magic")?.try_into().expect("4 bytes");
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic(magic));
    }
    let version = r.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::BadVersion(version));
    }
    // A tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes;
    // a key/value at least 8 (key len) + 4 (type) + 1.
    let n_tensors = r.count("tensor_count", 24)?;
    let n_kv = r.count("metadata_kv_count", 13)?;

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let ty = r.u32(&format!("type of metadata key {key:?}"))?;
        let value = r.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(GgufError::Metadata { key, msg: "duplicate key".into() });
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(GgufError::Metadata {
                    key: "general.alignment".into(),
                    msg: format!("{v} is not a power of two in 1..=1048576"),
                })
            }
        },
    } as usize;

    struct RawInfo {
        name: String,
        ty: GgmlType,
        dims: Vec<usize>,
        rel_offset: u64,
        nbytes: usize,
    }
    let mut infos: Vec<RawInfo> = Vec::new();
    for _ in 0..n_tensors {
        let name = r.string("tensor name")?;
        let n_dims = r.u32(&format!("n_dims of tensor {name:?}"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(terr(&name, format!("{n_dims} dimensions (GGML allows 1..={MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut elems: usize = 1;
        for d in 0..n_dims {
            let v = r.u64(&format!("dimension {d} of tensor {name:?}"))?;
            if v == 0 || v > i64::MAX as u64 {
                return Err(terr(&name, format!("dimension {d} is {v}")));
            }
            let v = usize::try_from(v).map_err(|_| terr(&name, format!("dimension {d} ({v}) overflows")))?;
            elems = elems.checked_mul(v).ok_or_else(|| terr(&name, "element count overflows"))?;
            dims.push(v);
        }
        let type_id = r.u32(&format!("type of tensor {name:?}"))?;
        let ty = GgmlType::from_id(type_id).map_err(|e| terr(&name, e.to_string()))?;
        let rel_offset = r.u64(&format!("offset of tensor {name:?}"))?;
        if dims[0] % ty.block_size() != 0 {
            return Err(terr(
                &name,
                format!("row length {} is not a multiple of {ty}'s block size {}", dims[0], ty.block_size()),
            ));
        }
        let nbytes = (elems / ty.block_size())
            .checked_mul(ty.type_size())
            .ok_or_else(|| terr(&name, "byte size overflows"))?;
        if infos.iter().any(|i| i.name == name) {
            return Err(terr(&name, "duplicate tensor name"));
        }
        infos.push(RawInfo { name, ty, dims, rel_offset, nbytes });
    }
    let data_start = r.pos.next_multiple_of(alignment);
    let len = buf.len();
    let mut tensors = Vec::with_capacity(infos.len());
    for i in infos {
        if i.rel_offset % alignment as u64 != 0 {
            return Err(terr(&i.name, format!("data offset {} is not aligned to {alignment}", i.rel_offset)));
        }
        let offset = usize::try_from(i.rel_offset)
            .ok()
            .and_then(|o| o.checked_add(data_start))
            .filter(|o| o.checked_add(i.nbytes).is_some_and(|end| end <= len))
            .ok_or_else(|| {
                terr(
                    &i.name,
                    format!(
                        "{} bytes of {} {:?} at data offset {} run past the end of the file ({len} bytes, data section at {data_start})",
                        i.nbytes, i.ty, i.dims, i.rel_offset
                    ),
                )
            })?;
        tensors.push(GgufTensor { name: i.name, ty: i.ty, dims: i.dims, offset, nbytes: i.nbytes });
    }
    let mut order: Vec<&GgufTensor> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].nbytes > w[1].offset {
            return Err(terr(
                &w[1].name,
                format!(
                    "data at {}..{} overlaps tensor {:?} at {}..{}",
                    w[1].offset,
                    w[1].offset + w[1].nbytes,
                    w[0].name,
                    w[0].offset,
                    w[0].offset + w[0].nbytes
                ),
            ));
        }
    }
    Ok(GgufHeader { version, metadata, tensors, alignment })
}

/// Bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Nesting limit for arrays of arrays.
const MAX_ARRAY_DEPTH: u32 = 4;

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() as u64 {
            return Err(GgufError::Truncated { what: what.to_string(), need: n, at: self.pos, len: self.buf.len() });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.bytes(N as u64, what)?.try_into().expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_item` bytes long, checked against what remains.
    fn count(&mut self, what: &str, min_item: u64) -> Result<u64, GgufError> {
        let c = self.u64(what)?;
        let max = self.remaining() as u64 / min_item;
        if c > max {
            return Err(GgufError::AbsurdCount { what: what.to_string(), count: c, max });
        }
        Ok(c)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(&format!("length of {what}"))?;
        let at = self.pos;
        let b = self.bytes(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::Metadata {
            key: what.to_string(),
            msg: format!("string at offset {at} is not valid UTF-8"),
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(self.array::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(key)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(GgufError::Metadata { key: key.into(), msg: format!("bool byte {b}") }),
            },
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Metadata { key: key.into(), msg: "arrays nested too deeply".into() });
                }
                let elem_ty = self.u32(key)?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    t => return Err(GgufError::Metadata { key: key.into(), msg: format!("unknown array element type {t}") }),
                };
                let n = self.count(&format!("array length of {key:?}"), min)?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(key)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(GgufError::Metadata { key: key.into(), msg: format!("unknown value type {t}") }),
        })
    }
}
