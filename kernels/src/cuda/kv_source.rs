//! The paged attention and KV append sources, assembled from a KV registry
//! ([`KvRegistry`]): each family with a CUDA side brings its header (`kv/<family>/*.cuh`) and
//! its kinds of page; this module writes what they share, numbered by the registry: the
//! `TS_KV_*` codes, the record size of every code (`ts_kv_record_bytes`), attention's record load
//! (`ts_load_row`, a compile-time choice of the family's load) and KV append's store
//! (`ts_encode_row`, the families' stores in turn). A new family touches none of it.
//!
//! The record size and the store chain are written as the kernels were before they were
//! generated (size groups as nested conditionals, the most common size untested; every code the
//! launcher passes is a registered one), so the machine code did not change.

use super::source::KernelSource;
use crate::kv::{KvCudaPage, KvCudaRow, KvRegistry};
use std::fmt::Write;
use std::sync::LazyLock;

/// The two KV kernel sources of one registry.
#[derive(Debug)]
pub struct KvSources {
    /// Paged decode attention and its split merge, specialized by `HEAD_DIM` and the K and V
    /// codes (`K_FMT`, `V_FMT`). Its variants, compiled by the gate: every code on both sides
    /// (the diagonal) for head dims 64 and 128, plus a few mixed pairs; any other pair compiles
    /// on first use from the same code.
    pub attention: KernelSource,
    /// KV append: new K/V rows into the pool in any registered format (formats are kernel
    /// arguments, so one specialization serves every layer).
    pub kv_append: KernelSource,
}

/// Mixed (head dim, K page, V page) pairs the gate compiles besides the diagonal, by page name;
/// pairs naming a page the registry lacks are left out.
const MIXED_PAIRS: [(usize, &str, &str); 4] = [(64, "FP8", "BF16"), (64, "BF16", "F32"), (128, "FP8", "BF16"), (128, "INT8_STATIC", "F16")];

/// Head dims the attention kernel is specialized for.
const HEAD_DIMS: [usize; 2] = [64, 128];

/// The sources of the built-in registry (built once).
pub fn builtin() -> &'static KvSources {
    static BUILTIN: LazyLock<KvSources> = LazyLock::new(|| kv_sources(KvRegistry::builtin()));
    &BUILTIN
}

/// The attention `-D` set for `head_dim` and the built-in registry's K and V codes.
pub fn attention_defines(head_dim: usize, k_code: u8, v_code: u8) -> [&'static str; 3] {
    static DEFINES: LazyLock<Vec<[String; 2]>> = LazyLock::new(|| (0..KvRegistry::builtin().cuda_pages().len()).map(|c| [format!("K_FMT={c}"), format!("V_FMT={c}")]).collect());
    let hd = if head_dim == 64 { "HEAD_DIM=64" } else { "HEAD_DIM=128" };
    [hd, &DEFINES[k_code as usize][0], &DEFINES[v_code as usize][1]]
}

/// The KV kernel sources of `reg` (their text lives as long as the program: build them once per
/// registry).
pub fn kv_sources(reg: &KvRegistry) -> KvSources {
    let rows = reg.cuda_rows();
    let pages = reg.cuda_pages();
    let mut shared = codes(&pages);
    for row in &rows {
        shared.push_str(row.cuda.header);
        shared.push('\n');
    }
    shared.push_str(include_str!("../../cuda/kv_pages.cuh"));
    shared.push_str(&record_bytes(&pages));
    let attention = format!("{shared}{}{}", load_row(&rows), include_str!("../../cuda/attention.cu"));
    let kv_append = format!("{shared}{}{}", encode_row(&rows), include_str!("../../cuda/kv_append.cu"));
    let code_of = |name: &str| pages.iter().find(|p| p.kind.name == name).map(|p| p.code);
    let mut variants: Vec<&'static [&'static str]> = Vec::new();
    for hd in HEAD_DIMS {
        let pairs = pages.iter().map(|p| (p.code, p.code));
        let mixed = MIXED_PAIRS.iter().filter(|m| m.0 == hd).filter_map(|m| Some((code_of(m.1)?, code_of(m.2)?)));
        for (k, v) in pairs.chain(mixed) {
            let set: Vec<&'static str> = vec![leak(format!("HEAD_DIM={hd}")), leak(format!("K_FMT={k}")), leak(format!("V_FMT={v}"))];
            variants.push(Box::leak(set.into_boxed_slice()));
        }
    }
    KvSources {
        attention: KernelSource {
            name: "attention.cu",
            code: leak(attention),
            variants: Box::leak(variants.into_boxed_slice()),
            entries: &["paged_decode_attention", "paged_attention_merge"],
            needs_sm90a: false,
        },
        kv_append: KernelSource { name: "kv_append.cu", code: leak(kv_append), variants: &[&[]], entries: &["kv_append"], needs_sm90a: false },
    }
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// `#define TS_KV_<name> <code>` for every page.
fn codes(pages: &[KvCudaPage]) -> String {
    let mut s = String::from("#line 1 \"kv_codes (generated: kv registry)\"\n// KV page format codes, numbered by the registry.\n");
    for p in pages {
        writeln!(s, "#define TS_KV_{} {}", p.kind.name, p.code).unwrap();
    }
    s
}

/// `fmt == TS_KV_A || fmt == TS_KV_B` over `pages`.
fn any_of(var: &str, pages: &[&KvCudaPage]) -> String {
    pages.iter().map(|p| format!("{var} == TS_KV_{}", p.kind.name)).collect::<Vec<_>>().join(" || ")
}

/// The pages grouped by `key` in order of their first code, and the most common value (the
/// default, untested: the launcher passes registered codes only).
fn groups(pages: &[KvCudaPage], key: impl Fn(&KvCudaPage) -> usize) -> (Vec<(usize, Vec<&KvCudaPage>)>, usize) {
    let mut groups: Vec<(usize, Vec<&KvCudaPage>)> = Vec::new();
    for p in pages {
        match groups.iter_mut().find(|g| g.0 == key(p)) {
            Some(g) => g.1.push(p),
            None => groups.push((key(p), vec![p])),
        }
    }
    let default = groups.iter().max_by_key(|g| g.1.len()).map_or(0, |g| g.0);
    groups.retain(|g| g.0 != default);
    (groups, default)
}

/// `ts_kv_record_bytes(fmt, head_dim)`: the values' bytes (whole bytes per value where every
/// format's are), plus the header.
fn record_bytes(pages: &[KvCudaPage]) -> String {
    let mut s = String::from("#line 1 \"kv_record (generated: kv registry)\"\n");
    let bytes = pages.iter().all(|p| p.kind.value_bits % 8 == 0);
    let (unit, div, values) = if bytes { ("bytes", 8, "(int64_t)head_dim * ts_kv_elem_bytes(fmt)") } else { ("bits", 1, "((int64_t)head_dim * ts_kv_elem_bits(fmt) + 7) / 8") };
    let (elems, elem_default) = groups(pages, |p| p.kind.value_bits / div);
    let mut chain: String = elems.iter().map(|(v, g)| format!("({}) ? {v} : ", any_of("fmt", g))).collect();
    write!(chain, "{elem_default}").unwrap();
    writeln!(s, "// Size in {unit} of each value of a record in format fmt.\n__device__ __forceinline__ int ts_kv_elem_{unit}(int fmt) {{\n    return {chain};\n}}\n").unwrap();
    let (headers, header_default) = groups(pages, |p| p.kind.header_bytes);
    let mut chain = String::new();
    for (v, g) in &headers {
        writeln!(s, "// Whether a record in format fmt starts with a {v}-byte header.").unwrap();
        writeln!(s, "__device__ __forceinline__ bool ts_kv_header_{v}(int fmt) {{\n    return {};\n}}\n", any_of("fmt", g)).unwrap();
        write!(chain, "(ts_kv_header_{v}(fmt) ? {v} : ").unwrap();
    }
    write!(chain, "{header_default}{}", ")".repeat(headers.len())).unwrap();
    writeln!(s, "// Bytes of one token's record.\n__device__ __forceinline__ int64_t ts_kv_record_bytes(int fmt, int head_dim) {{").unwrap();
    writeln!(s, "    return {values} + {chain};\n}}").unwrap();
    s
}

/// Attention's `ts_load_row<FMT, ELEMS>`: the load of the family `FMT` belongs to.
fn load_row(rows: &[KvCudaRow]) -> String {
    let mut s = String::from(
        "#line 1 \"kv_load (generated: kv registry)\"\n// ELEMS values of one record in format FMT from dim d0, as floats (scale applied), by the\n// format family's own load.\ntemplate <int FMT, int ELEMS>\n__device__ __forceinline__ void ts_load_row(const uint8_t* rec, int d0, float static_scale, float* out) {\n    ",
    );
    for row in rows {
        let codes: Vec<String> = (0..row.cuda.pages.len()).map(|i| format!("FMT == {}", usize::from(row.first_code) + i)).collect();
        writeln!(s, "if constexpr ({}) {{\n        {}<FMT, ELEMS>(rec, d0, static_scale, out);\n    }} else ", codes.join(" || "), row.cuda.load).unwrap();
    }
    s.push_str("{\n        static_assert(FMT < 0, \"no KV format has this code\");\n    }\n}\n");
    s
}

/// KV append's `ts_encode_row`: each family's store in turn, until one takes the code.
fn encode_row(rows: &[KvCudaRow]) -> String {
    let mut s = String::from(
        "#line 1 \"kv_store (generated: kv registry)\"\n// One record of x in format fmt, by the format family's own store.\n__device__ __forceinline__ void ts_encode_row(const float* __restrict__ x, uint8_t* rec, int fmt,\n                                              int head_dim, float static_scale, int lane) {\n",
    );
    for row in rows {
        writeln!(s, "    if ({}(x, rec, fmt, head_dim, static_scale, lane)) return;", row.cuda.store).unwrap();
    }
    s.push_str("    __builtin_unreachable();  // the launcher passes registered codes only\n}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated shared code of the built-in registry: its codes, the record size as the
    /// kernels always computed it, and both dispatches over the two CUDA families.
    #[test]
    fn builtin_sources_number_and_dispatch_every_page() {
        let src = builtin();
        for (i, name) in ["F32", "BF16", "F16", "FP8", "FP8_STATIC", "INT8", "INT8_STATIC"].iter().enumerate() {
            assert!(src.attention.code.contains(&format!("#define TS_KV_{name} {i}\n")), "{name}");
        }
        assert!(src.kv_append.code.contains("return (fmt == TS_KV_F32) ? 4 : (fmt == TS_KV_BF16 || fmt == TS_KV_F16) ? 2 : 1;"));
        assert!(src.kv_append.code.contains("return fmt == TS_KV_FP8 || fmt == TS_KV_INT8;"));
        assert!(src.kv_append.code.contains("(int64_t)head_dim * ts_kv_elem_bytes(fmt) + (ts_kv_header_4(fmt) ? 4 : 0);"));
        assert!(src.attention.code.contains("if constexpr (FMT == 3 || FMT == 4 || FMT == 5 || FMT == 6) {\n        ts_kv_scaled8_load<FMT, ELEMS>"));
        assert!(src.kv_append.code.contains("    if (ts_kv_plain_encode(x, rec, fmt, head_dim, static_scale, lane)) return;\n    if (ts_kv_scaled8_encode("));
        assert_eq!(src.attention.variants.len(), 18);
        assert_eq!(src.attention.variants[7], ["HEAD_DIM=64", "K_FMT=3", "V_FMT=1"]);
        assert_eq!(src.attention.variants[17], ["HEAD_DIM=128", "K_FMT=6", "V_FMT=2"]);
        assert_eq!(attention_defines(128, 6, 2), ["HEAD_DIM=128", "K_FMT=6", "V_FMT=2"]);
    }
}
