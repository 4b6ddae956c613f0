//! `LocalComm::all_reduce_sum` at world size 2, per call: SmolLM2's hidden size (576 floats)
//! for a decode step of 1 and 8 tokens (direct path) and a 512-token prefill (reduce-scatter
//! path). Rank 0 runs on criterion's thread and is timed; rank 1 runs on a helper thread that is
//! told how many calls each timed batch makes, so both ranks always make the same calls and the
//! bench ends cleanly when the command channel closes. Each batch starts with a barrier (not
//! timed), so rank 1's setup is not counted.
//! Run: `cargo bench -p tessera-kernels --bench comm`.

#![allow(missing_docs)] // criterion's macros generate undocumented functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::mpsc;
use std::time::Instant;
use tessera_kernels::comm::{Communicator, LocalComm};

const HIDDEN: usize = 576;

/// Rank 0's data for a call of `len` floats (rank 1 holds its negation).
fn data(len: usize) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(1);
    (0..len).map(|_| r.gen_range(0.5f32..2.0)).collect()
}

fn all_reduce(c: &mut Criterion) {
    let mut ranks = LocalComm::group(2);
    let rank1 = ranks.pop().expect("two ranks");
    let rank0 = ranks.pop().expect("two ranks");
    // (floats per call, calls) for rank 1 to mirror.
    let (tx, rx) = mpsc::channel::<(usize, u64)>();
    std::thread::scope(|s| {
        s.spawn(move || {
            for (len, calls) in rx {
                // Rank 1 holds the negation of rank 0's data: the first sum is exactly zero and
                // stays there, so repeated in-place calls neither overflow nor hit subnormals.
                let mut buf: Vec<f32> = data(len).iter().map(|x| -x).collect();
                rank1.barrier();
                for _ in 0..calls {
                    rank1.all_reduce_sum(&mut buf);
                }
            }
        });
        let mut g = c.benchmark_group("all_reduce_world2");
        g.sample_size(20).measurement_time(std::time::Duration::from_secs(2));
        for (name, tokens) in [("decode", 1usize), ("decode", 8), ("prefill", 512)] {
            let len = HIDDEN * tokens;
            let x = data(len);
            let mut buf = x.clone();
            g.throughput(Throughput::Bytes((len * size_of::<f32>()) as u64));
            g.bench_function(BenchmarkId::new(name, format!("576x{tokens}")), |b| {
                b.iter_custom(|iters| {
                    tx.send((len, iters)).expect("rank 1 is running");
                    buf.copy_from_slice(&x);
                    rank0.barrier();
                    let start = Instant::now();
                    for _ in 0..iters {
                        rank0.all_reduce_sum(&mut buf);
                    }
                    start.elapsed()
                })
            });
        }
        g.finish();
        drop(tx); // rank 1's loop ends
    });
}

criterion_group!(benches, all_reduce);
criterion_main!(benches);
