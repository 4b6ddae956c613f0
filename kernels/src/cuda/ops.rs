//! Typed launchers: each checks buffer lengths against the shape, then launches on the device's
//! stream. Launches are asynchronous; [`CudaDevice::synchronize`] surfaces kernel faults.

use super::device::CudaDevice;
use super::source::ELEMENTWISE;
use super::CudaError;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

fn check(what: &str, len: usize, want: usize) -> Result<(), CudaError> {
    if len == want {
        Ok(())
    } else {
        Err(CudaError::Shape(format!("{what}: {len} elements, expected {want}")))
    }
}

fn rows_config(rows: usize, threads: u32) -> Result<LaunchConfig, CudaError> {
    let rows = u32::try_from(rows).map_err(|_| CudaError::Shape(format!("{rows} rows exceed the grid")))?;
    Ok(LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{v} does not fit a 32-bit kernel argument")))
}

/// Row-wise RMSNorm of `x` (`rows × weight.len()`) into `out`; with `residual`, first
/// `x += residual` (the new residual stream stays in `x`).
pub fn rms_norm(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    residual: Option<&CudaSlice<f32>>,
    weight: &CudaSlice<f32>,
    eps: f32,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let d = weight.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(CudaError::Shape(format!("rms_norm: {} values are not rows of {d}", x.len())));
    }
    check("rms_norm out", out.len(), x.len())?;
    if let Some(r) = residual {
        check("rms_norm residual", r.len(), x.len())?;
    }
    let f = dev.function(&ELEMENTWISE, &[], "rms_norm_residual")?;
    let cfg = rows_config(x.len() / d, 256)?;
    let d = int(d)?;
    let null = 0u64;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(x);
    match residual {
        Some(r) => b.arg(r),
        None => b.arg(&null),
    };
    b.arg(weight).arg(out).arg(&d).arg(&eps);
    // SAFETY: argument types and order match `rms_norm_residual`; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Rotates the first `2 * half` dims of every head of `x` (`tokens × heads·head_dim`), HF
/// rotate-half pairs, by `sin_cos` (`tokens × half` pairs of `(sin, cos)` as f32).
pub fn rope(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    sin_cos: &CudaSlice<f32>,
    heads: usize,
    head_dim: usize,
    half: usize,
) -> Result<(), CudaError> {
    let row = heads * head_dim;
    if row == 0 || !x.len().is_multiple_of(row) || 2 * half > head_dim {
        return Err(CudaError::Shape(format!("rope: {} values, {heads} heads of {head_dim}, half {half}", x.len())));
    }
    let tokens = x.len() / row;
    check("rope sin_cos", sin_cos.len(), tokens * half * 2)?;
    let f = dev.function(&ELEMENTWISE, &[], "rope_rotate_half")?;
    let cfg = rows_config(tokens, 128)?;
    let (heads, head_dim, half) = (int(heads)?, int(head_dim)?, int(half)?);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(x).arg(sin_cos).arg(&heads).arg(&head_dim).arg(&half);
    // SAFETY: argument types and order match `rope_rotate_half` (float2 = two f32); lengths checked.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// SwiGLU: rows of `gate_up` (`2n` wide) to rows of `out` (`n` wide).
pub fn silu_mul(dev: &CudaDevice, gate_up: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
    if n == 0 || !out.len().is_multiple_of(n) {
        return Err(CudaError::Shape(format!("silu_mul: {} outputs are not rows of {n}", out.len())));
    }
    check("silu_mul gate_up", gate_up.len(), 2 * out.len())?;
    let f = dev.function(&ELEMENTWISE, &[], "silu_mul")?;
    let cfg = rows_config(out.len() / n, 256)?;
    let n = int(n)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(gate_up).arg(out).arg(&n);
    // SAFETY: argument types and order match `silu_mul`; lengths checked.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Greedy token per row of `logits` (`rows × n`), lowest index on ties.
pub fn argmax_rows(dev: &CudaDevice, logits: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<i32>) -> Result<(), CudaError> {
    check("argmax logits", logits.len(), out.len() * n)?;
    let f = dev.function(&ELEMENTWISE, &[], "argmax_rows")?;
    let cfg = rows_config(out.len(), 1024)?;
    let n = int(n)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(logits).arg(&n).arg(out);
    // SAFETY: argument types and order match `argmax_rows` (1024 threads = its shared arrays).
    unsafe { b.launch(cfg) }?;
    Ok(())
}
