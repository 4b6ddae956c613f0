use super::quat::{hurwitz, mul, Quat, PRIMARY};
use super::*;
use crate::kv::tests_support::{check_attention_hooks, random_rows};
use rand::Rng;

const fn p(secondary: usize, radius_bits: u32, med3: bool) -> HqmqParams {
    HqmqParams { secondary, radius_bits, med3, sink: 0 }
}

fn codec(hd: usize, params: HqmqParams) -> HqmqCodec {
    HqmqCodec::new(KvGeometry { head_dim: hd, n_kv_heads: 3 }, params, KvRole::Key, CodecOptions { layer: 2, seed: 77, static_scale: None })
}

fn encode_decode(c: &HqmqCodec, head: usize, rows: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let tokens = rows.len() / c.head_dim();
    let mut page = vec![0u8; c.page_bytes(tokens)];
    c.encode(head, KvPageMut { bytes: &mut page, tokens }, 0, rows);
    let mut out = vec![0f32; rows.len()];
    c.decode(head, KvPage { bytes: &page, tokens }, 0..tokens, &mut out);
    (page, out)
}

/// Two N(0, 1) samples, Box–Muller as the module docs specify (written out again here).
fn normal_pair(rng: &mut ChaCha8Rng) -> (f64, f64) {
    let u1: f64 = 1.0 - rng.gen::<f64>();
    let u2: f64 = rng.gen::<f64>();
    let radius = (-2.0 * u1.ln()).sqrt();
    (radius * (2.0 * std::f64::consts::PI * u2).cos(), radius * (2.0 * std::f64::consts::PI * u2).sin())
}

/// `n × hd` i.i.d. N(0, 1) values.
fn gaussian_rows(seed: u64, n: usize, hd: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n * hd / 2).flat_map(|_| {
        let (a, b) = normal_pair(&mut rng);
        [a as f32, b as f32]
    }).collect()
}

/// The Hamilton product as the left-multiplication matrix of `a` (independent of `quat::mul`).
fn ref_mul(a: Quat, b: Quat) -> Quat {
    let m = [[a[0], -a[1], -a[2], -a[3]], [a[1], a[0], -a[3], a[2]], [a[2], a[3], a[0], -a[1]], [a[3], -a[2], a[1], a[0]]];
    m.map(|row| row.iter().zip(&b).map(|(x, y)| x * y).sum())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The documented secondary codebook, drawn here from scratch: ChaCha8 keyed by
/// `seed ‖ layer ‖ head ‖ role`, 4 Box–Muller normals per entry, normalised in f64.
fn ref_secondary(seed: u64, layer: u64, head: u64, role: u64, n: usize) -> Vec<Quat> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&layer.to_le_bytes());
    key[16..24].copy_from_slice(&head.to_le_bytes());
    key[24..].copy_from_slice(&role.to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(key);
    (0..n)
        .map(|_| {
            let (a, b) = normal_pair(&mut rng);
            let (c, d) = normal_pair(&mut rng);
            let norm = (a * a + b * b + c * c + d * d).sqrt();
            [(a / norm) as f32, (b / norm) as f32, (c / norm) as f32, (d / norm) as f32]
        })
        .collect()
}

/// The joint codebook from `ref_mul`, index `s·24 + p`.
fn ref_joint(secondary: &[Quat]) -> Vec<Quat> {
    secondary.iter().flat_map(|&s| (0..PRIMARY).map(move |p| ref_mul(hurwitz(p), s))).collect()
}

/// Exhaustive argmax of `<x, c>` over `joint` (lowest index on ties) and its score.
fn exhaustive(joint: &[Quat], x: &[f32]) -> (usize, f32) {
    let mut best = (0, dot(x, &joint[0]));
    for (j, c) in joint.iter().enumerate().skip(1) {
        let s = dot(x, c);
        if s > best.1 {
            best = (j, s);
        }
    }
    best
}

fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let norm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (err / norm).sqrt()
}

#[test]
fn hurwitz_units_form_the_binary_tetrahedral_group() {
    let units: Vec<Quat> = (0..PRIMARY).map(hurwitz).collect();
    // The 24 expected elements, enumerated independently: ±e_a and ½(±1 ± i ± j ± k).
    let mut expected: Vec<Quat> = Vec::new();
    for a in 0..4 {
        for s in [1.0, -1.0] {
            let mut q = [0.0; 4];
            q[a] = s;
            expected.push(q);
        }
    }
    for m in 0..16 {
        expected.push(std::array::from_fn(|a| if m >> a & 1 == 1 { -0.5 } else { 0.5 }));
    }
    for q in &units {
        assert_eq!(dot(q, q), 1.0, "{q:?} not unit");
        assert_eq!(units.iter().filter(|u| *u == q).count(), 1, "{q:?} repeated");
        assert!(expected.contains(q), "{q:?} is not a Hurwitz unit");
    }
    // Closure (entries are 0, ±½, ±1: products are exact in f32), and each product by a
    // fixed element is a permutation (a group table is a Latin square).
    for a in &units {
        let row: Vec<usize> = units.iter().map(|b| units.iter().position(|u| *u == mul(*a, *b)).expect("2T not closed")).collect();
        let mut sorted = row.clone();
        sorted.sort();
        assert_eq!(sorted, (0..PRIMARY).collect::<Vec<_>>());
    }
    // Minimum angle 60°: the largest <a, b> between distinct, non-antipodal elements is ½.
    let mut max_dot = f32::MIN;
    for a in &units {
        for b in &units {
            if a != b && *a != b.map(|v| -v) {
                max_dot = max_dot.max(dot(a, b));
            }
        }
    }
    assert_eq!(max_dot, 0.5);
}

#[test]
fn joint_codebooks_have_24s_distinct_unit_codewords() {
    for s in [24, 48, 96, 192] {
        let c = codec(64, p(s, 4, false));
        let joint = &c.heads[1].joint;
        assert_eq!(joint.len(), 24 * s);
        for q in joint {
            // Products of f32 unit quaternions: norm off by a few ulps at most.
            assert!((dot(q, q).sqrt() - 1.0).abs() < 1e-6, "{q:?}");
        }
        // Proposition 3.1(a): distinct almost surely. 24S <= 4608 Haar-placed points on S^3 have
        // an expected smallest gap of ~8e-3; 1e-4 rules out coincident codewords, fails by
        // chance with probability ~1e-6.
        let mut min_gap = f32::MAX;
        for (i, a) in joint.iter().enumerate() {
            for b in &joint[i + 1..] {
                let d2: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
                min_gap = min_gap.min(d2);
            }
        }
        println!("S = {s:3}: {} codewords, smallest distance {:.2e}", joint.len(), min_gap.sqrt());
        assert!(min_gap.sqrt() > 1e-4, "S = {s}: codewords coincide");
    }
}

#[test]
fn fast_search_equals_exhaustive_search() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for s in [24, 48, 96, 192] {
        let c = codec(64, p(s, 4, false));
        let book = &c.heads[0];
        let joint = ref_joint(&ref_secondary(77, 2, 0, 0, s));
        let mut near_ties = 0;
        for _ in 0..4096 {
            let (a, b) = normal_pair(&mut rng);
            let (cc, d) = normal_pair(&mut rng);
            let n = (a * a + b * b + cc * cc + d * d).sqrt();
            let u = [a / n, b / n, cc / n, d / n].map(|v| v as f32);
            let fast = book.direction(u);
            let (want, best) = exhaustive(&joint, &u);
            if fast != want {
                // The fast path rounds <u·conj(q_s), q_p> where the reference rounds
                // <u, q_p·q_s>: both are within ~4 ulps of the exact value, so only codewords
                // scoring within 1e-6 of each other may swap.
                assert!(best - dot(&u, &joint[fast]) <= 1e-6, "S = {s}: fast {fast} vs exhaustive {want}");
                near_ties += 1;
            }
        }
        println!("S = {s:3}: fast == exhaustive on {} of 4096 (rest are float ties)", 4096 - near_ties);
        assert!(near_ties <= 4, "S = {s}: {near_ties} disagreements");
    }
}

/// A page written by a scalar transcription of the module docs: exhaustive search over the
/// joint codebook, bit strings built one bit at a time.
fn reference_page(params: HqmqParams, hd: usize, secondary: &[Quat], rows: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let (nc, tokens) = (hd / 4, rows.len() / hd);
    let joint = ref_joint(secondary);
    let levels = ((1u32 << params.radius_bits) - 1) as f32;
    let cb = ((24 * params.secondary) as f64 * 2f64.powi(params.radius_bits as i32)).log2().ceil() as usize;
    let slots = if params.med3 { (tokens * nc).div_ceil(32) } else { 0 };
    let (mut page, mut area, mut decoded) = (Vec::new(), vec![0u8; slots * 8], Vec::new());
    let mut used = 0;
    let push_bits = |out: &mut Vec<u8>, bits: &[bool]| {
        for byte in bits.chunks(8) {
            out.push(byte.iter().enumerate().map(|(i, &b)| (b as u8) << i).sum());
        }
    };
    for x in rows.chunks(hd) {
        let chunks: Vec<&[f32]> = x.chunks(4).collect();
        let norms: Vec<f32> = chunks.iter().map(|c| c.iter().map(|v| v * v).sum::<f32>().sqrt()).collect();
        let mut slot_of = vec![None; nc];
        if params.med3 {
            let mut sorted = norms.clone();
            sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let median = sorted[(nc - 1) / 2];
            let mut cand: Vec<usize> = (0..nc).filter(|&c| norms[c] > 3.0 * median).collect();
            cand.sort_by(|&a, &b| norms[b].partial_cmp(&norms[a]).unwrap().then(a.cmp(&b)));
            for c in cand {
                if used < slots {
                    slot_of[c] = Some(used);
                    for (e, v) in chunks[c].iter().enumerate() {
                        area[used * 8 + 2 * e..used * 8 + 2 * e + 2].copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
                    }
                    used += 1;
                }
            }
        }
        let sigma = (0..nc).filter(|&c| slot_of[c].is_none()).map(|c| norms[c]).fold(0.0, f32::max);
        let mut h = f16::from_f32(sigma);
        while h.to_f32() < sigma {
            h = f16::from_bits(h.to_bits() + 1);
        }
        let s = h.to_f32();
        page.extend_from_slice(&h.to_bits().to_le_bytes());
        let (mut code_bits, mut flag_bits) = (Vec::new(), Vec::new());
        for c in 0..nc {
            let code = match slot_of[c] {
                Some(slot) => {
                    decoded.extend(chunks[c].iter().map(|v| f16::from_f32(*v).to_f32()));
                    slot
                }
                None => {
                    let (j, _) = exhaustive(&joint, chunks[c]);
                    let r_q = if s > 0.0 { (norms[c] * levels / s).round().min(levels) as usize } else { 0 };
                    decoded.extend(joint[j].iter().map(|v| v * r_q as f32 * s / levels));
                    (j << params.radius_bits) + r_q
                }
            };
            code_bits.extend((0..cb).map(|i| code >> i & 1 == 1));
            flag_bits.push(slot_of[c].is_some());
        }
        push_bits(&mut page, &code_bits);
        if params.med3 {
            push_bits(&mut page, &flag_bits);
        }
    }
    page.extend(area);
    (page, decoded)
}

#[test]
fn encode_matches_a_scalar_reference() {
    for (params, hd) in [(p(48, 4, true), 64), (p(24, 3, false), 64), (p(96, 6, true), 12)] {
        let tokens = 16;
        let mut rows = random_rows(3, tokens, hd);
        // Planted outliers in the first 12 tokens: with random_rows' large channel that is
        // more candidates than the page's 8 (or 2) slots, so the overflow path runs too.
        for t in 0..12 {
            let c = (t * 5) % (hd / 4);
            rows[t * hd + 4 * c..t * hd + 4 * c + 4].iter_mut().for_each(|v| *v *= 40.0);
        }
        let c = codec(hd, params);
        for head in 0..2 {
            let (page, out) = encode_decode(&c, head, &rows);
            let (want, want_out) = reference_page(params, hd, &ref_secondary(77, 2, head as u64, 0, params.secondary), &rows);
            assert_eq!(page.len(), want.len(), "{}", c.name());
            assert!(page == want, "{}: page differs from the reference", c.name());
            if params.med3 {
                // 12 planted candidates > slots: every slot is used and some candidates overflowed.
                assert!(c.slots(tokens) < 12);
                assert_eq!((0..tokens).map(|t| c.flag_count(&page, t)).sum::<usize>(), c.slots(tokens));
            }
            // Codewords come from different product formulas and r̂ = r_q·(σ/L) vs (r_q·σ)/L:
            // each side within ~4 ulps of the decoded chunk's norm, so 2e-6 of it covers both.
            for (a, b) in out.chunks(4).zip(want_out.chunks(4)) {
                let norm = dot(b, b).sqrt();
                for (a, b) in a.iter().zip(b) {
                    assert!((a - b).abs() <= 2e-6 * norm, "{}: {a} vs {b}", c.name());
                }
            }
        }
    }
}

#[test]
fn page_bytes_and_bits_per_element_match_the_paper() {
    // Table 21 of the paper (d_h = 128, index counted as log2(24S) fractionally), to 2 decimals.
    let table21 = [((24, 3), 3.17), ((24, 4), 3.42), ((48, 4), 3.67), ((96, 4), 3.92), ((192, 4), 4.17), ((192, 6), 4.67)];
    println!("config         code_bits  ours@64  ours@128  paper@128  Table21  +med3@64/128");
    for s in [24usize, 48, 96, 192] {
        for b in [3u32, 4, 6] {
            let log_index = ((24 * s) as f64).log2();
            let cb = (log_index + b as f64).ceil() as usize;
            for hd in [4usize, 12, 64, 128] {
                let nc = hd / 4;
                for med3 in [false, true] {
                    let c = codec(hd, p(s, b, med3));
                    for t in [1usize, 7, 16, 33] {
                        let record = 2 + (nc * cb).div_ceil(8) + if med3 { nc.div_ceil(8) } else { 0 };
                        let area = if med3 { (t * nc).div_ceil(32) * 8 } else { 0 };
                        assert_eq!(c.page_bytes(t), t * record + area, "{} hd {hd} tokens {t}", c.name());
                    }
                }
            }
            // Bits per element over a 16-token page (no rounding of the outlier area at 64/128).
            let bpe = |hd: usize, med3: bool| codec(hd, p(s, b, med3)).page_bytes(16) as f64 * 8.0 / (16 * hd) as f64;
            let paper = (log_index + b as f64) / 4.0 + 16.0 / 128.0;
            // The only difference at d_h = 128: the index takes whole bits.
            let ceil_cost = (log_index.ceil() - log_index) / 4.0;
            assert!((bpe(128, false) - paper - ceil_cost).abs() < 1e-12);
            assert!((ceil_cost - 0.2075).abs() < 1e-3, "24S = 9·2^k: same fractional part for every S");
            let listed = table21.iter().find(|(k, _)| *k == (s, b)).map(|(_, v)| *v);
            if let Some(v) = listed {
                assert!((bpe(128, false) - ceil_cost - v).abs() <= 0.0051, "s{s}-r{b}: Table 21 says {v}");
            }
            for hd in [64, 128] {
                assert!((bpe(hd, true) - bpe(hd, false) - 0.75).abs() < 1e-12, "med3 costs 1 + 64/32 bits per chunk");
            }
            println!(
                "{:<13}  {cb:>9}  {:>7.3}  {:>8.3}  {:>9.3}  {:>7}  {:.3}/{:.3}",
                format!("hqmq-s{s}-r{b}"),
                bpe(64, false),
                bpe(128, false),
                paper,
                listed.map_or("-".to_string(), |v| format!("{v:.2}")),
                bpe(64, true),
                bpe(128, true)
            );
        }
    }
}

#[test]
fn attention_hooks_agree_with_decode() {
    for (hd, params) in [
        (64, p(24, 3, false)),
        (64, p(48, 6, false)),
        (64, p(96, 4, false)),
        (64, p(192, 6, false)),
        (64, p(24, 3, true)),
        (64, p(96, 6, true)),
        (64, p(192, 4, true)),
        (12, p(48, 4, true)),
    ] {
        check_attention_hooks(&codec(hd, params), 16, 3);
    }
}

#[test]
fn error_falls_with_codebook_size_and_radius_bits() {
    let rows = gaussian_rows(21, 256, 64);
    let mut err = [[0f64; 3]; 4];
    println!("relative RMSE on N(0,1) vectors (256 × 64):\n        r3      r4      r6");
    for (i, s) in [24, 48, 96, 192].into_iter().enumerate() {
        for (j, b) in [3, 4, 6].into_iter().enumerate() {
            let c = codec(64, p(s, b, false));
            let t0 = std::time::Instant::now();
            let (_, out) = encode_decode(&c, 0, &rows);
            if (s, b) == (192, 6) {
                println!("(encode+decode of 256 tokens at s192: {:.1} µs per token)", t0.elapsed().as_secs_f64() * 1e6 / 256.0);
            }
            err[i][j] = rel_rmse(&rows, &out);
        }
        println!("s{s:<4} {:.4}  {:.4}  {:.4}", err[i][0], err[i][1], err[i][2]);
    }
    // 4096 chunks per figure: the sampling noise (~1 % relative) is far below the gaps between
    // neighbouring configs (doubling S shrinks the angular error by ~2^(-1/3), one more radius
    // bit halves the radius step), so strict monotonicity is a stable check.
    for i in 0..4 {
        for j in 0..3 {
            if i > 0 {
                assert!(err[i][j] < err[i - 1][j], "S did not help: {err:?}");
            }
            if j > 0 {
                assert!(err[i][j] < err[i][j - 1], "B did not help: {err:?}");
            }
        }
    }
    assert!(err[3][2] < 0.15 && err[0][0] < 0.35, "{err:?}");
}

#[test]
fn med3_keeps_planted_outliers() {
    let (tokens, hd) = (64, 64);
    let mut rows = gaussian_rows(8, tokens, hd);
    // One chunk at 50× in every 4th token: 16 outliers, within the page's 32 slots.
    let planted: Vec<(usize, usize)> = (0..tokens).step_by(4).map(|t| (t, (t * 7) % 16)).collect();
    for &(t, c) in &planted {
        rows[t * hd + 4 * c..t * hd + 4 * c + 4].iter_mut().for_each(|v| *v *= 50.0);
    }
    let bulk = |v: &[f32]| -> Vec<f32> {
        planted.iter().flat_map(|&(t, c)| (0..hd).filter(move |&d| d / 4 != c).map(move |d| v[t * hd + d])).collect()
    };
    let mut results = Vec::new();
    for med3 in [false, true] {
        let (_, out) = encode_decode(&codec(hd, p(96, 4, med3)), 0, &rows);
        results.push((rel_rmse(&rows, &out), rel_rmse(&bulk(&rows), &bulk(&out))));
    }
    let [(all0, bulk0), (all1, bulk1)] = [results[0], results[1]];
    println!("s96-r4 with planted 50x chunks: rel RMSE all {all0:.4} -> {all1:.4} with med3; other chunks of those tokens {bulk0:.4} -> {bulk1:.4}");
    // Without med3 the outlier sets σ: the rest of its token rounds to r_q in {0, 1} (error
    // ~100 %) and the outliers carry the direction error (~10 %) of the whole energy; with
    // med3 the outliers are exact to f16 and their tokens quantize like any other.
    assert!(all1 < 0.25 * all0 && bulk1 < 0.3 * bulk0, "med3 did not help");
}

#[test]
fn outlier_budget_overflow_encodes_normally_and_stays_in_the_page() {
    let (tokens, hd) = (4, 64);
    let c = codec(hd, p(48, 4, true));
    assert_eq!(c.slots(tokens), 2);
    let mut rows = gaussian_rows(9, tokens, hd);
    // Token 0: three candidates (chunks 3, 7, 11 at 50, 60, 70×) for two slots; later tokens
    // one candidate each and no slots left.
    for (chunk, f) in [(3, 50.0), (7, 60.0), (11, 70.0)] {
        rows[4 * chunk..4 * chunk + 4].iter_mut().for_each(|v| *v *= f);
    }
    for t in 1..tokens {
        rows[t * hd..t * hd + 4].iter_mut().for_each(|v| *v *= 50.0);
    }
    let bytes = c.page_bytes(tokens);
    let mut once = vec![0xABu8; bytes + 64];
    once[..bytes].fill(0);
    c.encode(0, KvPageMut { bytes: &mut once, tokens }, 0, &rows);
    assert!(once[bytes..].iter().all(|&b| b == 0xAB), "wrote past the page");
    let mut halves = vec![0u8; bytes];
    c.encode(0, KvPageMut { bytes: &mut halves, tokens }, 0, &rows[..2 * hd]);
    c.encode(0, KvPageMut { bytes: &mut halves, tokens }, 2, &rows[2 * hd..]);
    assert!(halves == once[..bytes], "split encoding differs");
    assert_eq!((0..tokens).map(|t| c.flag_count(&once, t)).collect::<Vec<_>>(), [2, 0, 0, 0]);
    let mut out = vec![0f32; tokens * hd];
    c.decode(0, KvPage { bytes: &once, tokens }, 0..tokens, &mut out);
    let chunk = |v: &[f32], t: usize, k: usize| v[t * hd + 4 * k..t * hd + 4 * k + 4].to_vec();
    let norm = |k: usize| dot(&chunk(&rows, 0, k), &chunk(&rows, 0, k));
    let mut by_norm = [3, 7, 11];
    by_norm.sort_by(|&a, &b| norm(b).total_cmp(&norm(a)));
    // The two largest take the slots (exact to f16).
    for k in &by_norm[..2] {
        assert_eq!(chunk(&out, 0, *k), chunk(&rows, 0, *k).iter().map(|v| f16::from_f32(*v).to_f32()).collect::<Vec<_>>());
    }
    // The others are their token's σ: r_q = 2^B − 1 decodes to σ rounded up to f16, leaving
    // the direction error. One coset of 2T alone bounds that by 45° (0.77 relative); over 48
    // Haar-random cosets a 29° (0.5) hole has probability ~1e-13. Being crushed like the
    // bulk of an unextracted token would read ~1.
    for (t, k) in [(0, by_norm[2]), (1, 0), (2, 0), (3, 0)] {
        let (x, y) = (chunk(&rows, t, k), chunk(&out, t, k));
        assert!(rel_rmse(&x, &y) < 0.5, "token {t} chunk {k}: {x:?} vs {y:?}");
    }
}

#[test]
fn zero_vectors_decode_to_zeros() {
    for params in [p(24, 3, false), p(96, 6, true)] {
        let c = codec(64, params);
        let mut rows = vec![0f32; 3 * 64];
        // Token 2: one nonzero chunk; its median is 0, so med3 takes it as an outlier.
        rows[2 * 64 + 8..2 * 64 + 12].copy_from_slice(&[1.0, -2.0, 0.5, 0.25]);
        let (_, out) = encode_decode(&c, 1, &rows);
        assert!(out.iter().all(|v| v.is_finite()), "{}: NaN", c.name());
        assert!(out[..2 * 64].iter().all(|&v| v == 0.0), "{}: zero vector decoded nonzero", c.name());
        if params.med3 {
            assert_eq!(out[2 * 64..3 * 64], rows[2 * 64..]);
        }
    }
}
