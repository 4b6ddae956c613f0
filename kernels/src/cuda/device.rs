//! One GPU: its context, the engine's stream and the kernel modules loaded so far.

use super::compile::{cached_cubin, include_dir, nvrtc_available, CudaArch};
use super::source::KernelSource;
use super::CudaError;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Whether the NVIDIA driver library can be loaded (never panics, unlike opening a context
/// without it).
pub fn driver_available() -> bool {
    // SAFETY: only probes for the shared library with libloading.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

type ModuleKey = (&'static str, Vec<&'static str>);

/// An opened GPU with one non-default stream (graph-capturable) and a cache of loaded modules.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: CudaArch,
    name: String,
    total_bytes: usize,
    modules: Mutex<HashMap<ModuleKey, Arc<CudaModule>>>,
    blas: OnceLock<CudaBlas>,
    /// f32 workspace shared by every launch on the stream (stream order makes reuse safe),
    /// grown to the largest request.
    workspace: Mutex<Option<CudaSlice<f32>>>,
}

impl CudaDevice {
    /// Opens device `ordinal`, or says clearly what is missing (driver, NVRTC, headers, device).
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        include_dir()?;
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream does all the work, so cross-stream event tracking only costs launches and
        // breaks graph capture; it must be off before the first allocation.
        // SAFETY: nothing has been allocated on this context by us yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        Ok(Arc::new(CudaDevice {
            arch: CudaArch::for_device(major as u32, minor as u32),
            name: ctx.name()?,
            total_bytes: ctx.total_mem()?,
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            blas: OnceLock::new(),
            workspace: Mutex::new(None),
        }))
    }

    /// The stream every launch of this backend goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context (for events, memory queries).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compile target of this device.
    pub fn arch(&self) -> CudaArch {
        self.arch
    }

    /// `NAME (sm_XY, N GiB)`, for logs.
    pub fn describe(&self) -> String {
        format!("{} ({}, {:.1} GiB)", self.name, self.arch, self.total_bytes as f64 / (1u64 << 30) as f64)
    }

    /// Kernel `entry` of `src` compiled with `defines`, compiling and loading the module on
    /// first use.
    pub fn function(
        &self,
        src: &'static KernelSource,
        defines: &[&'static str],
        entry: &str,
    ) -> Result<CudaFunction, CudaError> {
        let key = (src.name, defines.to_vec());
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            match modules.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let cubin = cached_cubin(src, defines, self.arch)?;
                    let m = self.ctx.load_module(Ptx::from_binary(cubin))?;
                    modules.insert(key, m.clone());
                    m
                }
            }
        };
        Ok(module.load_function(entry)?)
    }

    /// The cuBLAS handle on this device's stream, created on first use (needs libcublas).
    pub fn blas(&self) -> Result<&CudaBlas, CudaError> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        // SAFETY: only probes for the shared library with libloading.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let b = CudaBlas::new(self.stream.clone())?;
        Ok(self.blas.get_or_init(|| b))
    }

    /// Runs `f` with at least `len` floats of the device's shared workspace (its contents are
    /// whatever the last user left). Work queued on the stream by `f` may use it; the next user's
    /// work is queued after it, so the reuse is ordered.
    pub fn with_workspace<R>(&self, len: usize, f: impl FnOnce(&mut CudaSlice<f32>) -> Result<R, CudaError>) -> Result<R, CudaError> {
        let mut guard = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        if guard.as_ref().is_none_or(|w| w.len() < len) {
            *guard = None; // free the old one first
            // SAFETY: the contents are never read before a kernel writes them (callers' contract).
            *guard = Some(unsafe { self.stream.alloc::<f32>(len) }?);
        }
        f(guard.as_mut().expect("allocated above"))
    }

    /// Waits for the stream and surfaces any fault a kernel raised.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()?;
        self.ctx.check_err()?;
        Ok(())
    }
}

/// For GPU tests and benchmarks: device 0, or `None` after printing why it is unavailable
/// (`skipped: ...`), so the caller can return early on machines without a GPU. With
/// `TESSERA_REQUIRE_GPU` set (the GPU machine's run), an unusable device panics instead, so a
/// run there cannot pass by skipping.
pub fn test_device() -> Option<Arc<CudaDevice>> {
    match CudaDevice::open(0) {
        Ok(dev) => Some(dev),
        Err(e) if std::env::var_os("TESSERA_REQUIRE_GPU").is_some() => panic!("TESSERA_REQUIRE_GPU is set but: {e}"),
        Err(e) => {
            eprintln!("skipped: no usable CUDA device ({e})");
            None
        }
    }
}
