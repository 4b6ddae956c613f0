//! A checkpoint loaded and ready to run: tokenizer plus model.

use crate::checkpoint::{Checkpoint, LoadError};
use crate::kv::key_calibration::CALIBRATION_TEXT;
use crate::kv::{KvLayout, KvLayoutError, KvRequest};
use std::sync::Arc;
use crate::model::LlamaModel;
use crate::tokenizer::Tokenizer;
use std::path::Path;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;

/// Everything needed to run a model.
pub struct LoadedModel {
    /// The checkpoint (metadata and mapped tensors).
    pub checkpoint: Checkpoint,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The model with kernels chosen.
    pub model: LlamaModel,
    /// The CPU the kernels were chosen for.
    pub caps: CpuCaps,
}

impl LoadedModel {
    /// Loads a GGUF file or HF directory.
    pub fn load(path: &Path, policy: LinearPolicy) -> Result<Self, LoadError> {
        let checkpoint = Checkpoint::open(path)?;
        let tokenizer = Tokenizer::from_checkpoint(&checkpoint)?;
        let caps = CpuCaps::detect();
        let model = LlamaModel::load(&checkpoint, &caps, policy)?;
        Ok(LoadedModel { checkpoint, tokenizer, model, caps })
    }

    /// The KV-cache layout for the formats `req` asks for, with keys centered (and balanced for
    /// qjl1 and tq3_0) for the formats that gain from it, calibrated on [`CALIBRATION_TEXT`]:
    /// once in a sequence for balanced keys, more for keys that are only centered (see
    /// [`LlamaModel::kv_layout_calibrated`]).
    pub fn kv_layout(&self, req: impl Into<KvRequest>, block_size: usize, seed: u64) -> Result<Arc<KvLayout>, KvLayoutError> {
        let bos: Vec<u32> = self.tokenizer.special().bos.filter(|_| self.tokenizer.special().add_bos).into_iter().collect();
        let text = self.tokenizer.encode(CALIBRATION_TEXT).map_err(KvLayoutError::Calibration)?;
        self.model.kv_layout_calibrated(req, block_size, seed, &bos, &text)
    }

    /// Token ids that end generation (the checkpoint's EOS set).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.checkpoint.special.eos.clone()
    }
}
