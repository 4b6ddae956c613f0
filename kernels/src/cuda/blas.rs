//! Dense GEMMs through cuBLAS in row-major terms: `y[m, n] = x[m, k] · W[n, k]ᵀ`, the linear
//! layer's orientation (weights as stored in checkpoints, `[out, in]`).
//!
//! cuBLAS is column-major: a row-major `[r, c]` matrix is its column-major `[c, r]` transpose.
//! So `yᵀ (n×m) = W (n×k) · xᵀ (k×m)` in column-major terms: A = W read transposed
//! (`lda = k`), B = x as is (`ldb = k`), C = y (`ldc = n`).

use super::device::CudaDevice;
use super::CudaError;
use cudarc::cublas::{result as blas, sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;
use std::ffi::c_void;

fn dims(m: usize, n: usize, k: usize, x: usize, w: usize, y: usize) -> Result<(i32, i32, i32), CudaError> {
    if x != m * k || w != n * k || y != m * n {
        return Err(CudaError::Shape(format!("gemm [{m}x{k}]·[{n}x{k}]ᵀ: buffers of {x}, {w}, {y} elements")));
    }
    let int = |v: usize| i32::try_from(v).map_err(|_| CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's int")));
    Ok((int(m)?, int(n)?, int(k)?))
}

fn config<T>(m: i32, n: i32, k: i32, alpha: T, beta: T) -> GemmConfig<T> {
    GemmConfig {
        transa: sys::cublasOperation_t::CUBLAS_OP_T,
        transb: sys::cublasOperation_t::CUBLAS_OP_N,
        m: n,
        n: m,
        k,
        alpha,
        lda: k,
        ldb: k,
        beta,
        ldc: n,
    }
}

/// f32 weights and activations (SGEMM, f32 accumulation).
pub fn gemm_f32(dev: &CudaDevice, x: &CudaView<'_, f32>, w: &CudaView<'_, f32>, m: usize, n: usize, k: usize, y: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
    let (mi, ni, ki) = dims(m, n, k, x.len(), w.len(), y.len())?;
    let handle = dev.blas()?;
    // SAFETY: lengths checked against the shape; every buffer lives on the handle's stream.
    unsafe { handle.gemm(config(mi, ni, ki, 1.0f32, 0.0f32), w, x, y) }?;
    Ok(())
}

/// bf16 weights and activations, f32 output and accumulation (`cublasGemmEx`).
pub fn gemm_bf16(dev: &CudaDevice, x: &CudaView<'_, bf16>, w: &CudaView<'_, bf16>, m: usize, n: usize, k: usize, y: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
    let (mi, ni, ki) = dims(m, n, k, x.len(), w.len(), y.len())?;
    let handle: &CudaBlas = dev.blas()?;
    let stream = dev.stream();
    let (alpha, beta) = (1.0f32, 0.0f32);
    let cfg = config(mi, ni, ki, alpha, beta);
    let (wp, _w) = w.device_ptr(stream);
    let (xp, _x) = x.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    // SAFETY: lengths checked; bf16 A/B with f32 C and f32 compute is a supported GemmEx
    // combination; the pointers stay valid while the guards above live.
    unsafe {
        blas::gemm_ex(
            *handle.handle(),
            cfg.transa,
            cfg.transb,
            cfg.m,
            cfg.n,
            cfg.k,
            &alpha as *const f32 as *const c_void,
            wp as *const c_void,
            sys::cudaDataType_t::CUDA_R_16BF,
            cfg.lda,
            xp as *const c_void,
            sys::cudaDataType_t::CUDA_R_16BF,
            cfg.ldb,
            &beta as *const f32 as *const c_void,
            yp as *mut c_void,
            sys::cudaDataType_t::CUDA_R_32F,
            cfg.ldc,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}
