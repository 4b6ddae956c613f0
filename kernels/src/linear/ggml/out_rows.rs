//! The output of an integer GEMM call: rows of floats that need not be adjacent, so a parallel
//! task can write its columns straight into a wide output that other tasks write other
//! columns of (instead of a scratch tile copied into place: 1.7% of a prefill-heavy serving
//! run on two cores went to those copies).

use std::marker::PhantomData;

/// `rows` rows of `cols` floats, row `t` at `t * ld` floats from the first.
pub struct OutRows<'a> {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    ld: usize,
    _out: PhantomData<&'a mut [f32]>,
}

impl<'a> OutRows<'a> {
    /// A dense output: `out` as `rows` rows of `cols` floats.
    ///
    /// # Panics
    /// If `out` does not hold exactly `rows × cols` floats.
    pub fn dense(out: &'a mut [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(Some(out.len()), rows.checked_mul(cols), "{} floats are not {rows} rows of {cols}", out.len());
        OutRows { ptr: out.as_mut_ptr(), rows, cols, ld: cols, _out: PhantomData }
    }

    /// Rows of `cols` floats at `ptr`, `ptr + ld`, ... (`rows` of them), `ld >= cols`.
    ///
    /// # Safety
    /// `ptr` is non-null and aligned, every row start lies inside (or one past) the same
    /// allocation, and for `'a` the rows' floats are valid for writes and nothing else reads
    /// or writes them (the floats between the rows may belong to others: they are never
    /// touched).
    pub unsafe fn strided(ptr: *mut f32, rows: usize, cols: usize, ld: usize) -> Self {
        assert!(ld >= cols, "row stride {ld} below the row width {cols}");
        OutRows { ptr, rows, cols, ld, _out: PhantomData }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Floats per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `t`.
    ///
    /// # Panics
    /// If `t >= rows`.
    #[inline]
    pub fn row(&mut self, t: usize) -> &mut [f32] {
        assert!(t < self.rows, "output row {t} of {}", self.rows);
        // SAFETY: row t < rows of `cols` floats, ours for 'a (the constructors' contracts);
        // the borrow of `self` keeps the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(t * self.ld), self.cols) }
    }

    /// Rows `t0..`, columns `c0..c0 + cols` of these, borrowed.
    ///
    /// # Panics
    /// If the part does not lie inside these rows.
    #[inline]
    pub fn part(&mut self, t0: usize, c0: usize, cols: usize) -> OutRows<'_> {
        assert!(t0 <= self.rows && cols <= self.cols && c0 <= self.cols - cols, "part {t0}.., {c0}..+{cols} of {}x{}", self.rows, self.cols);
        OutRows { ptr: self.ptr.wrapping_add(t0 * self.ld + c0), rows: self.rows - t0, cols, ld: self.ld, _out: PhantomData }
    }
}

#[cfg(test)]
mod tests {
    use super::OutRows;

    /// Parts of a strided output write where they should and nowhere else.
    #[test]
    fn parts_address_their_rows_and_columns() {
        let mut buf = vec![0f32; 4 * 10];
        // Columns 2..8 of four rows of ten.
        // SAFETY: rows of 6 floats at 2, 12, 22, 32 lie inside `buf`, borrowed mutably here.
        let mut out = unsafe { OutRows::strided(buf.as_mut_ptr().add(2), 4, 6, 10) };
        let mut p = out.part(1, 3, 2);
        assert_eq!((p.rows(), p.cols()), (3, 2));
        for t in 0..3 {
            p.row(t).copy_from_slice(&[t as f32 + 1.0, -(t as f32) - 1.0]);
        }
        let want: Vec<(usize, f32)> = (0..3).flat_map(|t| [(10 * (t + 1) + 5, t as f32 + 1.0), (10 * (t + 1) + 6, -(t as f32) - 1.0)]).collect();
        for (i, &v) in buf.iter().enumerate() {
            let w = want.iter().find(|(j, _)| *j == i).map_or(0.0, |&(_, v)| v);
            assert_eq!(v, w, "float {i}");
        }
        assert!(std::panic::catch_unwind(move || {
            let mut b = [0f32; 4];
            let _ = OutRows::dense(&mut b, 1, 4).part(0, usize::MAX, 1).rows();
        })
        .is_err(), "a part past the columns (the bound overflowing) was accepted");
        let mut dense = vec![0f32; 6];
        let mut d = OutRows::dense(&mut dense, 2, 3);
        d.row(1)[2] = 5.0;
        assert_eq!(dense, [0.0, 0.0, 0.0, 0.0, 0.0, 5.0]);
    }
}
