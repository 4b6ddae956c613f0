//! Little-endian bit fields in byte buffers (LSB first), for codes narrower than a byte or
//! straddling bytes.

/// Writes the low `width` bits of `value` at bit offset `at` of `buf` (`width <= 32`).
pub fn put(buf: &mut [u8], at: usize, width: u32, value: u32) {
    debug_assert!(width <= 32 && (width == 32 || value >> width == 0));
    let mut v = value as u64;
    let (mut byte, mut shift) = (at / 8, (at % 8) as u32);
    let mut left = width;
    while left > 0 {
        let take = (8 - shift).min(left);
        let mask = ((1u16 << take) - 1) as u8;
        buf[byte] = (buf[byte] & !(mask << shift)) | (((v as u8) & mask) << shift);
        v >>= take;
        left -= take;
        byte += 1;
        shift = 0;
    }
}

/// Reads `width` bits (`<= 32`) at bit offset `at` of `buf`.
pub fn get(buf: &[u8], at: usize, width: u32) -> u32 {
    let (byte, shift) = (at / 8, at % 8);
    let need = (shift + width as usize).div_ceil(8);
    let mut word = 0u64;
    for (i, b) in buf[byte..byte + need].iter().enumerate() {
        word |= (*b as u64) << (8 * i);
    }
    ((word >> shift) & ((1u64 << width) - 1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_without_touching_neighbours() {
        let mut buf = vec![0xA5u8; 40];
        let fields: Vec<(u32, u32)> = (0..20).map(|i| (1 + (i * 7) % 19, (i * 2654435761u32) >> 7)).collect();
        let mut at = 3;
        for &(w, v) in &fields {
            put(&mut buf, at, w, v & ((1u32 << w) - 1));
            at += w as usize;
        }
        let mut at = 3;
        for &(w, v) in &fields {
            assert_eq!(get(&buf, at, w), v & ((1u32 << w) - 1));
            at += w as usize;
        }
        assert_eq!(get(&buf, 0, 3), 0b101, "bits before the first field kept");
        assert_eq!(buf[39], 0xA5, "bytes after the last field kept");
    }
}
