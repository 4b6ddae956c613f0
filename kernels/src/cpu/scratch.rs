//! Per-thread buffers reused across calls for a call's temporaries (a prefill's MLP
//! activations, a task's output tile, a matrix call's quantized activations): tens of MiB
//! that would otherwise come fresh from the allocator on every layer, each page faulted in
//! and zeroed by the kernel again.

use std::any::Any;
use std::cell::RefCell;

thread_local! {
    /// Buffers not in use on this thread: `Vec<T>`s of whatever element types were asked for.
    static FREE: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// Largest buffer kept for reuse: 256 MiB. A default serving step of 512 tokens needs 48 MiB
/// for a 1B model's MLP, about 84 MiB for an 8B one; larger ones (big prefill batches,
/// perplexity runs) are freed after use rather than held for good.
const KEEP_MAX_BYTES: usize = 256 << 20;

/// Runs `f` on `len` values of `T` taken from this thread's free buffers of `T`: the smallest
/// that holds `len`, else the largest grown to it (new values are `T::default()`). The
/// contents are whatever an earlier user left: `f` must write every value it later reads.
/// Calls nest; the buffer goes back to the thread's list after `f` unless it is larger than
/// [`KEEP_MAX_BYTES`] (if `f` panics, it is dropped). While the thread's locals are torn
/// down, `f` gets a fresh buffer.
pub fn with_scratch<T: Copy + Default + 'static, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let taken = FREE.try_with(|free| {
        let mut free = free.borrow_mut();
        let size = |i: usize| free[i].downcast_ref::<Vec<T>>().map(Vec::len);
        let fits = (0..free.len()).filter(|&i| size(i).is_some_and(|n| n >= len)).min_by_key(|&i| size(i));
        let pick = fits.or_else(|| (0..free.len()).filter(|&i| size(i).is_some()).max_by_key(|&i| size(i)));
        pick.map(|i| *free.swap_remove(i).downcast::<Vec<T>>().expect("picked by type"))
    });
    let mut buf: Vec<T> = taken.ok().flatten().unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    let r = f(&mut buf[..len]);
    if std::mem::size_of_val(buf.as_slice()) <= KEEP_MAX_BYTES {
        // A thread being torn down drops the buffer instead.
        let _ = FREE.try_with(|free| free.borrow_mut().push(Box::new(buf)));
    }
    r
}

/// [`with_scratch`] for f32 values.
pub fn with_f32<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    with_scratch(len, f)
}

#[cfg(test)]
mod tests {
    use super::{with_f32, with_scratch};

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
        let over = super::KEEP_MAX_BYTES / 4 + 1;
        with_f32(over, |b| b[0] = 3.0);
        with_f32(over, |b| assert_eq!(b[0], 0.0, "a buffer over the cap was kept"));
    }

    /// Buffers of different element types are kept apart: a request for one type never gets
    /// (or grows) another type's buffer.
    #[test]
    fn element_types_keep_their_own_buffers() {
        let f = with_f32(64, |b| {
            b.fill(1.5);
            b.as_ptr() as usize
        });
        let u = with_scratch::<u64, _>(8, |b| {
            b.fill(7);
            b.as_ptr() as usize
        });
        assert_ne!(f, u);
        with_scratch::<u64, _>(8, |b| assert_eq!((b.as_ptr() as usize, b[0]), (u, 7)));
        with_f32(64, |b| assert_eq!((b.as_ptr() as usize, b[0]), (f, 1.5)));
    }
}
