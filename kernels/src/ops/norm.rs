//! RMS normalization.

/// `out = x / sqrt(mean(x²) + eps) * weight`, row by row (`weight.len()` values per row).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % d, 0, "rms_norm rows");
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}
