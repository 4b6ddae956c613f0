//! Exact keys kept beside a lossy key format: QJL's attention sink and recent window.
//!
//! A 1-bit key sketch is an unbiased but noisy score; the keys that take most of the attention
//! (the first tokens, the attention sink, and the tokens just before the query) are where that
//! noise costs most. The QJL reference keeps its most recent keys unquantized (its
//! `buffer_size`); Tessera keeps, per sequence, the keys of the first `sink` positions and of
//! the last `window` positions in f32, beside the paged 1-bit pages, and attention scores those
//! exactly ([`ExactKeys`]). The store lives with the sequence's block table (in the
//! [`super::KvCacheManager`], which drops it with the blocks), not in the block pool: the
//! window moves with the sequence, and its size does not grow with the context.
//!
//! Under tensor parallelism each rank keeps the exact keys of its own KV heads
//! ([`ExactKeyPart`], scored and written by that rank's thread alone); a sequence's
//! [`ExactKeyStore`] holds one part per rank (one part without it).
//!
//! With prefix caching, the sink's keys travel with the first cached block ([`SinkKeys`]),
//! and a hit leaves at least `window` prompt tokens to compute, so the last prompt token and
//! every generated one find their whole window here. The first `window - 1` recomputed
//! positions score the cached positions before them through the codec, so a hit's output can
//! differ slightly from the same request computed without one.

use super::KvLayout;
use std::sync::Arc;
use tessera_kernels::attention::ExactKeys;

/// The sink's exact keys of every layer and KV head (`[layer][head]`, rows of `head_dim`),
/// shared with the prefix-cache entry of a sequence's first block.
pub type SinkKeys = Arc<[Vec<Vec<f32>>]>;

/// One layer's exact keys, per KV head.
#[derive(Clone, Debug, Default)]
struct LayerKeys {
    /// Keys of positions `0..` (at most `sink` rows).
    sink: Vec<Vec<f32>>,
    /// Keys of positions `recent_start..`.
    recent: Vec<Vec<f32>>,
    recent_start: usize,
}

/// One sequence's exact keys, every layer, each tensor-parallel rank's in a part of its own.
#[derive(Clone, Debug)]
pub struct ExactKeyStore {
    parts: Vec<ExactKeyPart>,
}

impl ExactKeyStore {
    /// A store of one part per tensor-parallel rank (one layout without it), each for its
    /// rank's layout (its KV heads), when their key format keeps keys exactly (`qjl1` with a
    /// window or a sink, HQMQ with a sink); `None` otherwise.
    pub fn for_layouts<'a>(layouts: impl IntoIterator<Item = &'a KvLayout>) -> Option<Self> {
        let parts: Vec<ExactKeyPart> = layouts.into_iter().map(ExactKeyPart::for_layout).collect::<Option<_>>()?;
        (!parts.is_empty()).then_some(ExactKeyStore { parts })
    }

    /// Sink positions kept.
    pub fn sink(&self) -> usize {
        self.parts[0].sink
    }

    /// The recent window's length.
    pub fn window(&self) -> usize {
        self.parts[0].window
    }

    /// The parts, one per rank, for the ranks' threads to take one each.
    pub fn parts_mut(&mut self) -> &mut [ExactKeyPart] {
        &mut self.parts
    }

    /// The one part of a store without tensor parallelism.
    ///
    /// # Panics
    /// If the store has a part per rank of several.
    pub fn only_part(&mut self) -> &mut ExactKeyPart {
        assert_eq!(self.parts.len(), 1, "exact keys of several ranks read as one");
        &mut self.parts[0]
    }

    /// The sink's keys, once every sink position is recorded in every part (for the prefix
    /// cache): per layer, the parts' KV heads in rank order.
    pub fn sink_keys(&self) -> Option<SinkKeys> {
        let p0 = &self.parts[0];
        let full = p0.sink > 0 && self.parts.iter().all(|p| p.layers.iter().all(|l| l.sink.iter().all(|s| s.len() == p.sink * p.head_dim)));
        full.then(|| (0..p0.layers.len()).map(|l| self.parts.iter().flat_map(|p| p.layers[l].sink.iter().cloned()).collect()).collect())
    }

    /// Takes the sink's keys from a prefix-cache hit (the sequence does not compute them),
    /// each part its own KV heads' ([`ExactKeyStore::sink_keys`]'s order).
    pub fn restore_sink(&mut self, keys: &SinkKeys) {
        assert_eq!(keys.len(), self.parts[0].layers.len(), "sink keys: one entry per layer");
        for (l, k) in keys.iter().enumerate() {
            let heads: usize = self.parts.iter().map(|p| p.layers[l].sink.len()).sum();
            assert_eq!(k.len(), heads, "sink keys: one entry per KV head");
            let mut rest = &k[..];
            for p in &mut self.parts {
                let (mine, more) = rest.split_at(p.layers[l].sink.len());
                p.layers[l].sink.clone_from_slice(mine);
                rest = more;
            }
        }
    }
}

/// One rank's exact keys of a sequence (all of them without tensor parallelism): every layer,
/// the rank's KV heads (see the module docs).
#[derive(Clone, Debug)]
pub struct ExactKeyPart {
    head_dim: usize,
    sink: usize,
    window: usize,
    layers: Vec<LayerKeys>,
}

impl ExactKeyPart {
    /// A part for `layout`'s key format and KV heads, when it keeps keys exactly; `None`
    /// otherwise.
    pub fn for_layout(layout: &KvLayout) -> Option<Self> {
        let p = layout.dtype().k.exact_keys()?;
        if p.window == 0 && p.sink == 0 {
            return None;
        }
        let g = layout.geometry();
        let layer = LayerKeys { sink: vec![Vec::new(); g.n_kv_heads], recent: vec![Vec::new(); g.n_kv_heads], recent_start: 0 };
        let sink = usize::from(p.sink);
        assert!(sink <= layout.block_size(), "the layout refuses a sink longer than a block");
        Some(ExactKeyPart { head_dim: g.head_dim, sink, window: p.window.into(), layers: vec![layer; layout.layers()] })
    }

    /// Records layer `layer`'s keys of positions `pos..` (`rows`: tokens × `n_kv_heads *
    /// head_dim`, as the codec stores them). Writing at a position before what is kept
    /// forgets the later rows (a truncated sequence rewrites them); a gap after the recent
    /// rows restarts them at `pos`.
    pub fn write(&mut self, layer: usize, pos: usize, rows: &[f32]) {
        let (hd, sink_cap, window) = (self.head_dim, self.sink, self.window);
        let l = &mut self.layers[layer];
        let heads = l.sink.len();
        let kw = hd * heads;
        assert!(rows.len().is_multiple_of(kw), "exact keys: whole rows");
        let n = rows.len() / kw;
        let head_rows = |g: usize, t: std::ops::Range<usize>| t.flat_map(move |t| &rows[t * kw + g * hd..t * kw + (g + 1) * hd]);
        // The sink: contiguous from position 0.
        for (g, sink) in l.sink.iter_mut().enumerate() {
            let have = sink.len() / hd;
            if pos <= have && pos < sink_cap {
                sink.truncate(pos * hd);
                sink.extend(head_rows(g, 0..n.min(sink_cap - pos)));
            }
        }
        if window == 0 {
            return;
        }
        let end = l.recent_start + l.recent[0].len() / hd;
        if pos < l.recent_start || pos > end {
            l.recent_start = pos;
            l.recent.iter_mut().for_each(Vec::clear);
        }
        let keep = (pos - l.recent_start) * hd;
        for (g, recent) in l.recent.iter_mut().enumerate() {
            recent.truncate(keep);
            recent.extend(head_rows(g, 0..n));
        }
    }

    /// Layer `layer`'s exact keys as attention reads them.
    pub fn view(&self, layer: usize) -> ExactKeys<'_> {
        let l = &self.layers[layer];
        ExactKeys { window: self.window, sink: &l.sink, recent: &l.recent, recent_start: l.recent_start }
    }

    /// The sequence now holds `len` tokens: forgets recent rows that no query at `len` or
    /// later needs, once they amount to [`stale_rows`] (so the copy is amortized), and gives
    /// back what a prefill chunk grew the rows to.
    pub fn advance(&mut self, len: usize) {
        let (hd, window) = (self.head_dim, self.window);
        let keep_from = (len + 1).saturating_sub(window);
        for l in &mut self.layers {
            let stale = keep_from.saturating_sub(l.recent_start).min(l.recent[0].len() / hd);
            if stale >= stale_rows(window) {
                for r in &mut l.recent {
                    r.drain(..stale * hd);
                    if r.capacity() > 2 * max_rows(window, 0) * hd {
                        r.shrink_to(max_rows(window, 0) * hd);
                    }
                }
                l.recent_start += stale;
            }
        }
    }

    /// Forgets the keys of positions `len..` (the sequence was cut back to `len` tokens).
    pub fn truncate(&mut self, len: usize) {
        let hd = self.head_dim;
        for l in &mut self.layers {
            l.sink.iter_mut().for_each(|s| s.truncate(s.len().min(len * hd)));
            let keep = len.saturating_sub(l.recent_start) * hd;
            l.recent.iter_mut().for_each(|r| r.truncate(r.len().min(keep)));
        }
    }

}

/// Stale recent rows that [`ExactKeyPart::advance`] lets gather before it drops them.
fn stale_rows(window: usize) -> usize {
    (window / 4).max(16)
}

/// The most rows a store keeps per (layer, KV head) between steps, for a window of `window`
/// and a sink of `sink` (a prefill chunk's rows come on top while it runs).
pub fn max_rows(window: usize, sink: usize) -> usize {
    let recent = if window == 0 { 0 } else { window - 1 + stale_rows(window) };
    recent + sink
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvDtype;
    use tessera_kernels::kv::{KvFormat, KvGeometry};

    fn store(window: u16, sink: u16) -> ExactKeyStore {
        let dtype = KvDtype { k: format!("qjl1-w{window}-s{sink}").parse().unwrap(), v: KvFormat::BF16 };
        let layout = KvLayout::new(2, KvGeometry { head_dim: 4, n_kv_heads: 2 }, 4, dtype, None, 1).unwrap();
        ExactKeyStore::for_layouts([&*layout]).unwrap()
    }

    /// Rows for positions `pos..pos + n`: head g's value d of position t is `1000 t + 10 g + d`.
    fn rows(pos: usize, n: usize) -> Vec<f32> {
        (pos..pos + n).flat_map(|t| (0..2).flat_map(move |g| (0..4).map(move |d| (1000 * t + 10 * g + d) as f32))).collect()
    }

    fn positions(v: &[f32]) -> Vec<usize> {
        v.chunks_exact(4).map(|r| r[0] as usize / 1000).collect()
    }

    #[test]
    fn keeps_the_sink_and_the_window_the_next_queries_need() {
        let mut s = store(8, 2);
        s.only_part().write(1, 0, &rows(0, 5));
        s.only_part().advance(5);
        for t in 5..40 {
            s.only_part().write(1, t, &rows(t, 1));
            s.only_part().advance(t + 1);
            let v = s.only_part().view(1);
            assert_eq!(positions(&v.sink[1]), vec![0, 1]);
            let recent = positions(&v.recent[1]);
            // Every key the next query (at t + 1) scores exactly is here, in order...
            assert!(v.recent_start <= (t + 2).saturating_sub(8) && recent.last() == Some(&t), "{t}: {recent:?}");
            assert_eq!(recent, (v.recent_start..=t).collect::<Vec<_>>());
            // ...and what is kept stays bounded.
            assert!(recent.len() + v.sink[1].len() / 4 <= max_rows(8, 2), "{t}: {}", recent.len());
            // Head 1's own values, not head 0's.
            let last = &v.recent[1][v.recent[1].len() - 4..];
            assert_eq!(last, (0..4).map(|d| (1000 * t + 10 + d) as f32).collect::<Vec<_>>());
        }
        // A long prefill chunk's memory goes back once the window has moved past it.
        s.only_part().write(1, 40, &rows(40, 200));
        s.only_part().advance(240);
        assert!(s.only_part().view(1).recent[0].capacity() <= 2 * max_rows(8, 0) * 4, "{}", s.only_part().view(1).recent[0].capacity());
        // Layer 0 was never written.
        assert!(s.only_part().view(0).recent[0].is_empty() && s.sink_keys().is_none());
    }

    #[test]
    fn rewrites_truncate_and_gaps_restart() {
        let mut s = store(8, 4);
        for layer in 0..2 {
            s.only_part().write(layer, 0, &rows(0, 10));
        }
        let sink = s.sink_keys().expect("sink complete");
        // Rewriting from position 2 forgets positions 2.. in both runs.
        s.only_part().write(0, 2, &rows(2, 1));
        assert_eq!(positions(&s.only_part().view(0).sink[0]), vec![0, 1, 2]);
        assert_eq!(positions(&s.only_part().view(0).recent[0]), vec![0, 1, 2]);
        // Truncating forgets the later positions of every layer.
        s.only_part().truncate(7);
        assert_eq!((positions(&s.only_part().view(1).sink[0]), positions(&s.only_part().view(1).recent[1]).len()), (vec![0, 1, 2, 3], 7));
        // A prefix hit of 12 positions on a new store: the sink comes from the cache, the window
        // starts at 12.
        let mut s = store(8, 4);
        s.restore_sink(&sink);
        s.only_part().write(0, 12, &rows(12, 3));
        let v = s.only_part().view(0);
        assert_eq!((positions(&v.sink[1]), v.recent_start, positions(&v.recent[1])), (vec![0, 1, 2, 3], 12, vec![12, 13, 14]));
    }

    #[test]
    fn pure_one_bit_keys_keep_nothing() {
        let dtype = KvDtype { k: "qjl1-w0-s0".parse().unwrap(), v: KvFormat::BF16 };
        let layout = KvLayout::new(1, KvGeometry { head_dim: 4, n_kv_heads: 1 }, 4, dtype, None, 1).unwrap();
        assert!(ExactKeyStore::for_layouts([&*layout]).is_none());
        assert!(ExactKeyPart::for_layout(&layout).is_none());
        let mut s = store(0, 3);
        s.only_part().write(0, 0, &rows(0, 6));
        assert_eq!((positions(&s.only_part().view(0).sink[0]), s.only_part().view(0).recent[0].len()), (vec![0, 1, 2], 0));
    }

    /// Under tensor parallelism each rank's part keeps its own KV heads; the prefix cache's
    /// sink keys hold every rank's heads in rank order and go back to the same parts.
    #[test]
    fn a_part_per_rank_and_the_sink_across_them() {
        let dtype = KvDtype { k: "qjl1-w8-s2".parse().unwrap(), v: KvFormat::BF16 };
        // Two ranks of one KV head each (the layouts' heads are the ranks').
        let rank = KvLayout::new(2, KvGeometry { head_dim: 4, n_kv_heads: 1 }, 4, dtype, None, 1).unwrap();
        let mut s = ExactKeyStore::for_layouts([&*rank, &*rank]).unwrap();
        // Rank r's rows are head r's of `rows` (each rank computes its own heads).
        let rank_rows = |r: usize, pos: usize, n: usize| -> Vec<f32> { rows(pos, n).chunks_exact(8).flat_map(|t| t[4 * r..4 * r + 4].to_vec()).collect() };
        for (r, p) in s.parts_mut().iter_mut().enumerate() {
            for layer in 0..2 {
                assert!(p.view(layer).sink[0].is_empty());
                p.write(layer, 0, &rank_rows(r, 0, if r == 0 { 3 } else { 1 }));
            }
        }
        // Rank 1 holds one of the two sink positions: not yet complete.
        assert!(s.sink_keys().is_none());
        s.parts_mut()[1].write(0, 1, &rank_rows(1, 1, 2));
        s.parts_mut()[1].write(1, 1, &rank_rows(1, 1, 2));
        let sink = s.sink_keys().expect("every rank's sink complete");
        assert_eq!(sink[1].len(), 2);
        let mut hit = ExactKeyStore::for_layouts([&*rank, &*rank]).unwrap();
        hit.restore_sink(&sink);
        for (r, p) in hit.parts_mut().iter_mut().enumerate() {
            let v = p.view(1);
            assert_eq!(positions(&v.sink[0]), vec![0, 1]);
            // Rank r's own head: values 10 r + d.
            assert_eq!(v.sink[0][..4], (0..4).map(|d| (10 * r + d) as f32).collect::<Vec<_>>()[..]);
        }
    }
}
