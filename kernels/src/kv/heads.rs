//! A codec over a contiguous share of another codec's heads: a tensor-parallel rank's part of
//! a layer's KV cache, stored and scored exactly as those heads are in the whole.

use super::{KvCodec, KvPage, KvPageMut};
use std::ops::Range;
use std::sync::Arc;

/// Heads `first..` of `inner`: head `h` of this codec is head `first + h` of `inner`, so any
/// per-head state (random projections, rotations) is the one those heads have in the whole.
pub struct HeadOffset {
    inner: Arc<dyn KvCodec>,
    first: usize,
}

impl HeadOffset {
    /// `inner`'s heads from `first` on.
    pub fn new(inner: Arc<dyn KvCodec>, first: usize) -> Self {
        HeadOffset { inner, first }
    }
}

impl KvCodec for HeadOffset {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn key_calibration(&self) -> super::KeyCalibration {
        self.inner.key_calibration()
    }
    fn head_dim(&self) -> usize {
        self.inner.head_dim()
    }
    fn page_bytes(&self, tokens: usize) -> usize {
        self.inner.page_bytes(tokens)
    }
    fn encode(&self, head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]) {
        self.inner.encode(self.first + head, page, first, rows)
    }
    fn decode(&self, head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]) {
        self.inner.decode(self.first + head, page, slots, out)
    }
    fn query_width(&self) -> usize {
        self.inner.query_width()
    }
    fn prepare_query(&self, head: usize, q: &[f32], out: &mut [f32]) {
        self.inner.prepare_query(self.first + head, q, out)
    }
    fn scores(&self, head: usize, page: KvPage<'_>, slots: Range<usize>, queries: &[f32], out: &mut [f32]) {
        self.inner.scores(self.first + head, page, slots, queries, out)
    }
    fn accumulate(&self, head: usize, page: KvPage<'_>, slots: Range<usize>, weights: &[f32], acc: &mut [f32]) {
        self.inner.accumulate(self.first + head, page, slots, weights, acc)
    }
    fn finish_values(&self, head: usize, rows: &mut [f32]) {
        self.inner.finish_values(self.first + head, rows)
    }
    fn as_f32<'a>(&self, page: KvPage<'a>) -> Option<&'a [f32]> {
        self.inner.as_f32(page)
    }
}
