//! A checkpoint loaded and ready to run: tokenizer plus model (whole, or sharded over
//! tensor-parallel ranks).

use crate::checkpoint::LoadError;
use crate::kv_cache::{KvLayout, KvLayoutError, KvRequest};
use crate::model::key_calibration::CALIBRATION_TEXT;
use crate::model::LlamaModel;
use crate::parallel::{Ranks, TpOptions};
use crate::tokenizer::Tokenizer;
use crate::weights::ModelWeights;
use std::path::Path;
use std::sync::Arc;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;

/// Everything needed to run a model.
pub struct LoadedModel {
    /// The checkpoint (metadata, mapped tensors, decoded quantized layers).
    pub weights: ModelWeights,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The model with kernels chosen; under tensor parallelism, rank 0's shard, which runs
    /// only inside [`Self::run`] (beside the other ranks).
    pub model: LlamaModel,
    /// The CPU the kernels were chosen for.
    pub caps: CpuCaps,
    /// The other ranks, under tensor parallelism.
    ranks: Option<Ranks>,
}

impl LoadedModel {
    /// Loads a GGUF file or HF directory.
    pub fn load(path: &Path, policy: LinearPolicy) -> Result<Self, LoadError> {
        Self::load_parallel(path, policy, &TpOptions { size: 1, cpu_bind: None })
    }

    /// [`Self::load`], sharded over `tp.size` tensor-parallel ranks when it is above 1.
    pub fn load_parallel(path: &Path, policy: LinearPolicy, tp: &TpOptions) -> Result<Self, LoadError> {
        let weights = ModelWeights::open(path)?;
        let tokenizer = Tokenizer::from_checkpoint(&weights.checkpoint)?;
        let caps = CpuCaps::detect();
        let (model, ranks) = if tp.size > 1 {
            let (first, ranks) = Ranks::load(&weights, &caps, policy, tp)?;
            (first, Some(ranks))
        } else {
            (LlamaModel::load(&weights, &caps, policy)?, None)
        };
        Ok(LoadedModel { weights, tokenizer, model, caps, ranks })
    }

    /// Tensor-parallel ranks (1: the whole model in one).
    pub fn tensor_parallel_size(&self) -> usize {
        self.ranks.as_ref().map_or(1, Ranks::world)
    }

    /// Runs `f` on the model: on every rank's shard at once under tensor parallelism (each
    /// rank on its own thread, meeting the others in the forward pass's collectives), returning
    /// rank 0's result; otherwise `f(&self.model)` on the calling thread.
    pub fn run<R: Send>(&self, f: impl Fn(&LlamaModel) -> R + Sync) -> R {
        self.run_all(f).swap_remove(0)
    }

    /// [`Self::run`], returning every rank's result in rank order.
    pub fn run_all<R: Send>(&self, f: impl Fn(&LlamaModel) -> R + Sync) -> Vec<R> {
        match &self.ranks {
            Some(ranks) => ranks.run(&self.model, f),
            None => vec![f(&self.model)],
        }
    }

    /// Rank `r`'s shard (rank 0: [`Self::model`]).
    pub fn rank(&self, r: usize) -> &LlamaModel {
        match (r, &self.ranks) {
            (0, _) | (_, None) => &self.model,
            (r, Some(ranks)) => ranks.other(r),
        }
    }

    /// The KV-cache layout for the formats `req` asks for, with keys centered (and balanced for
    /// qjl1 and tq3_0) for the formats that gain from it, calibrated on [`CALIBRATION_TEXT`]:
    /// once in a sequence for balanced keys, more for keys that are only centered (see
    /// [`LlamaModel::kv_layout_calibrated`]). Under tensor parallelism, one layout per rank
    /// (its KV heads), calibrated on all ranks at once.
    pub fn kv_layouts(&self, req: impl Into<KvRequest>, block_size: usize, seed: u64) -> Result<Vec<Arc<KvLayout>>, KvLayoutError> {
        let req = req.into();
        self.run_all(|m| self.kv_layout_on(m, req, block_size, seed)).into_iter().collect()
    }

    /// [`Self::kv_layouts`] for one model: the whole one, or (inside [`Self::run`]) a rank's.
    pub fn kv_layout_on(&self, m: &LlamaModel, req: impl Into<KvRequest>, block_size: usize, seed: u64) -> Result<Arc<KvLayout>, KvLayoutError> {
        let bos: Vec<u32> = self.tokenizer.special().bos.filter(|_| self.tokenizer.special().add_bos).into_iter().collect();
        // The text without a BOS of its own: the prefix holds the one BOS, whatever the passes.
        let text = self.tokenizer.encode_with(CALIBRATION_TEXT, false).map_err(KvLayoutError::Calibration)?;
        m.kv_layout_calibrated(req, block_size, seed, &bos, &text)
    }

    /// [`Self::kv_layouts`] of a model without tensor parallelism.
    ///
    /// # Panics
    /// Under tensor parallelism (each rank has its own layout: use [`Self::kv_layouts`]).
    pub fn kv_layout(&self, req: impl Into<KvRequest>, block_size: usize, seed: u64) -> Result<Arc<KvLayout>, KvLayoutError> {
        assert!(self.ranks.is_none(), "a tensor-parallel model has one KV layout per rank");
        self.kv_layout_on(&self.model, req, block_size, seed)
    }

    /// Token ids that end generation (the checkpoint's EOS set).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.weights.checkpoint.special.eos.clone()
    }
}
