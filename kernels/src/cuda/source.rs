//! The CUDA C kernel sources and the specializations each is compiled in: the shared prelude,
//! and the sources of the ops that are not weight formats (`kernels/cuda/`). Each weight
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

/// Paged decode attention over the KV byte pool and its split merge ([`super::attention`]).
/// Specialized by `HEAD_DIM` (64, 128) and the K and V page formats (`K_FMT`, `V_FMT`, the
/// `TS_KV_*` codes each KV format's header declares: `kv/plain/kv_plain.cuh`,
/// `kv/scaled8/kv_scaled8.cuh`, compiled ahead of `kv_pages.cuh`). The gate compiles every format on both sides (the
/// diagonal) plus a few mixed pairs; any other pair compiles on first use from the same code.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention.cu",
    code: concat!(
        include_str!("../kv/plain/kv_plain.cuh"),
        include_str!("../kv/scaled8/kv_scaled8.cuh"),
        include_str!("../../cuda/kv_pages.cuh"),
        include_str!("../../cuda/attention.cu")
    ),
    variants: &[
        &["HEAD_DIM=64", "K_FMT=0", "V_FMT=0"],
        &["HEAD_DIM=64", "K_FMT=1", "V_FMT=1"],
        &["HEAD_DIM=64", "K_FMT=2", "V_FMT=2"],
        &["HEAD_DIM=64", "K_FMT=3", "V_FMT=3"],
        &["HEAD_DIM=64", "K_FMT=4", "V_FMT=4"],
        &["HEAD_DIM=64", "K_FMT=5", "V_FMT=5"],
        &["HEAD_DIM=64", "K_FMT=6", "V_FMT=6"],
        &["HEAD_DIM=64", "K_FMT=3", "V_FMT=1"],
        &["HEAD_DIM=64", "K_FMT=1", "V_FMT=0"],
        &["HEAD_DIM=128", "K_FMT=0", "V_FMT=0"],
        &["HEAD_DIM=128", "K_FMT=1", "V_FMT=1"],
        &["HEAD_DIM=128", "K_FMT=2", "V_FMT=2"],
        &["HEAD_DIM=128", "K_FMT=3", "V_FMT=3"],
        &["HEAD_DIM=128", "K_FMT=4", "V_FMT=4"],
        &["HEAD_DIM=128", "K_FMT=5", "V_FMT=5"],
        &["HEAD_DIM=128", "K_FMT=6", "V_FMT=6"],
        &["HEAD_DIM=128", "K_FMT=3", "V_FMT=1"],
        &["HEAD_DIM=128", "K_FMT=6", "V_FMT=2"],
    ],
    entries: &["paged_decode_attention", "paged_attention_merge"],
    needs_sm90a: false,
};

/// Writes new K/V rows into the paged pool in any supported page format (formats are kernel
/// arguments, so one specialization serves every layer).
pub const KV_APPEND: KernelSource = KernelSource {
    name: "kv_append.cu",
    code: concat!(
        include_str!("../kv/plain/kv_plain.cuh"),
        include_str!("../kv/scaled8/kv_scaled8.cuh"),
        include_str!("../../cuda/kv_pages.cuh"),
        include_str!("../../cuda/kv_append.cu")
    ),
    variants: &[&[]],
    entries: &["kv_append"],
    needs_sm90a: false,
};

/// Every kernel source of this module (norms, attention, KV append), for the compile gate and
/// for ahead-of-time warm-up. The weight formats' sources live in their folders under
/// `kernels/src/linear/` and are listed by `linear::CUDA_SOURCES`.
pub const ALL: &[&KernelSource] = &[&ELEMENTWISE, &ATTENTION, &KV_APPEND];
