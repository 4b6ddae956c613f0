//! The per-token int8 activation path the integer formats share (int4 W4A8, int8 W8A8): each
//! format supplies its scalar reference and its SIMD kernels ([`Int8Rows`]); the shape checks
//! and the choice among its kernels by [`Isa`] or [`GemmLevel`] are here, once.

use super::rowwise::RowKernel;
use crate::cpu::{GemmLevel, Isa};

/// A weight format with kernels over per-token int8 activations: `xq` (`m × cols` int8, one
/// token after another) with one f32 scale per token `xs`, weight rows `r0..r1` into
/// `out[(r - r0) * m + i]`. A format implements its scalar reference and its SIMD kernels;
/// [`Self::rows_int8`] and [`Self::rows_int8_at`] pick among them.
pub trait Int8Rows: RowKernel {
    /// The scalar reference kernel.
    fn rows_int8_scalar(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]);

    /// Whether the SIMD kernels take the activations `xq`; the scalar kernel serves those they
    /// do not. Default: all.
    fn simd_accepts(&self, _xq: &[i8]) -> bool {
        true
    }

    /// The SIMD kernel, bit-identical to the scalar one: AVX2, or with `VNNI` AVX-512 VNNI.
    ///
    /// # Safety
    /// Its level is available here, the shapes are those [`Self::rows_int8_at`] asserts, and
    /// [`Self::simd_accepts`] holds for `xq`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_int8_simd<const VNNI: bool>(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]);

    /// [`Self::rows_int8_scalar`] on `isa`, at the fastest [`GemmLevel`] it allows here.
    ///
    /// # Panics
    /// If `isa` is not available here, or the shapes disagree.
    #[allow(clippy::too_many_arguments)] // row range, activations with scales, output tile
    fn rows_int8(&self, isa: Isa, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        assert!(isa.available(), "{isa:?} kernel requested on a CPU without it");
        self.rows_int8_at(GemmLevel::for_isa(isa), r0, r1, xq, xs, m, out);
    }

    /// [`Self::rows_int8_scalar`] at `level` (the scalar kernel where [`Self::simd_accepts`]
    /// refuses the activations): every level gives the scalar kernel's bits.
    ///
    /// # Panics
    /// If `level` is not available here, or the shapes disagree.
    #[allow(clippy::too_many_arguments)] // row range, activations with scales, output tile
    fn rows_int8_at(&self, level: GemmLevel, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        let rows = RowKernel::rows(self);
        assert!(r0 <= r1 && r1 <= rows, "rows {r0}..{r1} of {rows}");
        assert_eq!(xq.len(), m * RowKernel::cols(self), "activation shape");
        assert_eq!(xs.len(), m, "activation scales");
        assert!(out.len() >= (r1 - r0) * m, "output tile");
        assert!(level.available(), "{level:?} kernel requested on a CPU without it");
        if level == GemmLevel::Scalar || !self.simd_accepts(xq) {
            return self.rows_int8_scalar(r0, r1, xq, xs, m, out);
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's features checked above; shapes asserted above; the kernel takes xq.
        unsafe {
            if level == GemmLevel::Avx512Vnni {
                self.rows_int8_simd::<true>(r0, r1, xq, xs, m, out)
            } else {
                self.rows_int8_simd::<false>(r0, r1, xq, xs, m, out)
            }
        }
    }
}
