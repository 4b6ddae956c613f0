//! The CUDA C kernel sources and the specializations each is compiled in.

/// Text prepended to every source: fixed-width integer types, fp16/bf16/fp8 headers, reductions.
pub const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// One `.cu` file: its text, the `-D` sets it is compiled with, and the entry points it defines.
#[derive(Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/`.
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

/// Every kernel source, for the compile gate and for ahead-of-time warm-up.
pub const ALL: &[&KernelSource] = &[&ELEMENTWISE];
