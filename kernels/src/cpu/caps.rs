//! Run-time CPU feature detection.

use std::fmt;

/// The instruction-set level a CPU kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust; the reference every SIMD path is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
}

impl Isa {
    /// Short name used in kernel ids.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
        }
    }

    /// Whether this machine can run kernels of this level (cheap: std caches the CPUID bits).
    #[inline]
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 => false,
        }
    }
}

/// What the CPU offers, as detected at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuCaps {
    /// AVX2, FMA and F16C (every AVX2 CPU has F16C).
    pub avx2_fma: bool,
    /// AVX-512 foundation + byte/word.
    pub avx512bw: bool,
    /// AVX-512 VNNI.
    pub avx512vnni: bool,
    /// AVX-512 BF16 dot products (with F/BW/VL and the AVX2 set): [`bf16_dot_available`].
    pub avx512bf16: bool,
    /// Worker threads available to kernels.
    pub threads: usize,
}

impl CpuCaps {
    /// Detects the running CPU.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        let (avx2_fma, avx512bw, avx512vnni) = (
            Isa::Avx2.available(),
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"),
            is_x86_feature_detected!("avx512vnni"),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2_fma, avx512bw, avx512vnni) = (false, false, false);
        CpuCaps { avx2_fma, avx512bw, avx512vnni, avx512bf16: bf16_dot_available(), threads: rayon::current_num_threads() }
    }

    /// The best ISA level Tessera has kernels for on this CPU.
    pub fn best_isa(&self) -> Isa {
        if self.avx2_fma {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }
}

impl fmt::Display for CpuCaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "avx2+fma={} avx512bw={} avx512vnni={} avx512bf16={} threads={}",
            self.avx2_fma, self.avx512bw, self.avx512vnni, self.avx512bf16, self.threads
        )
    }
}

/// Whether this CPU runs the AVX-512 BF16 kernels (`vdpbf16ps`, `vcvtneps2bf16`, with
/// AVX-512 F/BW/VL and the AVX2 set). Detected once; cheap to ask per call.
pub fn bf16_dot_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *BF16.get_or_init(|| {
            Isa::Avx2.available()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// How the AVX-512 BF16 W4A16 prefill panel forms its products of bf16 words. Both forms give
/// the same f32 lanes in the same order and the same bits (NaN payloads aside): the FMAs run
/// with denormals flushed and rounding to nearest even (MXCSR set for them), as `vdpbf16ps`
/// always computes. [`Bf16Products::Fma`] is checked against `vdpbf16ps` on Intel CPUs, the
/// only ones that choose it. Decode (the inline kernel) always
/// takes `vdpbf16ps`, which needs fewer instructions where the weights stream from memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bf16Products {
    /// `vdpbf16ps`: two products per f32 lane per instruction.
    Dot,
    /// Two `vfmadd231ps` per `vdpbf16ps`, on the words widened to f32: the odd word of each
    /// lane, then the even one (the order `vdpbf16ps` adds them in).
    Fma,
}

impl Bf16Products {
    /// Both forms.
    pub const ALL: [Bf16Products; 2] = [Bf16Products::Dot, Bf16Products::Fma];

    /// The faster form on this CPU, fixed per machine: [`Bf16Products::Fma`] on Intel cores,
    /// which retire `vdpbf16ps` at a quarter of their FMA rate (one core of an Emerald Rapids
    /// host: 1.29 G 512-bit `vdpbf16ps` against 5.2 G `vfmadd231ps` a second, so 41 against
    /// 83 G products a second), [`Bf16Products::Dot`] elsewhere (AMD Zen 4 issues `vdpbf16ps`
    /// at its FMA rate, with twice the products per instruction).
    pub fn detect() -> Self {
        static FORM: std::sync::OnceLock<Bf16Products> = std::sync::OnceLock::new();
        *FORM.get_or_init(|| if cpu_vendor() == *b"GenuineIntel" { Bf16Products::Fma } else { Bf16Products::Dot })
    }

    /// Suffix of the W4A16 bf16 kernel id: `avx512bf16`, or `avx512bf16-fma` for the FMA
    /// panel.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Dot => "avx512bf16",
            Bf16Products::Fma => "avx512bf16-fma",
        }
    }
}

/// The CPU's vendor string (`cpuid` leaf 0), zeros off x86-64.
fn cpu_vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        #[allow(unused_unsafe)] // `__cpuid` is safe in newer toolchains
        // SAFETY: cpuid leaf 0 exists on every x86-64 CPU.
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut v = [0u8; 12];
        for (i, word) in [r.ebx, r.edx, r.ecx].into_iter().enumerate() {
            v[4 * i..4 * i + 4].copy_from_slice(&word.to_le_bytes());
        }
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    [0u8; 12]
}

/// An implementation level of the integer (int8-activation) dots: the GGUF integer GEMM and
/// the W4A8 / W8A8 kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmLevel {
    /// Portable Rust: the reference the others equal bit for bit.
    Scalar,
    /// 256-bit `vpmaddubsw` / `vpmaddwd` (AVX2, FMA, F16C).
    Avx2,
    /// 512-bit `vpdpbusd` (AVX-512 F/BW/VNNI, plus the AVX2 set): a code chunk of two groups
    /// (sixteen rows) per instruction, with the four-byte sums accumulated in i32 directly.
    Avx512Vnni,
}

impl GemmLevel {
    /// Every level, slowest first.
    pub const ALL: [GemmLevel; 3] = [GemmLevel::Scalar, GemmLevel::Avx2, GemmLevel::Avx512Vnni];

    /// The fastest level this CPU runs for kernels selected at `isa`: the AVX-512 VNNI
    /// kernel wherever the CPU has it (it computes the same integers, so the results are
    /// identical), else the level of `isa`.
    pub fn for_isa(isa: Isa) -> Self {
        match isa {
            Isa::Scalar => GemmLevel::Scalar,
            Isa::Avx2 if GemmLevel::Avx512Vnni.available() => GemmLevel::Avx512Vnni,
            Isa::Avx2 => GemmLevel::Avx2,
        }
    }

    /// Whether this CPU can run the level.
    pub fn available(self) -> bool {
        match self {
            GemmLevel::Scalar => true,
            GemmLevel::Avx2 => Isa::Avx2.available(),
            #[cfg(target_arch = "x86_64")]
            GemmLevel::Avx512Vnni => {
                // Asked per GEMM task: detected once.
                static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                *VNNI.get_or_init(|| {
                    Isa::Avx2.available()
                        && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vnni")
                })
            }
            #[cfg(not(target_arch = "x86_64"))]
            GemmLevel::Avx512Vnni => false,
        }
    }

    /// Short name used in kernel ids.
    pub fn name(self) -> &'static str {
        match self {
            GemmLevel::Scalar => "scalar",
            GemmLevel::Avx2 => "avx2",
            GemmLevel::Avx512Vnni => "avx512vnni",
        }
    }
}
