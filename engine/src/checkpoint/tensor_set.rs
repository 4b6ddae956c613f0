//! The raw tensors of a Hugging Face checkpoint by their own names, as quantization schemes
//! read them: typed accessors that check dtype and shape and name the tensor when they fail,
//! and a record of which tensors a scheme consumed (so none is silently left unused).

use super::{LoadError, TensorBytes};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// One tensor as stored.
#[derive(Clone, Debug)]
pub struct RawTensor {
    /// Name in the checkpoint.
    pub name: String,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Shape, outermost first (empty for a 0-rank scalar).
    pub shape: Vec<usize>,
    /// Bytes (little-endian).
    pub data: TensorBytes,
}

fn err(name: &str, msg: impl Into<String>) -> LoadError {
    LoadError::Tensor { name: name.into(), msg: msg.into() }
}

impl RawTensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Fails unless the shape is one of `allowed`.
    pub fn expect_shape(&self, allowed: &[&[usize]]) -> Result<(), LoadError> {
        if allowed.contains(&self.shape.as_slice()) {
            return Ok(());
        }
        let list: Vec<String> = allowed.iter().map(|s| format!("{s:?}")).collect();
        Err(err(&self.name, format!("shape {:?}, expected {}", self.shape, list.join(" or "))))
    }

    /// Fails unless the dtype is one of `allowed`.
    pub fn expect_dtype(&self, allowed: &[Dtype]) -> Result<(), LoadError> {
        if allowed.contains(&self.dtype) {
            return Ok(());
        }
        Err(err(&self.name, format!("dtype {:?}, expected {}", self.dtype, allowed.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(" or "))))
    }

    /// Values of a float tensor (F32, F16 or BF16) as f32.
    pub fn to_f32(&self) -> Result<Vec<f32>, LoadError> {
        let b = self.data.bytes();
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            // compressed-tensors stores some transform matrices in f64.
            Dtype::F64 => b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
            d => return Err(err(&self.name, format!("dtype {d:?}, expected a float (F32, F16, BF16 or F64)"))),
        })
    }

    /// Values of an I32 tensor.
    pub fn to_i32(&self) -> Result<Vec<i32>, LoadError> {
        self.expect_dtype(&[Dtype::I32])?;
        Ok(self.data.bytes().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Values of an I64 tensor.
    pub fn to_i64(&self) -> Result<Vec<i64>, LoadError> {
        self.expect_dtype(&[Dtype::I64])?;
        Ok(self.data.bytes().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }

    /// Values of an I8 tensor.
    pub fn to_i8(&self) -> Result<Vec<i8>, LoadError> {
        self.expect_dtype(&[Dtype::I8])?;
        Ok(self.data.bytes().iter().map(|&b| b as i8).collect())
    }

    /// The single value of a scalar float tensor (shape `[]` or `[1]`).
    pub fn scalar_f32(&self) -> Result<f32, LoadError> {
        self.expect_shape(&[&[], &[1]])?;
        Ok(self.to_f32()?[0])
    }

    /// A float tensor with one value per row (`[rows]`, `[rows, 1]`), or one for all
    /// (`[]`, `[1]`, broadcast), as `rows` f32 values.
    pub fn per_row_f32(&self, rows: usize) -> Result<Vec<f32>, LoadError> {
        self.expect_shape(&[&[rows], &[rows, 1], &[], &[1]])?;
        let v = self.to_f32()?;
        Ok(if v.len() == rows { v } else { vec![v[0]; rows] })
    }
}

/// All tensors of a checkpoint, by name, with a record of those consumed.
#[derive(Debug, Default)]
pub struct TensorSet {
    tensors: BTreeMap<String, RawTensor>,
    used: Mutex<BTreeSet<String>>,
}

impl TensorSet {
    /// Maps safetensors files and indexes their tensors by name (a name in two files is an error).
    pub fn open(files: &[PathBuf]) -> Result<Self, LoadError> {
        let io = |path: &Path, msg: String| LoadError::Io { path: path.into(), msg };
        let mut set = TensorSet::default();
        for path in files {
            let file = std::fs::File::open(path).map_err(|e| io(path, e.to_string()))?;
            // SAFETY: read-only map of a model file that is not modified while loaded.
            let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| io(path, e.to_string()))?);
            let st = SafeTensors::deserialize(&map).map_err(|e| io(path, format!("invalid safetensors: {e}")))?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let start = view.data().as_ptr() as usize - base;
                let data = TensorBytes::Mapped(map.clone(), start..start + view.data().len());
                set.insert(RawTensor { name, dtype: view.dtype(), shape: view.shape().to_vec(), data })?;
            }
        }
        Ok(set)
    }

    /// Adds a tensor; a name seen twice (two shards) is an error.
    pub fn insert(&mut self, t: RawTensor) -> Result<(), LoadError> {
        let name = t.name.clone();
        if self.tensors.insert(name.clone(), t).is_some() {
            return Err(err(&name, "appears in more than one shard"));
        }
        Ok(())
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Takes a tensor that must exist (`why` says what requires it).
    pub fn take(&self, name: &str, why: &str) -> Result<&RawTensor, LoadError> {
        self.take_opt(name).ok_or_else(|| err(name, format!("missing (required by {why})")))
    }

    /// A tensor if present, without taking it (its shape, for a decision elsewhere).
    pub fn peek(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.get(name)
    }

    /// Takes a tensor if present.
    pub fn take_opt(&self, name: &str) -> Option<&RawTensor> {
        let t = self.tensors.get(name)?;
        self.used.lock().expect("tensor set lock").insert(name.to_string());
        Some(t)
    }

    /// Names of the tensors, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Tensors not taken yet, in name order.
    pub fn untaken(&self) -> Vec<&RawTensor> {
        let used = self.used.lock().expect("tensor set lock");
        self.tensors.values().filter(|t| !used.contains(&t.name)).collect()
    }
}
