//! f32 GEMM over quantized weights: `y[i, j] = Σ_k x[i, k] · W[j, k]`, AVX2 + FMA.
//!
//! Weight rows are dequantized straight into packed, cache-resident slivers of
//! [`NR`] columns (`k × 16` floats, column `c` of step `kk` at `kk * 16 + c`), and a
//! [`MR`] × 16 register-tiled micro-kernel (12 accumulators, two sliver loads and six
//! broadcasts per step) sweeps the activation rows over each group of slivers, so a packed
//! group is reused by every token while it sits in L2.

use crate::cpu::{pool, SyncPtr};
use super::Weight;
use std::arch::x86_64::*;

/// Columns (weight rows) per packed sliver.
pub const NR: usize = 16;
/// Activation rows per micro-tile.
pub const MR: usize = 6;


/// Dequantizes weight rows `r0..r0 + n` (n <= 16) into a zero-padded `k × 16` sliver.
fn pack_sliver(w: &Weight<'_>, r0: usize, n: usize, row: &mut [f32], sliver: &mut [f32]) {
    let k = w.cols();
    for c in 0..NR {
        if c < n {
            w.dequantize_row(r0 + c, row);
            for (kk, &v) in row.iter().enumerate() {
                sliver[kk * NR + c] = v;
            }
        } else {
            for kk in 0..k {
                sliver[kk * NR + c] = 0.0;
            }
        }
    }
}

/// Rows `0..R` of `x` (stride `ldx`) times one sliver, into `ncols <= 16` columns of `y`.
///
/// # Safety
/// AVX2+FMA available; `x` has R rows of `k` floats at stride `ldx`; `b` has `k * 16`
/// floats; `y` has R rows at stride `ldy` with `ncols` writable floats each.
#[target_feature(enable = "avx2,fma")]
unsafe fn micro<const R: usize>(x: *const f32, ldx: usize, b: *const f32, k: usize, y: *mut f32, ldy: usize, ncols: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: bounds as documented.
    unsafe {
        for kk in 0..k {
            let b0 = _mm256_loadu_ps(b.add(kk * NR));
            let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*x.add(r * ldx + kk));
                a[0] = _mm256_fmadd_ps(xv, b0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, b1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let dst = y.add(r * ldy);
            if ncols == NR {
                _mm256_storeu_ps(dst, a[0]);
                _mm256_storeu_ps(dst.add(8), a[1]);
            } else {
                let mut tmp = [0f32; NR];
                _mm256_storeu_ps(tmp.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), a[1]);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, ncols);
            }
        }
    }
}

/// Dispatches the row count of a (possibly partial) micro-tile.
///
/// # Safety
/// As [`micro`], with `rows <= MR`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)] // a BLAS-style micro-kernel signature: pointers, strides, sizes
unsafe fn micro_rows(rows: usize, x: *const f32, ldx: usize, b: *const f32, k: usize, y: *mut f32, ldy: usize, ncols: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        match rows {
            6 => micro::<6>(x, ldx, b, k, y, ldy, ncols),
            5 => micro::<5>(x, ldx, b, k, y, ldy, ncols),
            4 => micro::<4>(x, ldx, b, k, y, ldy, ncols),
            3 => micro::<3>(x, ldx, b, k, y, ldy, ncols),
            2 => micro::<2>(x, ldx, b, k, y, ldy, ncols),
            1 => micro::<1>(x, ldx, b, k, y, ldy, ncols),
            _ => unreachable!("micro-tile of {rows} rows"),
        }
    }
}

/// `y[i * ldy + j] = Σ_k x[i, k] W[j, k]` for `m` rows of `x`.
///
/// # Panics
/// Without AVX2+FMA (callers select this kernel only when present) or on shape mismatch.
pub fn dequant_sgemm(w: &Weight<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    assert!(crate::cpu::Isa::Avx2.available(), "AVX2 GEMM on a CPU without AVX2+FMA");
    let (n_rows, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), m * k);
    assert!(ldy >= n_rows && (m == 0 || y.len() >= (m - 1) * ldy + n_rows));
    let slivers = n_rows.div_ceil(NR);
    // Slivers per task: enough tasks to balance the pool, and a packed group <= 256 KiB (L2).
    let by_cache = ((256 << 10) / (k * NR * 4)).max(1);
    let group = slivers.div_ceil(rayon::current_num_threads() * 4).clamp(1, by_cache);
    let out = SyncPtr::new(y.as_mut_ptr());
    pool::for_each(slivers.div_ceil(group), |t| {
        let (mut row, mut packed) = (vec![0f32; k], vec![0f32; group * k * NR]);
        let s0 = t * group;
        let s1 = (s0 + group).min(slivers);
        for s in s0..s1 {
            let r0 = s * NR;
            let n = NR.min(n_rows - r0);
            pack_sliver(w, r0, n, &mut row, &mut packed[(s - s0) * k * NR..(s - s0 + 1) * k * NR]);
        }
        let mut i0 = 0;
        while i0 < m {
            let rows = MR.min(m - i0);
            for s in s0..s1 {
                let r0 = s * NR;
                let n = NR.min(n_rows - r0);
                // SAFETY: AVX2+FMA asserted; x rows i0..i0+rows exist (k floats each); the
                // sliver holds k*16 floats; y rows i0.. have n writable columns at r0 (checked
                // above), and this task alone writes columns of slivers s0..s1.
                unsafe {
                    micro_rows(
                        rows,
                        x.as_ptr().add(i0 * k),
                        k,
                        packed.as_ptr().add((s - s0) * k * NR),
                        k,
                        out.get().add(i0 * ldy + r0),
                        ldy,
                        n,
                    );
                }
            }
            i0 += rows;
        }
    });
}
