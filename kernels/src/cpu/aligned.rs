//! Buffers that start on a cache line, for activations the SIMD kernels read in 32-byte loads.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One 64-byte cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Element types for which all-zero bytes are a valid value (the integer codes, bf16 words).
pub trait Zeroable: Copy + std::fmt::Debug + sealed::Sealed {}
impl Zeroable for i8 {}
impl Zeroable for i16 {}
impl Zeroable for u16 {}

mod sealed {
    /// Closes [`super::Zeroable`] to the types listed there.
    pub trait Sealed {}
    impl Sealed for i8 {}
    impl Sealed for i16 {}
    impl Sealed for u16 {}
}

/// `len` zeroed values of `T` whose first one starts a cache line, so that a row of whole
/// 32-byte runs is read without a load straddling two lines. (Quantized activations in a
/// plain `Vec` start wherever the allocator puts them, often 16 bytes into a line: then
/// every other 32-byte load is split, which cost the AVX2 W4A8 prefill kernel 10%.)
pub struct LineAligned<T: Zeroable> {
    lines: Vec<Line>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Zeroable> LineAligned<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len.checked_mul(size_of::<T>()).expect("buffer size overflows");
        LineAligned { lines: vec![Line([0; 64]); bytes.div_ceil(64)], len, _values: PhantomData }
    }
}

impl<T: Zeroable> std::fmt::Debug for LineAligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Zeroable> Deref for LineAligned<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the lines hold at least `len · size_of::<T>()` initialized bytes, aligned to
        // 64 (at least `T`'s alignment), and any bytes are a valid `T` (`Zeroable`); with no
        // lines the pointer is dangling but aligned, as an empty slice allows.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for LineAligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::LineAligned;

    #[test]
    fn starts_on_a_line_and_holds_its_values() {
        for len in [0usize, 1, 31, 32, 33, 64, 1000] {
            let mut a = LineAligned::<i16>::zeroed(len);
            assert_eq!(a.len(), len);
            assert_eq!(a.as_ptr() as usize % 64, 0, "len {len}");
            assert!(a.iter().all(|&v| v == 0));
            for (i, v) in a.iter_mut().enumerate() {
                *v = i as i16 - 500;
            }
            assert!(a.iter().enumerate().all(|(i, &v)| v == i as i16 - 500));
        }
        let b = LineAligned::<i8>::zeroed(100);
        assert_eq!(b.as_ptr() as usize % 64, 0);
    }
}
