//! CUDA backend: kernel sources compiled at run time by NVRTC, launched through `cudarc`.
//!
//! Everything CUDA is loaded dynamically, so this module builds everywhere and costs nothing
//! on machines without a GPU:
//! - [`source`]: the CUDA C sources of the ops that are not weight formats (`kernels/cuda/*.cu`),
//!   each with the specializations it is compiled in, and the [`source::KernelSource`] type the
//!   weight formats declare theirs with (in their folders, `kernels/src/linear/<format>/`);
//! - [`kv_source`]: the paged attention and KV append sources, assembled from the KV format
//!   registry (each format's device code comes from its folder, `kernels/src/kv/<format>/`);
//! - [`compile`]: NVRTC to CUBIN for one architecture, cached on disk;
//! - [`device`]: one GPU (context, stream, loaded modules), opened with a clear error when the
//!   driver or NVRTC is missing;
//! - [`ops`]: typed launchers for each kernel;
//! - [`blas`]: dense f32 / bf16 GEMMs through cuBLAS, row-major;
//! - [`attention`]: paged decode attention and KV append over the engine's KV byte pool;
//! - `linear::cuda` (in the linear module, beside the formats that upload to it): weights in
//!   their storage type, matmul and embedding gather over them, through the `CudaFormat` trait
//!   each format implements in its folder.
//!
//! CI compiles every source ([`source::all`] and `linear::CUDA_SOURCES`) for sm_80, sm_90 and
//! sm_90a (`tests/it/cuda_compile.rs`); the kernel
//! tests (`tests/cuda_*.rs`) run on a GPU and skip, saying so, elsewhere.

pub mod attention;
pub mod blas;
pub mod compile;
pub mod device;
pub mod kv_source;
pub mod ops;
pub mod source;

pub use compile::{nvrtc_available, CudaArch};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
pub use device::{driver_available, test_device, CudaDevice};

/// Why a CUDA operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The NVIDIA driver library (libcuda) is not on this host.
    #[error("CUDA requested but libcuda was not found (no NVIDIA driver on this host); use --device cpu")]
    NoDriver,
    /// cuBLAS (libcublas.so.13) is not loadable.
    #[error("cuBLAS (libcublas.so.13) was not found on LD_LIBRARY_PATH (it ships in the nvidia-cublas wheel)")]
    NoCublas,
    /// NVRTC (libnvrtc.so.13) is not loadable.
    #[error("NVRTC (libnvrtc.so.13) was not found on LD_LIBRARY_PATH; install the pinned wheel with scripts/cuda-env.sh")]
    NoNvrtc,
    /// The CUDA headers NVRTC needs (cuda_bf16.h, cuda_fp8.h) were not found.
    #[error("CUDA headers not found: set TESSERA_CUDA_INCLUDE to the nvidia-cuda-runtime wheel's include directory (scripts/cuda-env.sh prints it)")]
    NoHeaders,
    /// The device ordinal does not exist.
    #[error("CUDA device {ordinal} requested but only {count} present")]
    NoSuchDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices found.
        count: usize,
    },
    /// NVRTC rejected a kernel source; the log says why.
    #[error("NVRTC failed on {source_name} ({arch}, {defines}):\n{log}")]
    Compile {
        /// Kernel source file name.
        source_name: &'static str,
        /// Target architecture.
        arch: String,
        /// The specialization's defines.
        defines: String,
        /// NVRTC's log.
        log: String,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// A feature the CUDA backend does not implement yet (e.g. a compressed KV format).
    #[error("{0}")]
    Unsupported(String),
    /// Arguments that do not fit the kernel (shapes, lengths).
    #[error("{0}")]
    Shape(String),
}
