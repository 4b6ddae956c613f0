//! Int4 / int8 quantized linear layers (W4A16, W4A8, W8A8 int8): the SIMD kernels (those behind
//! `Isa::Avx2`, and every integer level by name) against the scalar ones and an f64 reference, and batch invariance (a token's result does not depend on
//! the batch, the row range or the task split) on random data. Int4 groups include ragged ones
//! (`group` not dividing `cols`: the last group of a row is short) and groups wider than the row.
//!
//! Tolerances (`eps` = f32 epsilon, `Σ|w·x|` in f64 over the dequantized row and the activations
//! the kernel saw):
//! - integer paths (W4A8, W8A8): integer sums are exact and the AVX2 epilogue repeats the
//!   scalar one operation for operation, so AVX2 == scalar bit for bit. Against f64 the error is
//!   the epilogue's: `(ng + 4)·eps·Σ|w·x̂|` (int32 → f32, one product and one sum per group, the
//!   token scale, and the f32 rounding of the dequantized weights the reference uses).
//! - W4A16: both kernels sum `k` f32 products in different orders (scalar: per group sequentially
//!   then scaled; AVX2: 8 lanes, FMA, per-group scaling), each within `(k + ng + 4)·eps·Σ|w·x|`
//!   of the exact sum; AVX2 vs scalar is held to twice that. With bf16 activations the same
//!   bounds hold over the bf16-rounded activations (the products stay exact; the AVX-512 BF16
//!   kernel sums 16 lanes, two per `vdpbf16ps` step, and scales per group), and the rounding
//!   itself is checked bit for bit against the scalar rule.
//! - W4A16 with int16 activations (per token and weight group): integer group sums are exact
//!   and the AVX2 epilogue repeats the scalar one, so AVX2 == scalar bit for bit; against f64
//!   over the int16-rounded activations, `(ng + 4)·eps·Σ|w·x̂|` as for the int8 paths (per
//!   group the int32 → f32 conversion, the product of the two scales and the fused sum).

use crate::common;

use common::{int4, randn, rng, scale};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tessera_kernels::cpu::GemmLevel;
use tessera_kernels::cpu::{Bf16Products, Isa};
use tessera_kernels::cpu::caps::bf16_dot_available;
use tessera_kernels::linear::act::{
    int16_limit, quantize_int16_block_scalar, quantize_int16_row, quantize_int8_row, quantize_int8_row_scalar, round_bf16_row, round_bf16_scalar,
};
use tessera_kernels::linear::{ActQuant, Int4Matrix, Int8Matrix, Int8Rows, LinearOp, RowKernel, RowwiseLinear};
use std::sync::Arc;

/// A row-kernel matrix behind the trait object the driver takes.
fn rk(m: impl RowKernel) -> Arc<dyn RowKernel> {
    Arc::new(m)
}

const EPS: f64 = f32::EPSILON as f64;

/// Integer-kernel levels this machine runs (the scalar one always), with a note naming the
/// ones it cannot test.
fn int_levels() -> Vec<GemmLevel> {
    let levels: Vec<GemmLevel> = GemmLevel::ALL.into_iter().filter(|l| l.available()).collect();
    if levels.len() < GemmLevel::ALL.len() {
        eprintln!("note: integer levels {:?} are not available on this CPU and were not tested", GemmLevel::ALL.iter().filter(|l| !levels.contains(l)).collect::<Vec<_>>());
    }
    levels
}

/// ISAs this machine runs (the scalar one always).
fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2].into_iter().filter(|i| i.available()).collect()
}

/// ISAs this machine runs for activations `act`: bf16 needs AVX-512 BF16 beyond the scalar
/// kernel (skipped with a note where it is missing).
fn isas_for(act: ActQuant) -> Vec<Isa> {
    if act == ActQuant::Bf16 && !bf16_dot_available() {
        eprintln!("note: AVX-512 BF16 is not available on this CPU; the bf16 W4A16 kernel was not tested");
        return vec![Isa::Scalar];
    }
    isas()
}

/// `x` rounded to bf16 (bit patterns), as the bf16 kernels take it.
fn to_bf16(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| round_bf16_scalar(v)).collect()
}



/// Random int8 matrix (-127..=127).
fn int8(r: &mut ChaCha8Rng, rows: usize, cols: usize) -> Int8Matrix {
    let q = (0..rows * cols).map(|_| r.gen_range(-127..=127)).collect();
    let scales = (0..rows).map(|_| scale(r)).collect();
    Int8Matrix::new(rows, cols, q, scales).unwrap()
}

/// The three schemes on one shape.
#[derive(Clone, Copy, Debug)]
enum Scheme {
    W4A16 { group: usize, asym: bool },
    W4A16Bf16 { group: usize, asym: bool },
    W4A16Int16 { group: usize, asym: bool },
    W4A8 { group: usize, asym: bool },
    W8A8,
}

fn layer(r: &mut ChaCha8Rng, s: Scheme, rows: usize, cols: usize, isa: Isa) -> RowwiseLinear {
    let (w, act) = match s {
        Scheme::W4A16 { group, asym } => (rk(int4(r, rows, cols, group, asym)), ActQuant::F32),
        Scheme::W4A16Bf16 { group, asym } => (rk(int4(r, rows, cols, group, asym)), ActQuant::Bf16),
        Scheme::W4A16Int16 { group, asym } => (rk(int4(r, rows, cols, group, asym)), ActQuant::Int16PerGroup),
        Scheme::W4A8 { group, asym } => (rk(int4(r, rows, cols, group, asym)), ActQuant::Int8PerToken),
        Scheme::W8A8 => (rk(int8(r, rows, cols)), ActQuant::Int8PerToken),
    };
    RowwiseLinear::with_isa(w, act, isa).unwrap()
}

/// The same layer on another ISA.
fn on(l: &RowwiseLinear, isa: Isa) -> RowwiseLinear {
    RowwiseLinear::with_isa(l.matrix().clone(), l.act(), isa).unwrap()
}

/// `y` (m × rows) from `forward`.
fn run(l: &RowwiseLinear, x: &[f32], m: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * l.rows()];
    l.forward(x, m, &mut y, l.rows());
    y
}

/// The activations as the kernel sees them: `x` itself, per token `scale · q` for int8, per
/// token and block of `block` columns `scale · q` for int16.
fn seen(act: ActQuant, x: &[f32], k: usize, block: usize) -> Vec<f64> {
    match act {
        ActQuant::Int16PerGroup => {
            let mut q = vec![0i16; block];
            x.chunks_exact(k)
                .flat_map(|row| row.chunks(block))
                .flat_map(|b| {
                    let (s, _) = quantize_int16_block_scalar(b, int16_limit(block), &mut q[..b.len()]);
                    q[..b.len()].iter().map(|&v| s as f64 * v as f64).collect::<Vec<_>>()
                })
                .collect()
        }
        ActQuant::Int8PerToken => {
            let mut q = vec![0i8; k];
            x.chunks_exact(k)
                .flat_map(|row| {
                    let s = quantize_int8_row(row, &mut q) as f64;
                    q.iter().map(|&v| s * v as f64).collect::<Vec<_>>()
                })
                .collect()
        }
        ActQuant::Bf16 => to_bf16(x).iter().map(|&b| f32::from_bits(u32::from(b) << 16) as f64).collect(),
        _ => x.iter().map(|&v| v as f64).collect(),
    }
}

/// f64 reference `(y, Σ|w·x|)` for each (token, row), over the dequantized rows.
fn reference(l: &RowwiseLinear, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (l.rows(), l.cols());
    let xs = seen(l.act(), x, k, l.matrix().act_block());
    let mut w = vec![0f32; k];
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    for j in 0..n {
        l.dequantize_row(j, &mut w);
        for i in 0..m {
            let xi = &xs[i * k..(i + 1) * k];
            y[i * n + j] = w.iter().zip(xi).map(|(&a, &b)| a as f64 * b).sum();
            mag[i * n + j] = w.iter().zip(xi).map(|(&a, &b)| (a as f64 * b).abs()).sum();
        }
    }
    (y, mag)
}

/// Error bound factor (times `eps · Σ|w·x|`) of one kernel against the exact sum.
fn bound(l: &RowwiseLinear) -> f64 {
    let (k, ng) = match (l.matrix().as_ref() as &dyn std::any::Any).downcast_ref::<Int4Matrix>() {
        Some(w) => (w.cols(), w.groups()),
        None => (l.cols(), 1),
    };
    match l.act() {
        ActQuant::F32 | ActQuant::Bf16 => (k + ng + 4) as f64,
        _ => (ng + 4) as f64,
    }
}

fn assert_within(got: &[f32], want: &[f64], mag: &[f64], factor: f64, what: &str) {
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = factor * EPS * s + 1e-30;
        assert!(g.is_finite() && (g as f64 - w).abs() <= tol, "{what}: element {i}: {g} vs {w} (tol {tol:e}, Σ|wx| {s:e})");
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Shapes (rows, cols) and int4 groups: per channel, 32, 64, 128, 192; SmolLM2's 576/1536;
/// odd row counts leave partial tasks and row tiles. Ragged groups: 576 in 128s (4 x 128 + 64),
/// 320 in 128s (128, 128, 64), 1536 in 640s (640, 640, 256: a group spans more than 8 runs of
/// int16 partial sums), 1120 in 448s (the last group crosses a W4A16 column block); groups wider
/// than the row (one group per row).
const INT4_CASES: &[(usize, usize, usize, bool)] = &[
    (576, 576, 576, false),
    (576, 576, 32, true),
    (192, 576, 64, false),
    (1536, 576, 64, true),
    (576, 1536, 128, true),
    (576, 1536, 1536, true),
    (37, 576, 192, true),
    (37, 1536, 128, false),
    (1536, 576, 128, true),
    (192, 576, 128, false),
    (37, 320, 128, true),
    (96, 320, 128, false),
    (37, 1536, 640, true),
    (29, 1120, 448, false),
    (37, 320, 512, true),
    (40, 576, 1024, false),
];

const INT8_CASES: &[(usize, usize)] = &[(576, 576), (192, 576), (1536, 576), (576, 1536), (37, 576)];

fn all_schemes() -> Vec<(Scheme, usize, usize)> {
    let mut v = Vec::new();
    for &(rows, cols, group, asym) in INT4_CASES {
        v.push((Scheme::W4A16 { group, asym }, rows, cols));
        v.push((Scheme::W4A16Bf16 { group, asym }, rows, cols));
        v.push((Scheme::W4A16Int16 { group, asym }, rows, cols));
        v.push((Scheme::W4A8 { group, asym }, rows, cols));
    }
    for &(rows, cols) in INT8_CASES {
        v.push((Scheme::W8A8, rows, cols));
    }
    v
}

/// Every kernel on every shape is within its bound of the f64 reference, and the AVX2 kernels
/// agree with the scalar ones: bit for bit on the integer paths, within summation order on W4A16.
#[test]
fn kernels_match_f64_reference_and_scalar() {
    let mut r = rng(11);
    // m = 1 takes the one-token paths (eight rows at once), m = 13 the token blocks of 8 and 5.
    for ((scheme, rows, cols), m) in all_schemes().into_iter().flat_map(|c| [(c, 1), (c, 13)]) {
        let scalar = layer(&mut r, scheme, rows, cols, Isa::Scalar);
        let x = randn(&mut r, m * cols);
        let (want, mag) = reference(&scalar, &x, m);
        let ys = run(&scalar, &x, m);
        let what = format!("{scheme:?} {rows}x{cols} m={m}");
        assert_within(&ys, &want, &mag, bound(&scalar), &format!("{what} scalar vs f64"));
        if !isas_for(scalar.act()).contains(&Isa::Avx2) {
            continue;
        }
        let avx = on(&scalar, Isa::Avx2);
        let ya = run(&avx, &x, m);
        assert_within(&ya, &want, &mag, bound(&avx), &format!("{what} avx2 vs f64"));
        match scheme {
            Scheme::W4A16 { .. } | Scheme::W4A16Bf16 { .. } => {
                let ys64: Vec<f64> = ys.iter().map(|&v| v as f64).collect();
                assert_within(&ya, &ys64, &mag, 2.0 * bound(&avx), &format!("{what} avx2 vs scalar"));
            }
            _ => assert_eq!(bits(&ya), bits(&ys), "{what}: avx2 and scalar integer paths differ"),
        }
    }
}

/// Every W4A8 integer level this CPU runs (the other tests reach only the fastest one behind
/// `Isa::Avx2`) gives the scalar kernel's bits on every int4 shape (groups of one run, of odd
/// run counts, ragged and wider than the row), at m = 1, 2, 3, 4, 8 and 13 (every row and
/// token block shape of the kernels) and on a row range that starts and ends inside the
/// matrix. Without AVX-512 VNNI its level is skipped, with a note.
#[test]
fn w4a8_levels_equal_scalar_bits() {
    let mut r = rng(16);
    let levels = int_levels();
    let odd_runs: &[(usize, usize, usize, bool)] = &[(37, 576, 96, true), (29, 544, 160, false), (19, 544, 544, true)];
    for &(rows, cols, group, asym) in INT4_CASES.iter().chain(odd_runs) {
        let w = common::int4(&mut r, rows, cols, group, asym);
        for m in [1usize, 2, 3, 4, 8, 13] {
            let x = randn(&mut r, m * cols);
            let mut xq = vec![0i8; m * cols];
            let xs: Vec<f32> = x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols)).map(|(row, q)| quantize_int8_row(row, q)).collect();
            let (r0, r1) = (rows / 5, rows - rows / 7);
            let mut want = vec![0f32; (r1 - r0) * m];
            w.rows_int8_scalar(r0, r1, &xq, &xs, m, &mut want);
            for &level in &levels {
                let mut got = vec![f32::NAN; (r1 - r0) * m];
                w.rows_int8_at(level, r0, r1, &xq, &xs, m, &mut got);
                assert_eq!(bits(&got), bits(&want), "{level:?} {rows}x{cols}/{group} asym {asym} m={m} rows {r0}..{r1}");
            }
        }
    }
}

/// Every W8A8 int8 level this CPU runs gives the scalar kernel's bits, with weights that
/// include -128, on widths with and without a last odd 32-column run (AVX-512 takes 64
/// columns a step), at m = 1, 2, 3, 8 and 13. Without AVX-512 VNNI its level is skipped,
/// with a note.
#[test]
fn w8a8_levels_equal_scalar_bits() {
    let mut r = rng(17);
    let levels = int_levels();
    for (rows, cols) in [(37, 576), (45, 1536), (19, 544), (16, 32)] {
        let q = (0..rows * cols).map(|_| r.gen_range(-128..=127)).collect();
        let w = Int8Matrix::new(rows, cols, q, (0..rows).map(|_| scale(&mut r)).collect()).unwrap();
        for m in [1usize, 2, 3, 8, 13] {
            let x = randn(&mut r, m * cols);
            let mut xq = vec![0i8; m * cols];
            let xs: Vec<f32> = x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols)).map(|(row, q)| quantize_int8_row(row, q)).collect();
            let mut want = vec![0f32; rows * m];
            w.rows_int8_scalar(0, rows, &xq, &xs, m, &mut want);
            for &level in &levels {
                let mut got = vec![f32::NAN; rows * m];
                w.rows_int8_at(level, 0, rows, &xq, &xs, m, &mut got);
                assert_eq!(bits(&got), bits(&want), "{level:?} {rows}x{cols} m={m}");
            }
        }
    }
}

/// A token's result is bit-identical whatever else is in the batch: `m` tokens at once equal
/// each token alone, for every ISA and scheme.
#[test]
fn batching_never_changes_results() {
    let mut r = rng(12);
    let cases = [
        (Scheme::W4A16 { group: 64, asym: true }, 37, 576),
        (Scheme::W4A16 { group: 1536, asym: false }, 64, 1536),
        (Scheme::W4A16 { group: 128, asym: true }, 45, 1536),
        (Scheme::W4A8 { group: 64, asym: true }, 37, 576),
        (Scheme::W4A8 { group: 576, asym: false }, 40, 576),
        (Scheme::W4A8 { group: 128, asym: true }, 45, 1536),
        // Ragged last groups (576 = 4 x 128 + 64, 320 = 2 x 128 + 64), a last group crossing a
        // W4A16 column block only for wide token blocks (1120 in 448s), a group wider than the row.
        (Scheme::W4A16 { group: 128, asym: true }, 37, 576),
        (Scheme::W4A16 { group: 128, asym: false }, 45, 320),
        (Scheme::W4A16 { group: 448, asym: true }, 29, 1120),
        (Scheme::W4A16 { group: 640, asym: false }, 21, 1536),
        (Scheme::W4A16Bf16 { group: 128, asym: true }, 37, 576),
        (Scheme::W4A16Bf16 { group: 128, asym: false }, 45, 320),
        (Scheme::W4A16Bf16 { group: 32, asym: true }, 64, 1536),
        (Scheme::W4A16Bf16 { group: 640, asym: true }, 21, 1536),
        (Scheme::W4A16Bf16 { group: 1536, asym: true }, 64, 1536),
        (Scheme::W4A16Int16 { group: 128, asym: true }, 37, 576),
        (Scheme::W4A16Int16 { group: 128, asym: false }, 45, 320),
        (Scheme::W4A16Int16 { group: 32, asym: true }, 64, 1536),
        (Scheme::W4A16Int16 { group: 640, asym: true }, 21, 1536),
        (Scheme::W4A16Int16 { group: 1536, asym: false }, 64, 1536),
        (Scheme::W4A8 { group: 128, asym: true }, 37, 576),
        (Scheme::W4A8 { group: 128, asym: false }, 45, 320),
        (Scheme::W4A8 { group: 640, asym: true }, 21, 1536),
        (Scheme::W4A8 { group: 1024, asym: true }, 19, 576),
        (Scheme::W8A8, 37, 576),
        (Scheme::W8A8, 40, 1536),
    ];
    for (scheme, rows, cols) in cases {
        let base = layer(&mut r, scheme, rows, cols, Isa::Scalar);
        let x = randn(&mut r, 100 * cols);
        for isa in isas_for(base.act()) {
            let l = on(&base, isa);
            let alone: Vec<Vec<u32>> = x.chunks_exact(cols).map(|xi| bits(&run(&l, xi, 1))).collect();
            // 17..19 and 64, 100: the W4A16 bf16 panel kernel with every tail of its 4-token tiles.
            for m in [1usize, 2, 3, 5, 8, 13, 17, 18, 19, 64, 100] {
                // A different window of tokens for each m, so tokens sit at different positions.
                let start = (m * 7) % (100 - m + 1);
                let y = run(&l, &x[start * cols..(start + m) * cols], m);
                for (i, yi) in y.chunks_exact(rows).enumerate() {
                    assert_eq!(bits(yi), alone[start + i], "{scheme:?} {rows}x{cols} {isa:?}: token {} of m={m}", start + i);
                }
            }
        }
    }
}

/// A row-range kernel `(r0, r1, out)` over fixed activations.
type RowFn<'a> = Box<dyn Fn(usize, usize, &mut [f32]) + 'a>;

/// Any split of the rows into ranges (the parallel tasks) gives the same bits as one range.
#[test]
fn row_ranges_never_change_results() {
    let mut r = rng(13);
    let (rows, cols) = (37, 576);
    // 13 tokens: the W4A16 bf16 kernel's inline decoding; 19: its panel (a 3-token tail).
    for m in [13usize, 19] {
        let w4 = int4(&mut r, rows, cols, 64, true);
        let w8 = int8(&mut r, rows, cols);
        let x = randn(&mut r, m * cols);
        // Ragged groups: 576 = 4 x 128 + 64.
        let w4r = int4(&mut r, rows, cols, 128, true);
        let mut xq = vec![0i8; m * cols];
        let xs: Vec<f32> = x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols)).map(|(x, q)| quantize_int8_row(x, q)).collect();
        let xb = to_bf16(&x);
        let (x16, x16r) = (int16_act(&x, cols, 64), int16_act(&x, cols, 128));
        let splits: [&[usize]; 4] = [&[0, 37], &[0, 1, 37], &[0, 5, 6, 19, 37], &[0, 8, 16, 24, 32, 37]];
        for isa in isas() {
            let mut kernels: Vec<(&str, RowFn)> = vec![
                ("w4a16", Box::new(|a, b, o: &mut [f32]| w4.rows_f32(isa, a, b, &x, m, o))),
                ("w4a8", Box::new(|a, b, o: &mut [f32]| w4.rows_int8(isa, a, b, &xq, &xs, m, o))),
                ("w4a16 ragged", Box::new(|a, b, o: &mut [f32]| w4r.rows_f32(isa, a, b, &x, m, o))),
                ("w4a8 ragged", Box::new(|a, b, o: &mut [f32]| w4r.rows_int8(isa, a, b, &xq, &xs, m, o))),
                ("w8a8", Box::new(|a, b, o: &mut [f32]| w8.rows_int8(isa, a, b, &xq, &xs, m, o))),
                ("w4a16 int16", Box::new(|a, b, o: &mut [f32]| w4.rows_int16(isa, a, b, &x16.0, &x16.1, &x16.2, m, o))),
                ("w4a16 int16 ragged", Box::new(|a, b, o: &mut [f32]| w4r.rows_int16(isa, a, b, &x16r.0, &x16r.1, &x16r.2, m, o))),
            ];
            if isas_for(ActQuant::Bf16).contains(&isa) {
                kernels.push(("w4a16 bf16", Box::new(|a, b, o: &mut [f32]| w4.rows_bf16(isa, a, b, &xb, m, o))));
                kernels.push(("w4a16 bf16 ragged", Box::new(|a, b, o: &mut [f32]| w4r.rows_bf16(isa, a, b, &xb, m, o))));
            }
            for (name, k) in &kernels {
                let mut whole = vec![0f32; rows * m];
                k(0, rows, &mut whole);
                for split in splits {
                    let mut parts = Vec::new();
                    for ab in split.windows(2) {
                        let mut o = vec![0f32; (ab[1] - ab[0]) * m];
                        k(ab[0], ab[1], &mut o);
                        parts.extend(o);
                    }
                    assert_eq!(bits(&parts), bits(&whole), "{name} {isa:?} split {split:?}");
                }
            }
        }
    }
}

/// Both forms of the W4A16 bf16 panel's products (`vdpbf16ps`, and two FMAs per `vdpbf16ps`
/// on the widened words with denormals flushed) on one machine: with each, every token of `m`
/// equals the token alone (the inline `vdpbf16ps` kernel below 16 tokens, the panel from 16,
/// with every tile tail of both forms), and any row split gives the same bits. Activations are
/// random normals; tiny (`±k·2^-130`, k in 16..=255: normal bf16 values whose partial sums
/// are often subnormal, where `vdpbf16ps` flushes and an unflushed FMA would not); and tiny
/// with a quarter subnormal (which `vdpbf16ps` reads as zero). A form with another order,
/// lane, nibble or flush fails here, and so does one that leaves denormals flushed after it.
/// The FMA form runs where this CPU chooses it (Intel): elsewhere `vdpbf16ps` is not known to
/// round as two FMAs do, and the form is not used.
#[test]
fn bf16_product_forms_agree_bit_for_bit() {
    if !bf16_dot_available() {
        eprintln!("note: AVX-512 BF16 is not available on this CPU; the bf16 product forms were not tested");
        return;
    }
    let forms: &[Bf16Products] = if Bf16Products::detect() == Bf16Products::Fma { &Bf16Products::ALL } else { &[Bf16Products::Dot] };
    if forms.len() < 2 {
        eprintln!("note: this CPU takes vdpbf16ps for prefill; the FMA form was not tested");
    }
    let mut r = rng(19);
    for (rows, cols, group, asym) in [(37usize, 576usize, 128usize, true), (45, 320, 128, false), (64, 1536, 32, true), (21, 1536, 640, true), (64, 1536, 1536, true)] {
        let w = int4(&mut r, rows, cols, group, asym);
        let normal = to_bf16(&randn(&mut r, 40 * cols));
        let tiny: Vec<u16> = (0..40 * cols)
            .map(|_| {
                let v = r.gen_range(16..=255) as f32 * 2f32.powi(-130) * if r.gen() { 1.0 } else { -1.0 };
                (v.to_bits() >> 16) as u16
            })
            .collect();
        // bf16 subnormals: exponent field 0, a nonzero 7-bit mantissa, either sign.
        let subnormal: Vec<u16> = tiny.iter().map(|&b| if r.gen_range(0..4) == 0 { r.gen_range(1..0x80u16) | (b & 0x8000) } else { b }).collect();
        for (name, x) in [("normal", &normal), ("tiny", &tiny), ("subnormal", &subnormal)] {
            for &form in forms {
                let one = |xb: &[u16], m: usize, r0: usize, r1: usize| {
                    let mut o = vec![f32::NAN; (r1 - r0) * m];
                    w.rows_bf16_in(form, Isa::Avx2, r0, r1, xb, m, &mut o);
                    o
                };
                let alone: Vec<Vec<u32>> = x.chunks_exact(cols).map(|xi| bits(&one(xi, 1, 0, rows))).collect();
                for m in [2usize, 3, 13, 16, 17, 18, 19, 20, 40] {
                    let start = (m * 5) % (40 - m + 1);
                    let xm = &x[start * cols..(start + m) * cols];
                    let y = one(xm, m, 0, rows);
                    for i in 0..m {
                        let token: Vec<u32> = (0..rows).map(|row| y[row * m + i].to_bits()).collect();
                        assert_eq!(token, alone[start + i], "{form:?} {name} {rows}x{cols} g{group}: token {} of m={m}", start + i);
                    }
                    let mut split = one(xm, m, 0, 5);
                    split.extend(one(xm, m, 5, rows));
                    assert_eq!(bits(&split), bits(&y), "{form:?} {name} {rows}x{cols} g{group} m={m}: rows split at 5");
                    // Denormals are back: the kernel restored this thread's MXCSR.
                    assert_ne!(std::hint::black_box(f32::MIN_POSITIVE) / 2.0, 0.0, "{form:?}: denormals still flushed after the call");
                }
            }
        }
    }
}

/// `x` (`m × cols`) as int16 codes, scales and code sums per token and block of `block`.
fn int16_act(x: &[f32], cols: usize, block: usize) -> (Vec<i16>, Vec<f32>, Vec<i32>) {
    let (m, nb) = (x.len() / cols, cols.div_ceil(block));
    let (mut q, mut s, mut sums) = (vec![0i16; x.len()], vec![0f32; m * nb], vec![0i32; m * nb]);
    for (((x, q), s), sums) in x.chunks_exact(cols).zip(q.chunks_exact_mut(cols)).zip(s.chunks_exact_mut(nb)).zip(sums.chunks_exact_mut(nb)) {
        quantize_int16_row(x, block, int16_limit(block), q, s, sums);
    }
    (q, s, sums)
}

/// The int16 activation quantizer (the AVX2 version where this CPU has it) gives the scalar
/// version's codes, scales and sums bit for bit: random rows with NaN, ±inf-free outliers, an
/// all-zero block and blocks of 40 values (not a multiple of 16: the AVX2 tail), at the full
/// limit and at the lowered one of wide blocks; every code is within ±limit, the scale
/// `absmax / limit`, each value within half a step of `scale · q` (plus 1e-6 relative for the
/// float quotient), each sum `Σ q`, and some block reaches the limit.
#[test]
fn int16_quantizer_matches_scalar_and_round_trips() {
    let mut r = rng(20);
    assert_eq!(int16_limit(128), 32767);
    assert_eq!(int16_limit(8192), (i32::MAX as usize / (15 * 8192)) as i32);
    for (cols, block) in [(576usize, 128usize), (1536, 1536), (320, 40), (8192, 8192), (1120, 448)] {
        let mut x = randn(&mut r, cols);
        x[3] *= 40.0;
        x[cols - 2] = f32::NAN;
        x[..block.min(40)].fill(0.0);
        let limit = int16_limit(block);
        let nb = cols.div_ceil(block);
        let (mut q, mut s, mut sums) = (vec![0i16; cols], vec![0f32; nb], vec![0i32; nb]);
        quantize_int16_row(&x, block, limit, &mut q, &mut s, &mut sums);
        let mut reached = false;
        for (b, ((xb, qb), (&sb, &sumb))) in x.chunks(block).zip(q.chunks(block)).zip(s.iter().zip(&sums)).enumerate() {
            let mut want = vec![0i16; xb.len()];
            let (ws, wsum) = quantize_int16_block_scalar(xb, limit, &mut want);
            assert_eq!((sb.to_bits(), sumb, qb), (ws.to_bits(), wsum, &want[..]), "{cols}/{block}: block {b}");
            let amax = xb.iter().filter(|v| !v.is_nan()).fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(sb, amax / limit as f32, "{cols}/{block}: block {b} scale");
            assert_eq!(sumb, qb.iter().map(|&v| i32::from(v)).sum::<i32>(), "{cols}/{block}: block {b} sum");
            for (&v, &c) in xb.iter().zip(qb) {
                assert!(i32::from(c).abs() <= limit);
                reached |= i32::from(c).abs() == limit;
                if v.is_nan() {
                    assert_eq!(c, 0, "NaN to 0");
                } else {
                    let back = sb as f64 * c as f64;
                    assert!((back - v as f64).abs() <= 0.5 * sb as f64 + 1e-6 * v.abs() as f64, "{cols}/{block}: {v} -> {c} · {sb}");
                }
            }
        }
        assert!(reached, "{cols}/{block}: no code at the limit");
    }
}

/// The largest int16 sums: a per-channel matrix 8192 wide (the limit lowered to keep the
/// group sum in i32) and one in groups of 128 (the full 32767), every weight 15 from its zero
/// point (`q = 7, z = -8` and `q = -8, z = 7`, also symmetric `q = -8`), activations all
/// equal (every code at the limit): every level gives the scalar bits, which equal the exact
/// product. A kernel whose sums wrapped, or that summed one product in 16 bits, fails.
#[test]
fn int16_largest_sums_are_exact() {
    for (cols, group) in [(8192usize, 8192usize), (1024, 128)] {
        let rows = 48;
        let ng = cols.div_ceil(group);
        let q: Vec<i8> = (0..rows * cols).map(|i| if (i / cols) % 3 == 0 { 7 } else { -8 }).collect();
        let zeros: Vec<i8> = (0..rows * ng).map(|i| match (i / ng) % 3 { 0 => -8, 1 => 7, _ => 0 }).collect();
        let scales = vec![1.0f32; rows * ng];
        let w = Int4Matrix::new(rows, cols, group, &q, scales, Some(zeros)).unwrap();
        for m in [1usize, 2, 4, 5] {
            let x = vec![0.5f32; m * cols];
            let (xq, xs, sums) = int16_act(&x, cols, group);
            let limit = int16_limit(group.min(cols));
            assert!(xq.iter().all(|&c| i32::from(c) == limit));
            let mut want = vec![0f32; rows * m];
            w.rows_int16_scalar(0, rows, &xq, &xs, m, &mut want);
            for (i, &y) in want.iter().enumerate() {
                // Row r: (q - z) = 15, -15 or -8 on every column; every activation 0.5.
                let d = match (i / m) % 3 { 0 => 15.0, 1 => -15.0, _ => -8.0 };
                let exact = d * 0.5 * cols as f64;
                // The integer sum is exact; the f32 epilogue rounds it (up to 2^31, ~8 ulp of
                // 2^24 lost at most: 6e-8 relative) and the scale product and sum once each,
                // so 1e-5 leaves a wide margin, while a wrapped sum would be off by 100%.
                assert!((y as f64 - exact).abs() <= 1e-5 * exact.abs(), "{cols}/{group} m={m}: {y} vs {exact}");
            }
            for isa in isas() {
                let mut got = vec![f32::NAN; rows * m];
                w.rows_int16(isa, 0, rows, &xq, &xs, &sums, m, &mut got);
                assert_eq!(bits(&got), bits(&want), "{cols}/{group} m={m} {isa:?}");
            }
        }
    }
}

/// The largest W4A8 partial sums: every stored code at 15 (`q = 7`) against activations all
/// 127 or all -128, per channel and in groups of 128, at 1, 2, 4 and 8 tokens (each AVX2
/// tile: sixteen rows in pairs, four and two rows in pairs, single rows). The kernels add
/// `vpmaddubsw` products in 16-bit lanes for a few runs before widening; one run too many
/// (with paired rows a lane takes four products per run) wraps, and the result then differs
/// from the scalar kernel's exact sums.
#[test]
fn int8_largest_partial_sums_are_exact() {
    let (rows, cols) = (48usize, 1024usize);
    for group in [cols, 128] {
        let ng = rows * cols.div_ceil(group);
        let w = Int4Matrix::new(rows, cols, group, &vec![7i8; rows * cols], vec![1.0; ng], Some(vec![-8; ng])).unwrap();
        for a in [127i8, -128] {
            for m in [1usize, 2, 4, 8] {
                let (xq, xs) = (vec![a; m * cols], vec![1.0f32; m]);
                let mut want = vec![0f32; rows * m];
                w.rows_int8_scalar(0, rows, &xq, &xs, m, &mut want);
                let exact = 15.0 * f32::from(a) * cols as f32;
                assert!(want.iter().all(|&y| y == exact), "scalar {} vs {exact}", want[0]);
                for level in int_levels() {
                    let mut got = vec![f32::NAN; rows * m];
                    w.rows_int8_at(level, 0, rows, &xq, &xs, m, &mut got);
                    assert_eq!(bits(&got), bits(&want), "group {group} a {a} m={m} {level:?}");
                }
            }
        }
    }
}

/// Act-order layers gather the input columns first: same bits as gathering by hand, and the
/// f64 reference over `RowwiseLinear::dequantize_row` (which undoes the permutation).
#[test]
fn input_permutation_gathers_columns() {
    let mut r = rng(14);
    let (rows, cols, m) = (96, 576, 9);
    for isa in isas() {
        for (scheme, act) in [(true, ActQuant::F32), (true, ActQuant::Int8PerToken), (false, ActQuant::Int8PerToken)] {
            let w = if scheme { rk(int4(&mut r, rows, cols, 64, true)) } else { rk(int8(&mut r, rows, cols)) };
            let mut perm: Vec<u32> = (0..cols as u32).collect();
            perm.shuffle(&mut r);
            let plain = RowwiseLinear::with_isa(w.clone(), act, isa).unwrap();
            let permuted = RowwiseLinear::with_isa(w, act, isa).unwrap().with_input_permutation(perm.clone()).unwrap();
            let x = randn(&mut r, m * cols);
            let gathered: Vec<f32> = x.chunks_exact(cols).flat_map(|row| perm.iter().map(|&c| row[c as usize])).collect();
            let y = run(&permuted, &x, m);
            assert_eq!(bits(&y), bits(&run(&plain, &gathered, m)), "{isa:?} {act:?}");
            let (want, mag) = reference(&permuted, &x, m);
            assert_within(&y, &want, &mag, bound(&permuted), &format!("{isa:?} {act:?} permuted vs f64"));
        }
    }
}

/// Activation rows holding -128 (not produced by the quantizer, but allowed by the row-kernel
/// API) give the scalar result on every ISA.
#[test]
fn int8_rows_accept_minus_128() {
    let mut r = rng(15);
    let (rows, cols, m) = (20, 576, 3);
    let w8 = int8(&mut r, rows, cols);
    let w4 = int4(&mut r, rows, cols, 64, true);
    let xq: Vec<i8> = (0..m * cols).map(|i| if i % 7 == 0 { i8::MIN } else { r.gen() }).collect();
    let xs: Vec<f32> = (0..m).map(|_| r.gen_range(0.001..0.1)).collect();
    let w4r = int4(&mut r, rows, cols, 128, true);
    let mut want = vec![0f32; rows * m];
    for level in int_levels() {
        let mut got = vec![0f32; rows * m];
        w8.rows_int8_scalar(0, rows, &xq, &xs, m, &mut want);
        w8.rows_int8_at(level, 0, rows, &xq, &xs, m, &mut got);
        assert_eq!(bits(&got), bits(&want), "w8a8 {level:?}");
        for (name, w) in [("w4a8", &w4), ("w4a8 ragged", &w4r)] {
            w.rows_int8_scalar(0, rows, &xq, &xs, m, &mut want);
            w.rows_int8_at(level, 0, rows, &xq, &xs, m, &mut got);
            assert_eq!(bits(&got), bits(&want), "{name} {level:?}");
        }
    }
}

/// Extreme int4 codes: every weight -8 or 7 with zero points at both ends, and activations at
/// ±absmax, stress the int16 partial sums (8 runs of 2·15·127) and the offset correction, also
/// with ragged groups (1536 in 640s: 640, 640, 256; in 1024s: 1024, 512).
#[test]
fn int4_extremes_match_scalar() {
    let mut r = rng(16);
    let (rows, cols, m) = (24usize, 1536usize, 4);
    for (group, zero) in [(1536usize, -8i8), (256, 7), (32, -8), (640, 7), (1024, -8)] {
        let q: Vec<i8> = (0..rows * cols).map(|i| if (i / 3) % 2 == 0 { -8 } else { 7 }).collect();
        let ng = rows * cols.div_ceil(group);
        let w = Int4Matrix::new(rows, cols, group, &q, (0..ng).map(|_| scale(&mut r)).collect(), Some(vec![zero; ng])).unwrap();
        let xq: Vec<i8> = (0..m * cols).map(|i| if (i / 5) % 2 == 0 { 127 } else { -127 }).collect();
        let xs = vec![0.01f32; m];
        let mut want = vec![0f32; rows * m];
        w.rows_int8_scalar(0, rows, &xq, &xs, m, &mut want);
        for level in int_levels() {
            let mut got = vec![0f32; rows * m];
            w.rows_int8_at(level, 0, rows, &xq, &xs, m, &mut got);
            assert_eq!(bits(&got), bits(&want), "group {group} zero {zero} {level:?}");
        }
    }
}

/// The dispatched per-token int8 quantizer (AVX2 where available) gives the scalar bytes and
/// scale: random rows of odd lengths, exact rounding ties, NaN, infinities, zeros.
#[test]
fn int8_activation_quantizer_matches_scalar() {
    let mut r = rng(17);
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for len in [1usize, 7, 8, 31, 32, 33, 100, 576, 1536] {
        rows.push(randn(&mut r, len));
        // Multiples of absmax/254 land exactly on .5 steps: ties for round-half-even.
        rows.push((0..len).map(|i| (i as f32 - len as f32 / 2.0) * 0.5).collect());
        rows.push(vec![0.0; len]);
    }
    let mut special = randn(&mut r, 77);
    special[3] = f32::NAN;
    special[40] = -f32::NAN;
    rows.push(special.clone());
    special[10] = f32::INFINITY;
    rows.push(special);
    rows.push(vec![f32::NAN; 40]);
    rows.push((0..64).map(|i| if i % 2 == 0 { -0.0 } else { 1e-30 }).collect());
    for x in rows {
        let (mut a, mut b) = (vec![0i8; x.len()], vec![0i8; x.len()]);
        let sa = quantize_int8_row(&x, &mut a);
        let sb = quantize_int8_row_scalar(&x, &mut b);
        assert_eq!(sa.to_bits(), sb.to_bits(), "scale of {x:?}");
        assert_eq!(a, b, "codes of {x:?}");
    }
}

/// The dispatched bf16 rounding (AVX-512 BF16 where available) gives the scalar rule's bits:
/// random rows of odd lengths, exact ties (even and odd), values that carry into the
/// exponent, subnormals (taken as zero), NaN, infinities and signed zeros; and on normal
/// values the rule is `half`'s round-to-nearest-even.
#[test]
fn bf16_activation_rounding_matches_scalar() {
    let mut r = rng(19);
    let mut rows: Vec<Vec<f32>> = [1usize, 15, 16, 17, 33, 576, 1536].iter().map(|&n| randn(&mut r, n)).collect();
    // Ties: the dropped 16 bits are exactly 0x8000, kept mantissa odd or even; 0x7FFF/0x8001
    // around them; a mantissa of all ones that carries into the exponent.
    rows.push(
        [0x3F80_8000u32, 0x3F81_8000, 0x3F80_7FFF, 0x3F80_8001, 0x3FFF_FFFF, 0x7F7F_FFFF, 0xBF80_8000, 0xBF81_8000]
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect(),
    );
    rows.push(vec![1e-39, -1e-40, f32::from_bits(1), 0.0, -0.0, f32::MIN_POSITIVE, f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.0, -7.5, 1e30, -1e-30, 0.1, 65504.0]);
    for x in &rows {
        let mut got = vec![0u16; x.len()];
        round_bf16_row(x, &mut got);
        assert_eq!(got, to_bf16(x), "{x:?}");
        for (&v, &b) in x.iter().zip(&got) {
            if v.is_normal() {
                assert_eq!(b, half::bf16::from_f32(v).to_bits(), "{v:e}");
            }
        }
    }
    assert_eq!(round_bf16_scalar(1e-39), 0);
    assert_eq!(round_bf16_scalar(-1e-40), 0x8000);
    assert_eq!(round_bf16_scalar(f32::from_bits(0x3F80_8000)), 0x3F80, "tie to even (down)");
    assert_eq!(round_bf16_scalar(f32::from_bits(0x3F81_8000)), 0x3F82, "tie to even (up)");
}

/// The group geometry: `ceil(cols / group)` groups per row with a short last one, one group for
/// `group >= cols`, dequantization by column (`g = c / group`), storage names, and clear errors
/// for group sizes the kernels cannot take.
#[test]
fn int4_ragged_groups_layout_and_errors() {
    let mut r = rng(18);
    for (rows, cols, group, asym) in [(3usize, 576usize, 128usize, true), (2, 320, 128, false), (2, 1536, 640, true), (3, 64, 128, true), (2, 576, 576, false)] {
        let ng = cols.div_ceil(group);
        let q: Vec<i8> = (0..rows * cols).map(|_| r.gen_range(-8..=7)).collect();
        let s: Vec<f32> = (0..rows * ng).map(|_| scale(&mut r)).collect();
        let z: Option<Vec<i8>> = asym.then(|| (0..rows * ng).map(|_| r.gen_range(-8..=7)).collect());
        let w = Int4Matrix::new(rows, cols, group, &q, s.clone(), z.clone()).unwrap();
        assert_eq!((w.group(), w.groups(), w.per_channel()), (group, ng, group >= cols), "{cols}/{group}");
        let mut row = vec![0f32; cols];
        for j in 0..rows {
            assert_eq!(w.row_scales(j).len(), ng);
            w.dequantize_row(j, &mut row);
            for (c, &v) in row.iter().enumerate() {
                let g = j * ng + c / group;
                let zg = z.as_ref().map_or(0, |z| z[g]);
                assert_eq!(v.to_bits(), ((q[j * cols + c] - zg) as f32 * s[g]).to_bits(), "{cols}/{group} row {j} col {c}");
            }
        }
        let storage = rk(w).storage();
        let want = if group >= cols { "channel".to_string() } else { format!("g{group}") };
        assert_eq!(storage, format!("int4 {want} {}", if asym { "asym" } else { "sym" }));
    }
    let q = vec![0i8; 2 * 576];
    let err = |cols: usize, group: usize, n: usize| Int4Matrix::new(2, cols, group, &q[..2 * cols], vec![0.01; n], None).unwrap_err();
    for group in [0usize, 16, 48, 100] {
        let e = err(576, group, 10);
        assert!(e.contains("group") && e.contains(&format!("group {group}")), "group {group}: {e}");
    }
    assert!(err(560, 128, 10).contains("cols 560"), "cols not a multiple of 32");
    // Floor instead of ceil: 2 rows x 4 groups is one group short per row.
    let e = err(576, 128, 8);
    assert!(e.contains("8 scales") && e.contains("2x5"), "{e}");
    let e = Int4Matrix::new(2, 576, 128, &q, vec![0.01; 10], Some(vec![0; 8])).unwrap_err();
    assert!(e.contains("8 zero points") && e.contains("2x5"), "{e}");
}

/// `forward_fused` (Q/K/V, gate/up side by side in one output) gives every layer exactly the
/// bits its own `forward` gives, with the activation quantization shared between int8 layers
/// and not shared with a layer that permutes its input or keeps it in f32.
#[test]
fn fused_layers_equal_each_layer_alone() {
    let mut r = rng(14);
    let cols = 576;
    for (isa, m) in isas().into_iter().flat_map(|isa| [(isa, 0), (isa, 1), (isa, 5)]) {
        let mut perm: Vec<u32> = (0..cols as u32).collect();
        perm.shuffle(&mut r);
        let layers = [
            layer(&mut r, Scheme::W4A8 { group: 576, asym: false }, 64, cols, isa),
            layer(&mut r, Scheme::W8A8, 37, cols, isa),
            layer(&mut r, Scheme::W4A8 { group: 64, asym: true }, 29, cols, isa).with_input_permutation(perm).unwrap(),
            layer(&mut r, Scheme::W4A16 { group: 128, asym: true }, 45, cols, isa),
        ];
        let x = randn(&mut r, m * cols);
        let width: usize = layers.iter().map(RowwiseLinear::rows).sum::<usize>() + 3;
        let mut y = vec![f32::NAN; m * width];
        let mut parts = Vec::new();
        let mut col = 1;
        for l in &layers {
            parts.push((l, col));
            col += l.rows();
        }
        tessera_kernels::linear::rowwise::forward_fused(&parts, &x, m, &mut y, width);
        for (l, col) in parts {
            let alone = run(l, &x, m);
            for i in 0..m {
                let fused = &y[i * width + col..i * width + col + l.rows()];
                assert_eq!(bits(fused), bits(&alone[i * l.rows()..(i + 1) * l.rows()]), "{isa:?} layer at column {col}, token {i}");
            }
        }
        // Columns outside every layer are left alone.
        assert!((0..m).all(|i| y[i * width].is_nan() && y[i * width + width - 1].is_nan() && y[i * width + width - 2].is_nan()));
    }
}

/// Fused layers whose output columns overlap would race: refused.
#[test]
#[should_panic(expected = "overlap")]
fn fused_layers_with_overlapping_outputs_are_refused() {
    let mut r = rng(15);
    let a = layer(&mut r, Scheme::W8A8, 16, 64, Isa::Scalar);
    let b = layer(&mut r, Scheme::W8A8, 16, 64, Isa::Scalar);
    let x = randn(&mut r, 64);
    let mut y = vec![0f32; 40];
    tessera_kernels::linear::rowwise::forward_fused(&[(&a, 0), (&b, 8)], &x, 1, &mut y, 40);
}
