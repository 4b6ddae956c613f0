//! Per-thread f32 buffers reused across calls for a call's temporaries (a prefill's MLP
//! activations, a task's output tile): tens of MiB that would otherwise come fresh from the
//! allocator on every layer, each page faulted in and zeroed by the kernel again.

use std::cell::RefCell;

thread_local! {
    /// Buffers not in use on this thread.
    static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Largest buffer kept for reuse (floats): 64 Mi floats, 256 MiB. A default serving step of
/// 512 tokens needs 48 MiB for a 1B model's MLP, about 84 MiB for an 8B one; larger ones
/// (big prefill batches, perplexity runs) are freed after use rather than held for good.
const KEEP_MAX: usize = 64 << 20;

/// Runs `f` on `len` floats taken from this thread's free buffers: the smallest that holds
/// `len`, else the largest grown to it (new floats are zero). The contents are whatever an
/// earlier user left: `f` must write every float it later reads. Calls nest; the buffer goes
/// back to the thread's list after `f` unless it is larger than [`KEEP_MAX`] (if `f` panics,
/// it is dropped). While the thread's locals are torn down, `f` gets a fresh buffer.
pub fn with_f32<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let taken = FREE.try_with(|free| {
        let mut free = free.borrow_mut();
        let fits = (0..free.len()).filter(|&i| free[i].len() >= len).min_by_key(|&i| free[i].len());
        let pick = fits.or_else(|| (0..free.len()).max_by_key(|&i| free[i].len()));
        pick.map(|i| free.swap_remove(i))
    });
    let mut buf = taken.ok().flatten().unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    let r = f(&mut buf[..len]);
    if buf.len() <= KEEP_MAX {
        // A thread being torn down drops the buffer instead.
        let _ = FREE.try_with(|free| free.borrow_mut().push(buf));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::with_f32;

    /// Nested calls get distinct buffers of the asked lengths; a buffer comes back for the
    /// next call (its earlier contents visible: the caller writes before reading).
    #[test]
    fn nested_buffers_are_distinct_and_reused() {
        let (outer, inner) = with_f32(1000, |a| {
            a.fill(1.0);
            let p = a.as_ptr();
            let q = with_f32(10, |b| {
                assert_eq!(b.len(), 10);
                b.fill(2.0);
                b.as_ptr()
            });
            assert!(a.iter().all(|&v| v == 1.0), "the inner buffer overlapped the outer one");
            (p, q)
        });
        assert_ne!(outer, inner);
        // The smallest buffer that fits: the 10-float one for 5, the 1000-float one for 500.
        with_f32(5, |b| assert_eq!((b.as_ptr(), b[0]), (inner, 2.0)));
        with_f32(500, |b| assert_eq!((b.as_ptr(), b[0]), (outer, 1.0)));
    }

    /// A buffer over the cap is not kept: the next call of that size gets a new one, zeroed.
    #[test]
    fn buffers_over_the_cap_are_freed() {
        with_f32(super::KEEP_MAX + 1, |b| b[0] = 3.0);
        with_f32(super::KEEP_MAX + 1, |b| assert_eq!(b[0], 0.0, "a buffer over the cap was kept"));
    }
}
