//! NVRTC: kernel source to CUBIN for one GPU architecture, with an on-disk cache.
//!
//! CUBIN (not PTX) is what gets loaded: NVRTC runs ptxas itself, so the driver never JIT-compiles
//! and a newer NVRTC cannot emit PTX the driver refuses. The CUDA headers come from the
//! `nvidia-cuda-runtime` wheel (NVRTC ships none): `TESSERA_CUDA_INCLUDE` points at them.

use super::source::{KernelSource, PRELUDE};
use super::CudaError;
use cudarc::nvrtc::{result, sys};
use std::collections::hash_map::DefaultHasher;
use std::ffi::{c_char, CStr, CString};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

/// A compile target, e.g. `sm_90a` (compute capability 9.0 with the arch-specific instructions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaArch {
    /// Compute capability major.
    pub major: u32,
    /// Compute capability minor.
    pub minor: u32,
    /// The `a` suffix: arch-specific features (wgmma on 9.0); such code runs only on that arch.
    pub specific: bool,
}

impl CudaArch {
    /// The targets CI compiles every source for.
    pub const GATE: [CudaArch; 3] = [
        CudaArch { major: 8, minor: 0, specific: false },
        CudaArch { major: 9, minor: 0, specific: false },
        CudaArch { major: 9, minor: 0, specific: true },
    ];

    /// The target for a device of compute capability `major.minor` (9.0 gets `sm_90a`).
    pub fn for_device(major: u32, minor: u32) -> Self {
        CudaArch { major, minor, specific: major == 9 && minor == 0 }
    }
}

impl fmt::Display for CudaArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}{}", self.major, self.minor, if self.specific { "a" } else { "" })
    }
}

/// Whether libnvrtc can be loaded (never panics, unlike the first NVRTC call without it).
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes for the shared library with libloading.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the two out-pointers are valid.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().map_err(|e| nvrtc_error("nvrtcVersion", e))?;
    Ok((major, minor))
}

/// The directory holding `cuda_bf16.h` and friends (`TESSERA_CUDA_INCLUDE`).
pub fn include_dir() -> Result<PathBuf, CudaError> {
    let dir = std::env::var_os("TESSERA_CUDA_INCLUDE").map(PathBuf::from).ok_or(CudaError::NoHeaders)?;
    if dir.join("cuda_bf16.h").is_file() {
        Ok(dir)
    } else {
        Err(CudaError::NoHeaders)
    }
}

/// Compiles `src` with `defines` (`NAME=value`) for `arch` and returns the CUBIN.
pub fn compile_cubin(src: &KernelSource, defines: &[&str], arch: CudaArch) -> Result<Vec<u8>, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let include = include_dir()?;
    let text = CString::new(full_text(src)).expect("kernel sources contain no NUL");
    let name = CString::new(src.name).expect("source names contain no NUL");
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", include.display()),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    options.extend(defines.iter().map(|d| format!("-D{d}")));
    let fail = |log: String| CudaError::Compile {
        source_name: src.name,
        arch: arch.to_string(),
        defines: defines.join(" "),
        log,
    };
    let prog = result::create_program(&text, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: `prog` is live until destroyed below; `text` and `name` outlive it.
    let out = unsafe {
        match result::compile_program(prog, &options) {
            Ok(()) => cubin(prog).map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}"))),
            Err(e) => Err(fail(program_log(prog).unwrap_or_else(|| format!("{e:?}")))),
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// [`compile_cubin`] through the on-disk cache (`TESSERA_CUDA_CACHE`, else `~/.cache/tessera/cuda`),
/// keyed by the source text, defines, target and NVRTC version. A cache that cannot be written
/// only costs a recompile next time.
pub fn cached_cubin(src: &KernelSource, defines: &[&str], arch: CudaArch) -> Result<Vec<u8>, CudaError> {
    let version = nvrtc_version()?;
    let mut h = DefaultHasher::new();
    (full_text(src), defines, arch, version).hash(&mut h);
    let Some(dir) = cache_dir() else { return compile_cubin(src, defines, arch) };
    let path = dir.join(format!("{}-{arch}-{:016x}.cubin", src.name.trim_end_matches(".cu"), h.finish()));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let bytes = compile_cubin(src, defines, arch)?;
    let _ = write_atomically(&path, &bytes);
    Ok(bytes)
}

fn full_text(src: &KernelSource) -> String {
    format!("{PRELUDE}\n#line 1 \"{}\"\n{}", src.name, src.code)
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TESSERA_CUDA_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("tessera").join("cuda"))
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().expect("cache files live in a directory");
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.{}", std::process::id(), path.file_name().unwrap().to_string_lossy()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(tmp, path)
}

/// # Safety
/// `prog` must be a live, successfully compiled program.
unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: per the function's contract.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size).result()? };
    let mut out = vec![0u8; size];
    // SAFETY: `out` holds `size` bytes, as NVRTC asked.
    unsafe { sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char).result()? };
    Ok(out)
}

/// # Safety
/// `prog` must be a live program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> Option<String> {
    // SAFETY: per the function's contract.
    let raw = unsafe { result::get_program_log(prog) }.ok()?;
    // SAFETY: NVRTC NUL-terminates the log it wrote into `raw`.
    let log = unsafe { CStr::from_ptr(raw.as_ptr()) };
    Some(log.to_string_lossy().into_owned())
}

fn nvrtc_error(call: &str, e: result::NvrtcError) -> CudaError {
    CudaError::Compile { source_name: "-", arch: "-".into(), defines: String::new(), log: format!("{call}: {e:?}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        let names: Vec<String> = CudaArch::GATE.iter().map(|a| a.to_string()).collect();
        assert_eq!(names, ["sm_80", "sm_90", "sm_90a"]);
        assert_eq!(CudaArch::for_device(9, 0).to_string(), "sm_90a");
        assert_eq!(CudaArch::for_device(8, 9).to_string(), "sm_89");
    }
}
