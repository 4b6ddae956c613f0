//! f32 row kernels: dot product and axpy, each with a scalar reference and an AVX2 version
//! (tests compare them on random data). The integer kernels of quantized weights live in
//! [`super::interleaved`].

use super::caps::Isa;

/// `Σ a·b` in f32.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    match isa {
        Isa::Scalar => a.iter().zip(b).map(|(x, y)| x * y).sum(),
        Isa::Avx2 => {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2+FMA presence checked above; equal lengths checked above.
            unsafe {
                avx2::f32_dot(a, b)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

/// `y += a · x`.
pub fn axpy_f32(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    match isa {
        Isa::Scalar => y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x),
        Isa::Avx2 => {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2+FMA presence checked above; equal lengths checked above.
            unsafe {
                avx2::f32_axpy(a, x, y)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::hsum;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is within 0..n, checked by the loop bounds.
        unsafe {
            while i + 8 <= n {
                let v = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(y.as_ptr().add(i)));
                _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
                i += 8;
            }
        }
        for j in i..n {
            y[j] += a * x[j];
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load is within 0..n, checked by the loop bounds.
        unsafe {
            while i + 32 <= n {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let o = i + 8 * u;
                    *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut total = hsum(s);
            while i < n {
                total += *pa.add(i) * *pb.add(i);
                i += 1;
            }
            total
        }
    }
}
