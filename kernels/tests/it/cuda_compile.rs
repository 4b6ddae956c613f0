//! The NVRTC compile gate: every CUDA kernel source (`cuda::source::all()` and the weight
//! formats' `linear::CUDA_SOURCES`), in every specialization, compiles to CUBIN for sm_80, sm_90
//! and sm_90a (sources that need wgmma only for sm_90a), and defines the entry points its
//! launcher loads. Needs NVRTC and the CUDA headers, not a GPU: `scripts/test.sh` installs both (scripts/cuda-env.sh) and sets `TESSERA_REQUIRE_NVRTC=1`, so in CI a missing
//! NVRTC fails this test instead of skipping it.

use tessera_kernels::cuda::compile::{compile_cubin, include_dir};
use tessera_kernels::cuda::{nvrtc_available, source, CudaArch};
use tessera_kernels::linear::CUDA_SOURCES;

pub(crate) fn nvrtc_ready() -> bool {
    let ready = nvrtc_available() && include_dir().is_ok();
    if !ready {
        assert!(
            std::env::var_os("TESSERA_REQUIRE_NVRTC").is_none(),
            "TESSERA_REQUIRE_NVRTC is set but NVRTC or TESSERA_CUDA_INCLUDE is missing (see scripts/cuda-env.sh)"
        );
        eprintln!("skipped: NVRTC or the CUDA headers are not available (run scripts/cuda-env.sh)");
    }
    ready
}

/// Names of the `.entry` symbols in a CUBIN's ELF string tables (kernel names are unmangled).
fn defines_symbol(cubin: &[u8], entry: &str) -> bool {
    let needle = format!("\0{entry}\0");
    cubin.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn every_kernel_source_compiles_for_every_gate_target() {
    if !nvrtc_ready() {
        return;
    }
    let mut compiled = 0;
    // The ops' sources and every weight format's (each format's folder contributes its row).
    for src in source::all().into_iter().chain(CUDA_SOURCES.iter().copied()) {
        for arch in CudaArch::GATE {
            if src.needs_sm90a && !(arch.major == 9 && arch.specific) {
                continue;
            }
            for defines in src.variants {
                let cubin = compile_cubin(src, defines, arch).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(&cubin[..4], b"\x7fELF", "{} for {arch}: not an ELF cubin", src.name);
                for entry in src.entries {
                    assert!(defines_symbol(&cubin, entry), "{} ({arch}, {defines:?}) lacks kernel {entry}", src.name);
                }
                compiled += 1;
            }
        }
    }
    eprintln!("compiled {compiled} (source, specialization, arch) combinations");
}

#[test]
fn a_broken_source_fails_with_nvrtcs_log() {
    if !nvrtc_ready() {
        return;
    }
    static BROKEN: source::KernelSource = source::KernelSource {
        name: "broken.cu",
        code: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        variants: &[&[]],
        entries: &["k"],
        needs_sm90a: false,
    };
    let err = compile_cubin(&BROKEN, &[], CudaArch::GATE[0]).unwrap_err().to_string();
    assert!(err.contains("broken.cu") && err.contains("undefined_name"), "{err}");
}
