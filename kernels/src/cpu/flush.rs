//! Denormals flushed to zero for a stretch of code, as `vdpbf16ps` computes whatever MXCSR
//! says: MXCSR set to round to nearest even, every exception masked, flush-to-zero (results)
//! and denormals-are-zero (inputs), and restored after.

/// MXCSR for [`denormals_flushed`]: flush-to-zero (bit 15), round to nearest (bits 13-14
/// clear), all six exceptions masked (bits 7-12), denormals-are-zero (bit 6), no flags.
#[cfg(target_arch = "x86_64")]
const FLUSHED: u32 = 0x9FC0;

/// Runs `f` on this thread with MXCSR at [`FLUSHED`]: SSE/AVX floating-point results that
/// would be denormal are zero and denormal inputs read as zero, rounding to nearest even
/// with no floating-point exception raised. The caller's MXCSR is restored afterwards, also
/// when `f` unwinds.
///
/// # Safety
/// The compiler assumes the default MXCSR and does not know this switch: `f` must be a call
/// to an `#[inline(never)]` function that takes its inputs from memory and leaves its results
/// in memory, so no arithmetic moves into or out of the flushed stretch; and nothing that
/// function runs may rely on denormals or on raising floating-point exceptions.
pub(crate) unsafe fn denormals_flushed<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        /// Puts the saved MXCSR back on drop.
        struct Restore(u32);
        impl Drop for Restore {
            fn drop(&mut self) {
                // SAFETY: loads a value read from MXCSR by `stmxcsr`; 4 readable bytes. Not
                // `readonly`: the loads of `f`'s results must stay after it.
                unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &self.0, options(nostack)) };
            }
        }
        let mut old = 0u32;
        // SAFETY: stores MXCSR into 4 writable bytes.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut old, options(nostack)) };
        let restore = Restore(old);
        // SAFETY: a valid MXCSR (no reserved bit set); not `readonly`, so `f`'s loads stay
        // after it.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &FLUSHED, options(nostack)) };
        let r = f();
        drop(restore);
        r
    }
    #[cfg(not(target_arch = "x86_64"))]
    f()
}
