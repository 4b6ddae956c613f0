//! Quaternion arithmetic for HQMQ: the Hamilton product, the binary tetrahedral group 2T
//! (the 24 unit Hurwitz quaternions), the nearest element of 2T to a vector, and
//! Haar-random secondary codebooks.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// A quaternion `w + x·i + y·j + z·k` as `[w, x, y, z]` (a chunk's four values in order).
pub type Quat = [f32; 4];

/// Elements of 2T.
pub const PRIMARY: usize = 24;

/// The Hamilton product `a · b`.
#[inline(always)]
pub fn mul(a: Quat, b: Quat) -> Quat {
    [
        a[0] * b[0] - a[1] * b[1] - a[2] * b[2] - a[3] * b[3],
        a[0] * b[1] + a[1] * b[0] + a[2] * b[3] - a[3] * b[2],
        a[0] * b[2] - a[1] * b[3] + a[2] * b[0] + a[3] * b[1],
        a[0] * b[3] + a[1] * b[2] - a[2] * b[1] + a[3] * b[0],
    ]
}

/// Element `p` of 2T. `p < 8`: the axis element `±e_{p/2}` (`e = 1, i, j, k`), negative for
/// odd `p`. `p >= 8`: `½(±1 ± i ± j ± k)`, component `a` negative when bit `a` of `p - 8`
/// is set.
pub fn hurwitz(p: usize) -> Quat {
    assert!(p < PRIMARY, "2T has {PRIMARY} elements");
    let mut q = [0f32; 4];
    if p < 8 {
        q[p / 2] = if p.is_multiple_of(2) { 1.0 } else { -1.0 };
    } else {
        for (a, c) in q.iter_mut().enumerate() {
            *c = if (p - 8) >> a & 1 == 0 { 0.5 } else { -0.5 };
        }
    }
    q
}

/// `max` for non-NaN floats, in a form the compiler vectorises.
#[inline(always)]
fn max2(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// `max over q in 2T of <v, q>`: the larger of the best axis element (`max |v_a|`) and the
/// best half element (`Σ|v_a| / 2`, every sign matching `v`'s).
#[inline(always)]
pub fn best_score(v: Quat) -> f32 {
    let a = v.map(f32::abs);
    max2(max2(max2(a[0], a[1]), max2(a[2], a[3])), (a[0] + a[1] + a[2] + a[3]) * 0.5)
}

/// The index of the element of 2T with the largest `<v, q>` (the lowest index on ties), with
/// no 24-way loop: the score of [`best_score`].
pub fn nearest(v: Quat) -> usize {
    let a = v.map(f32::abs);
    let mut axis = 0;
    for i in 1..4 {
        if a[i] > a[axis] {
            axis = i;
        }
    }
    if (a[0] + a[1] + a[2] + a[3]) * 0.5 > a[axis] {
        // A zero component ties both signs: the positive one has the lower index.
        8 + (0..4).filter(|&i| v[i] < 0.0).map(|i| 1 << i).sum::<usize>()
    } else {
        2 * axis + usize::from(v[axis] < 0.0)
    }
}

/// `n` Haar-random unit quaternions: four i.i.d. N(0, 1) draws (Box–Muller, f64) normalised.
pub fn haar_codebook(rng: &mut ChaCha8Rng, n: usize) -> Vec<Quat> {
    (0..n)
        .map(|_| loop {
            let (a, b) = gaussian_pair(rng);
            let (c, d) = gaussian_pair(rng);
            let norm = (a * a + b * b + c * c + d * d).sqrt();
            // Zero has probability ~2^-106 per draw; draw again rather than divide by it.
            if norm > 0.0 {
                break [a, b, c, d].map(|g| (g / norm) as f32);
            }
        })
        .collect()
}

/// Two independent N(0, 1) samples (Box–Muller).
fn gaussian_pair(rng: &mut ChaCha8Rng) -> (f64, f64) {
    let u1 = 1.0 - rng.gen::<f64>(); // (0, 1]: ln is finite
    let u2 = rng.gen::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let t = std::f64::consts::TAU * u2;
    (r * t.cos(), r * t.sin())
}
