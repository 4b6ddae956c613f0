//! Denormals flushed to zero for a stretch of code: MXCSR's FTZ (results) and DAZ (inputs)
//! bits set, as `vdpbf16ps` always computes whatever MXCSR says, and restored after.

/// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits.
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = 0x8040;

/// Runs `f` with denormal results of SSE/AVX floating-point instructions flushed to zero and
/// denormal inputs read as zero, on this thread; MXCSR is restored afterwards, also when `f`
/// unwinds. `f` should be a call to an `#[inline(never)]` function: the compiler does not
/// know MXCSR, so arithmetic inlined here could move across the switch.
pub fn denormals_flushed<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        /// Puts the saved MXCSR back on drop.
        struct Restore(u32);
        impl Drop for Restore {
            fn drop(&mut self) {
                // SAFETY: loads a value read from MXCSR by `stmxcsr`; 4 readable bytes.
                unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &self.0, options(nostack, readonly)) };
            }
        }
        let mut old = 0u32;
        // SAFETY: stores MXCSR into 4 writable bytes.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut old, options(nostack)) };
        let restore = Restore(old);
        let new = old | FTZ_DAZ;
        // SAFETY: MXCSR with the FTZ and DAZ bits added; every x86-64 CPU has both.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &new, options(nostack, readonly)) };
        let r = f();
        drop(restore);
        r
    }
    #[cfg(not(target_arch = "x86_64"))]
    f()
}
