//! Which part of a model one tensor-parallel rank holds (Megatron-style sharding).
//!
//! Q, K, V, gate and up are column-parallel (each rank holds a range of their output rows);
//! O and down are row-parallel (each rank holds the matching range of their input columns, and
//! the ranks' partial outputs are summed by an all-reduce); the output head is vocab-parallel
//! (a range of its rows, the logits gathered). Attention heads go to ranks whole, KV group by
//! KV group, so each rank attends with its own query heads over its own KV heads and keeps
//! only those heads' cache. Norms, embeddings and MoE routers are replicated.
//!
//! Ranges are as even as the cut points allow; a cut that would split a quantization group or
//! block is refused at load with the tensor's name (see [`super::Linear::load_cut`]).

use crate::checkpoint::{LoadError, ModelConfig};
use crate::weights::ModelWeights;
use std::ops::Range;

thread_local! {
    /// The tensor-parallel rank this thread runs (set by the rank threads).
    static CURRENT_RANK: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Marks the calling thread as rank `rank`'s (for the rest of its life).
pub fn set_current_rank(rank: usize) {
    CURRENT_RANK.with(|r| r.set(Some(rank)));
}

/// The rank the calling thread runs, if it is a rank thread.
pub fn current_rank() -> Option<usize> {
    CURRENT_RANK.with(|r| r.get())
}

/// Which part of a weight matrix a rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cut {
    /// All of it.
    Whole,
    /// Output rows `range` (column-parallel layers, the vocab-parallel head).
    Rows(Range<usize>),
    /// Input columns `range` (row-parallel layers).
    Cols(Range<usize>),
}

impl Cut {
    /// `[rows, cols]` of the part of a `[rows, cols]` matrix.
    pub fn shape(&self, rows: usize, cols: usize) -> [usize; 2] {
        match self {
            Cut::Whole => [rows, cols],
            Cut::Rows(r) => [r.len(), cols],
            Cut::Cols(c) => [rows, c.len()],
        }
    }
}

/// One rank's place in a tensor-parallel group and its attention heads.
#[derive(Clone, Debug, PartialEq)]
pub struct Shard {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// KV heads this rank attends over and caches.
    pub kv_heads: Range<usize>,
    /// Query heads this rank computes (the query heads of its KV heads).
    pub q_heads: Range<usize>,
    /// Each rank's share of a dense MLP's inner width (summing to 1): even, unless the heads
    /// split unevenly, when the MLP evens out each rank's weights (see [`Shard::new`]).
    pub mlp_shares: Vec<f64>,
}

/// `n` split into `world` contiguous ranges whose cut points are multiples of `align`, as even
/// as that allows (earlier ranks take the remainder). `None` when some rank would get nothing.
pub fn split(n: usize, world: usize, align: usize) -> Option<Vec<Range<usize>>> {
    let units = n.div_ceil(align);
    if units < world {
        return None;
    }
    let (base, extra) = (units / world, units % world);
    let mut at = 0;
    Some(
        (0..world)
            .map(|r| {
                let end = ((at + base + usize::from(r < extra)) * align).min(n);
                let range = at * align..end;
                at += base + usize::from(r < extra);
                range
            })
            .collect(),
    )
}

/// `n` split into contiguous ranges of about `shares` (fractions summing to 1) of it, cut points
/// rounded to multiples of `align`. `None` when some range would be empty.
pub fn split_shares(n: usize, shares: &[f64], align: usize) -> Option<Vec<Range<usize>>> {
    let units = n.div_ceil(align);
    let mut cuts = vec![0];
    let mut acc = 0.0;
    for s in &shares[..shares.len() - 1] {
        acc += s;
        cuts.push(((acc * units as f64).round() as usize).clamp(0, units));
    }
    cuts.push(units);
    let ranges: Vec<Range<usize>> = cuts.windows(2).map(|c| (c[0] * align).min(n)..(c[1] * align).min(n)).collect();
    ranges.iter().all(|r| !r.is_empty()).then_some(ranges)
}

impl Shard {
    /// Rank `rank` of `world` for a model of `config`: KV heads split as evenly as possible
    /// (each rank then computes its KV heads' query heads); with fewer KV heads than ranks, each
    /// KV head is replicated on `world / num_kv_heads` ranks that split its query heads, as vLLM
    /// does. Other head counts are refused.
    pub fn new(config: &ModelConfig, rank: usize, world: usize) -> Result<Self, LoadError> {
        let (nq, nkv) = (config.num_heads, config.num_kv_heads);
        let group = nq / nkv;
        let refuse = |msg: String| LoadError::Config { key: "tensor_parallel_size".into(), msg };
        if world == 0 || rank >= world {
            return Err(refuse(format!("rank {rank} of {world}")));
        }
        let even = vec![1.0 / world as f64; world];
        if nkv >= world {
            let all = split(nkv, world, 1).expect("nkv >= world");
            // Attention weights per KV head (Q and O rows/columns of its query heads, K and V),
            // MLP weights per unit of inner width (gate, up, down): the MLP takes up what the
            // attention split leaves uneven, so every rank reads about the same bytes a step.
            let (h, hd) = (config.hidden_size as f64, config.head_dim as f64);
            let (attn, unit) = ((2 * group + 2) as f64 * hd * h, 3.0 * h);
            let total = attn * nkv as f64 + unit * config.intermediate_size as f64;
            let units: Vec<f64> = all.iter().map(|kv| (total / world as f64 - attn * kv.len() as f64).max(unit) / unit).collect();
            let sum: f64 = units.iter().sum();
            let kv = all[rank].clone();
            return Ok(Shard { rank, world, q_heads: kv.start * group..kv.end * group, kv_heads: kv, mlp_shares: units.iter().map(|u| u / sum).collect() });
        }
        let copies = world / nkv;
        if !world.is_multiple_of(nkv) || !group.is_multiple_of(copies) {
            return Err(refuse(format!(
                "{world} ranks cannot share {nkv} KV heads of {group} query heads each (use a size that divides the KV heads, or a multiple of them that divides each group)"
            )));
        }
        let kv = rank / copies;
        let per = group / copies;
        let q0 = kv * group + (rank % copies) * per;
        Ok(Shard { rank, world, kv_heads: kv..kv + 1, q_heads: q0..q0 + per, mlp_shares: even })
    }

    /// The same rank with an even split of every inner width (MoE experts, whose work follows
    /// the routing, not the weights).
    pub fn evenly(&self) -> Shard {
        Shard { mlp_shares: vec![1.0 / self.world as f64; self.world], ..self.clone() }
    }

    /// Every rank's cut of `rows` output rows (e.g. the vocabulary), in rank order, in
    /// multiples of the rows' quantization granularity `align`.
    pub fn row_cuts(&self, name: &str, rows: usize, align: usize) -> Result<Vec<Range<usize>>, LoadError> {
        split(rows, self.world, align).ok_or_else(|| self.unsplittable(name, rows, "rows", align))
    }

    /// The cut of an inner width `n` (an MLP's) for this rank by [`Self::mlp_shares`]: output
    /// rows of gate/up, input columns of down, cut on `align` (the down projection's column
    /// granularity).
    pub fn inner(&self, name: &str, n: usize, align: usize) -> Result<Range<usize>, LoadError> {
        split_shares(n, &self.mlp_shares, align).map(|mut v| v.swap_remove(self.rank)).ok_or_else(|| self.unsplittable(name, n, "input columns", align))
    }

    /// Why `n` of `what` of tensor `name` cannot go to every rank.
    fn unsplittable(&self, name: &str, n: usize, what: &str, align: usize) -> LoadError {
        LoadError::Tensor { name: name.into(), msg: format!("{n} {what} in units of {align} cannot be split over {} ranks", self.world) }
    }
}

/// The granularity of `name`'s input columns: a cut between ranks must fall on a multiple of
/// it (a GGUF block, an int4 group, an FP8 scale block; 32 for the integer kernels' runs;
/// and a block of its online input transform, which each rank runs on its own columns).
pub fn col_align(ck: &ModelWeights, name: &str) -> Result<usize, LoadError> {
    let storage = match ck.quantized.get(name) {
        Some(q) => q.matrix.col_align(),
        None => ck.checkpoint.tensor(name)?.ty.block_size(),
    };
    Ok(match ck.input_transforms.get(name) {
        Some(t) => lcm(storage, t.block()),
        None => storage,
    })
}

/// The least common multiple of `a` and `b` (both positive).
fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// The granularity of `name`'s output rows: an FP8 scale block's height (1 otherwise), and a
/// block of its online output transform, which each rank runs on its own rows.
pub fn row_align(ck: &ModelWeights, name: &str) -> usize {
    let storage = ck.quantized.get(name).map_or(1, |q| q.matrix.row_align());
    ck.output_transforms.get(name).map_or(storage, |t| lcm(storage, t.block()))
}

/// The granularity of a feed-forward's inner cut: down's columns and gate's and up's rows.
pub fn inner_align(ck: &ModelWeights, [gate, up, down]: [&str; 3]) -> Result<usize, LoadError> {
    Ok(lcm(col_align(ck, down)?, lcm(row_align(ck, gate), row_align(ck, up))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cut_where_asked_on_aligned_points() {
        assert_eq!(split_shares(1536, &[0.5, 0.5], 32), split(1536, 2, 32));
        assert_eq!(split_shares(1536, &[0.4444, 0.5556], 32), Some(vec![0..672, 672..1536]));
        assert_eq!(split_shares(100, &[0.99, 0.01], 32), None);
    }

    #[test]
    fn splits_are_even_aligned_and_cover_everything() {
        assert_eq!(split(1536, 2, 256), Some(vec![0..768, 768..1536]));
        assert_eq!(split(576, 2, 192), Some(vec![0..384, 384..576]));
        assert_eq!(split(49152, 3, 1), Some(vec![0..16384, 16384..32768, 32768..49152]));
        assert_eq!(split(100, 3, 32), Some(vec![0..64, 64..96, 96..100]));
        assert_eq!(split(64, 3, 32), None);
        for (n, w, a) in [(1000, 4, 7), (33, 2, 1), (4096, 8, 128)] {
            let v = split(n, w, a).unwrap();
            assert_eq!((v[0].start, v[w - 1].end), (0, n));
            assert!(v.windows(2).all(|p| p[0].end == p[1].start && p[1].start % a == 0 && !p[0].is_empty()));
        }
    }
}
