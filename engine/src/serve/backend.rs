//! Where the engine's forward passes run: the scheduler hands out KV block ids and token spans;
//! a [`Backend`] owns the model and the pool those ids index, on the CPU or on a GPU.

use crate::kv_cache::{BlockPool, ExactKeyPart, ExactKeyStore, KvLayout, PagedSeqKv};
use crate::model::cuda::{CudaLlama, CudaStep};
use crate::model::{PlanEntry, SeqInput};
use crate::LoadedModel;
use std::sync::{Arc, Mutex};

/// One sequence's part of a step.
pub struct StepSeq<'a> {
    /// New tokens, after the `cached` ones already in the cache.
    pub tokens: &'a [u32],
    /// The sequence's block table (covering `cached + tokens.len()` positions).
    pub blocks: &'a [u32],
    /// Tokens already cached.
    pub cached: usize,
    /// Leading cached tokens that live in blocks shared with other sequences (never written).
    pub shared: usize,
    /// Return logits of new tokens `logits_from..` (`None`: none).
    pub logits_from: Option<usize>,
    /// The sequence's exact keys, when its key format keeps some (a part per rank).
    pub exact: Option<&'a mut ExactKeyStore>,
}

/// Runs a batch of sequences through the model and returns each one's requested logit rows.
pub trait Backend: Send {
    /// One forward pass over `batch`.
    fn forward(&mut self, batch: &mut [StepSeq<'_>]) -> Result<Vec<Vec<f32>>, String>;
    /// The kernel chosen for every linear layer on this backend.
    fn plan(&self) -> Vec<PlanEntry>;
    /// Copies KV block `src` into block `dst` (all layers), between forward passes.
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String>;
}

/// The CPU model over a host block pool.
pub struct CpuBackend {
    model: Arc<LoadedModel>,
    pool: BlockPool,
}

impl CpuBackend {
    /// A pool of `num_blocks` blocks of `layout` for `model`.
    pub fn new(model: Arc<LoadedModel>, layout: Arc<KvLayout>, num_blocks: usize) -> Self {
        CpuBackend { model, pool: BlockPool::new(layout, num_blocks) }
    }
}

impl Backend for CpuBackend {
    fn forward(&mut self, batch: &mut [StepSeq<'_>]) -> Result<Vec<Vec<f32>>, String> {
        let mut views: Vec<PagedSeqKv<'_>> =
            batch.iter_mut().map(|s| PagedSeqKv::new(&self.pool, s.blocks, s.cached, s.shared).with_exact(s.exact.take().map(ExactKeyStore::only_part))).collect();
        let mut inputs: Vec<SeqInput<'_>> =
            batch.iter().zip(views.iter_mut()).map(|(s, kv)| SeqInput { tokens: s.tokens, kv, logits_from: s.logits_from }).collect();
        self.model.model.forward(&mut inputs).map_err(|e| e.to_string())
    }

    fn plan(&self) -> Vec<PlanEntry> {
        self.model.model.plan()
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        self.pool.copy_block(src, dst);
        Ok(())
    }
}

/// A tensor-parallel model on the CPU: each rank's shard over a block pool of its own KV heads,
/// all pools indexed by the same block ids (one block table per sequence for every rank), and
/// each rank's part of a sequence's exact keys.
pub struct TpBackend {
    model: Arc<LoadedModel>,
    pools: Vec<BlockPool>,
}

impl TpBackend {
    /// Pools of `num_blocks` blocks, one per rank in that rank's `layouts` entry.
    pub fn new(model: Arc<LoadedModel>, layouts: &[Arc<KvLayout>], num_blocks: usize) -> Self {
        assert_eq!(layouts.len(), model.tensor_parallel_size(), "one KV layout per rank");
        TpBackend { pools: layouts.iter().map(|l| BlockPool::new(l.clone(), num_blocks)).collect(), model }
    }
}

impl Backend for TpBackend {
    fn forward(&mut self, batch: &mut [StepSeq<'_>]) -> Result<Vec<Vec<f32>>, String> {
        // Each rank's part of every sequence's exact keys, for that rank's thread alone.
        let world = self.pools.len();
        let mut parts: Vec<Vec<Option<&mut ExactKeyPart>>> = (0..world).map(|_| Vec::with_capacity(batch.len())).collect();
        for s in batch.iter_mut() {
            match s.exact.take().map(ExactKeyStore::parts_mut) {
                Some(ps) => {
                    assert_eq!(ps.len(), world, "exact keys: one part per rank");
                    parts.iter_mut().zip(ps).for_each(|(rank, p)| rank.push(Some(p)));
                }
                None => parts.iter_mut().for_each(|rank| rank.push(None)),
            }
        }
        let parts: Vec<Mutex<Vec<Option<&mut ExactKeyPart>>>> = parts.into_iter().map(Mutex::new).collect();
        let batch = &*batch;
        let pools = &self.pools;
        self.model
            .run(|m| {
                let rank = m.shard().map_or(0, |s| s.rank);
                let pool = &pools[rank];
                let mut exact = parts[rank].lock().unwrap_or_else(|e| e.into_inner());
                let mut views: Vec<PagedSeqKv<'_>> = batch
                    .iter()
                    .zip(exact.iter_mut())
                    .map(|(s, e)| PagedSeqKv::new(pool, s.blocks, s.cached, s.shared).with_exact(e.take()))
                    .collect();
                let mut inputs: Vec<SeqInput<'_>> =
                    batch.iter().zip(views.iter_mut()).map(|(s, kv)| SeqInput { tokens: s.tokens, kv, logits_from: s.logits_from }).collect();
                m.forward(&mut inputs)
            })
            .map_err(|e| e.to_string())
    }

    fn plan(&self) -> Vec<PlanEntry> {
        let world = self.model.tensor_parallel_size();
        (0..world)
            .flat_map(|r| {
                self.model.rank(r).plan().into_iter().map(move |mut e| {
                    e.shard = Some(format!("rank {r}/{world}: {}", e.shard.as_deref().unwrap_or("replicated")));
                    e
                })
            })
            .collect()
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        self.pools.iter_mut().for_each(|p| p.copy_block(src, dst));
        Ok(())
    }
}

/// The model on a GPU, its KV pool in device memory.
pub struct CudaBackend {
    model: CudaLlama,
}

impl CudaBackend {
    /// Wraps a loaded GPU model (its pool sized to the scheduler's blocks).
    pub fn new(model: CudaLlama) -> Self {
        CudaBackend { model }
    }
}

impl Backend for CudaBackend {
    fn forward(&mut self, batch: &mut [StepSeq<'_>]) -> Result<Vec<Vec<f32>>, String> {
        debug_assert!(batch.iter().all(|s| s.exact.is_none()), "the CUDA backend scores no exact keys (it refuses qjl1)");
        let steps: Vec<CudaStep<'_>> =
            batch.iter().map(|s| CudaStep { tokens: s.tokens, blocks: s.blocks, cached: s.cached, logits_from: s.logits_from }).collect();
        self.model.forward(&steps).map_err(|e| e.to_string())
    }

    fn plan(&self) -> Vec<PlanEntry> {
        self.model.plan().to_vec()
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        self.model.copy_block(src, dst).map_err(|e| e.to_string())
    }
}
