//! Key centering for the compressed key formats: the mean post-RoPE key of every layer,
//! measured once at load on a built-in text, is subtracted from each key before it is encoded
//! ([`KvLayout::set_key_centers`] says why attention is unchanged by it).

use super::{KvError, KvView, LocalKv, SequenceKv};
use crate::model::{ForwardError, LlamaModel, SeqInput};

/// The calibration text: varied prose, dialogue, numbers and code, so that the mean is not
/// one genre's. It is not taken from the perplexity corpus.
pub const CALIBRATION_TEXT: &str = "\
The harbour was quiet before dawn. Fishing boats rocked against the pier, and a single lamp \
burned in the window of the customs house, where an old clerk counted crates by hand. \
\"Twelve from Lisbon, nine from Bergen,\" he muttered, writing each number in a ledger that had \
outlived three governments. Outside, the tide turned; gulls began to argue over the nets.\n\
In mathematics, a prime number is a natural number greater than 1 that has no divisors other \
than 1 and itself. The first primes are 2, 3, 5, 7, 11 and 13; there are infinitely many, as \
Euclid proved around 300 BC. Their distribution is described by the prime number theorem.\n\
def mean(values):\n    total = sum(values)\n    return total / len(values) if values else 0.0\n\n\
Q: What is the capital of Australia?\nA: Canberra, not Sydney, although Sydney is larger.\n\
To bake bread, mix 500 g of flour with 350 ml of water, 10 g of salt and 7 g of yeast. Knead \
for ten minutes, let the dough rise for an hour, shape it, and bake at 230 degrees Celsius \
for about thirty-five minutes, until the crust sounds hollow when tapped.\n\
The committee met on Tuesday to discuss the budget. After a long debate, members agreed to \
postpone the vote until more data on energy costs, staffing and maintenance were available.";

/// An f32 cache that also sums every key written to it, per layer.
struct KeySums {
    inner: LocalKv,
    sums: Vec<Vec<f64>>,
    rows: Vec<usize>,
}

impl SequenceKv for KeySums {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        self.inner.reserve(n)
    }

    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let sum = &mut self.sums[layer];
        for row in k.chunks_exact(sum.len()) {
            sum.iter_mut().zip(row).for_each(|(s, &x)| *s += f64::from(x));
            self.rows[layer] += 1;
        }
        self.inner.write(layer, pos, k, v);
    }

    fn view(&self, layer: usize, end: usize) -> KvView<'_> {
        self.inner.view(layer, end)
    }

    fn advance(&mut self, n: usize) {
        self.inner.advance(n);
    }

    fn truncate(&mut self, len: usize) {
        self.inner.truncate(len);
    }
}

/// The mean post-RoPE key of every layer (`n_kv_heads * head_dim` values each) over one
/// forward pass of `tokens` with an f32 cache.
pub fn key_means(model: &LlamaModel, tokens: &[u32]) -> Result<Vec<Vec<f32>>, ForwardError> {
    let c = model.config();
    let kw = model.kv_width();
    let mut kv = KeySums { inner: model.local_kv(tokens.len()), sums: vec![vec![0.0; kw]; c.num_layers], rows: vec![0; c.num_layers] };
    model.forward(&mut [SeqInput { tokens, kv: &mut kv, logits_from: None }])?;
    Ok(kv.sums.iter().zip(&kv.rows).map(|(s, &n)| s.iter().map(|x| (x / n.max(1) as f64) as f32).collect()).collect())
}
