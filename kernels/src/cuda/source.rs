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

/// Paged decode attention over the KV byte pool and its split merge ([`super::attention`]).
/// Specialized by `HEAD_DIM` (64, 128) and the K and V page formats (`K_FMT`, `V_FMT`, the
/// `TS_KV_*` codes of `kv_pages.cuh`). The gate compiles every format on both sides (the
/// diagonal) plus a few mixed pairs; any other pair compiles on first use from the same code.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention.cu",
    code: concat!(include_str!("../../cuda/kv_pages.cuh"), include_str!("../../cuda/attention.cu")),
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
    code: concat!(include_str!("../../cuda/kv_pages.cuh"), include_str!("../../cuda/kv_append.cu")),
    variants: &[&[]],
    entries: &["kv_append"],
    needs_sm90a: false,
};

/// Every kernel source, for the compile gate and for ahead-of-time warm-up.
pub const ALL: &[&KernelSource] = &[&ELEMENTWISE, &ATTENTION, &KV_APPEND, &LINEAR_GGML, &LINEAR_INT4, &LINEAR_A8];

/// Matmul and embedding lookup over GGML-typed weights ([`super::linear`]), one variant per
/// weight type (`WTYPE`: 0 F32, 1 F16, 2 BF16, 3 Q4_0, 4 Q4_1, 5 Q8_0).
pub const LINEAR_GGML: KernelSource = KernelSource {
    name: "linear_ggml.cu",
    code: include_str!("../../cuda/linear_ggml.cu"),
    variants: &[&["WTYPE=0"], &["WTYPE=1"], &["WTYPE=2"], &["WTYPE=3"], &["WTYPE=4"], &["WTYPE=5"]],
    entries: &["ggml_matmul", "ggml_embedding"],
    needs_sm90a: false,
};

/// W4A16 matmul over Tessera's int4 layout with group scales and optional zero points
/// ([`super::linear`]).
pub const LINEAR_INT4: KernelSource = KernelSource {
    name: "linear_int4.cu",
    code: include_str!("../../cuda/linear_int4.cu"),
    variants: &[&[]],
    entries: &["int4_matmul"],
    needs_sm90a: false,
};

/// Per-token int8 activation quantization and the W4A8 / W8A8 int8 matmuls (dp4a, int32 sums)
/// that use it ([`super::linear`]), bit-identical to the CPU kernels.
pub const LINEAR_A8: KernelSource = KernelSource {
    name: "linear_a8.cu",
    code: include_str!("../../cuda/linear_a8.cu"),
    variants: &[&[]],
    entries: &["quantize_int8_rows", "int4_a8_matmul", "int8_a8_matmul"],
    needs_sm90a: false,
};
