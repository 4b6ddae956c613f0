//! The CUDA C kernel sources and the specializations each is compiled in: the shared prelude,
//! and the sources of the ops that are not weight formats (`kernels/cuda/`; attention and KV
//! append are assembled with the KV formats' device code by [`super::kv_source`]). Each weight
//! format's source lives in its folder (`kernels/src/linear/<format>/`) and is declared there;
//! `linear::CUDA_SOURCES` lists them.

/// Text prepended to every source: fixed-width integer types, fp16/bf16/fp8 headers, reductions.
pub const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// One `.cu` file: its text, the `-D` sets it is compiled with, and the entry points it defines.
#[derive(Debug)]
pub struct KernelSource {
    /// File name (`kernels/cuda/`, or the format's folder under `kernels/src/linear/`), unique
    /// among the sources: it names the source in NVRTC's log, `#line`, the loaded-module table
    /// and the disk cache.
    pub name: &'static str,
    /// CUDA C text (compiled after [`PRELUDE`]).
    pub code: &'static str,
    /// Each specialization's defines (`NAME=value`); one empty set when the source has none.
    pub variants: &'static [&'static [&'static str]],
    /// `extern "C"` kernels the file defines (checked present after compiling).
    pub entries: &'static [&'static str],
    /// Whether the source uses sm_90a-only instructions (wgmma) and is skipped on other targets.
    pub needs_sm90a: bool,
}

/// Norms, RoPE, SwiGLU and greedy argmax over f32 activations.
pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise.cu",
    code: include_str!("../../cuda/elementwise.cu"),
    variants: &[&[]],
    entries: &["rms_norm_residual", "rope_rotate_half", "silu_mul", "argmax_rows"],
    needs_sm90a: false,
};

/// Every kernel source of this module (norms, and attention and KV append as the built-in KV
/// registry assembles them, [`super::kv_source`]), for the compile gate and for ahead-of-time
/// warm-up. The weight formats' sources live in their folders under `kernels/src/linear/` and
/// are listed by `linear::CUDA_SOURCES`.
pub fn all() -> [&'static KernelSource; 3] {
    let kv = super::kv_source::builtin();
    [&ELEMENTWISE, &kv.attention, &kv.kv_append]
}
