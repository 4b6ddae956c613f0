//! KV-cache format flags shared by `serve`, `generate` and `perplexity`.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use tessera_engine::kv_cache::KvRequest;
use tessera_kernels::kv::{KvFormat, KvFormatError};

/// `--kv-cache-dtype`, `--kv-cache-dtype-k`, `--kv-cache-dtype-v`.
#[derive(Args, Debug, Clone, Default)]
pub struct KvCacheArgs {
    /// KV-cache format for keys and values: auto (the checkpoint's kv_cache_scheme, else f32,
    /// the compute type), f32, bf16, f16,
    /// fp8_e4m3, int8, tq3_0, hqmq-s{24,48,96,192}-r{3,4,6}[-med3]; qjl1 compresses keys only
    /// (give it with --kv-cache-dtype-k; qjl1-wW-sS keeps the first S and last W keys of each
    /// sequence exact, qjl1 = qjl1-w128-s4; hqmq-...-sinkN keeps the first N keys exact, keys only).
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// Key format (overrides --kv-cache-dtype for keys).
    #[arg(long)]
    pub kv_cache_dtype_k: Option<String>,
    /// Value format (overrides --kv-cache-dtype for values).
    #[arg(long)]
    pub kv_cache_dtype_v: Option<String>,
}

impl KvCacheArgs {
    /// The formats asked for (`None` sides: auto).
    pub fn dtype(&self) -> Result<KvRequest> {
        kv_dtype(self.kv_cache_dtype.as_deref(), self.kv_cache_dtype_k.as_deref(), self.kv_cache_dtype_v.as_deref())
    }
}

/// Resolves the three flags: a side's own flag, else the shared one, else auto (`None`, also
/// for an explicit `auto`).
pub fn kv_dtype(both: Option<&str>, k: Option<&str>, v: Option<&str>) -> Result<KvRequest> {
    let parse = |flag: &str, s: &str| -> Result<Option<KvFormat>> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(None);
        }
        s.parse::<KvFormat>().map(Some).map_err(|e| anyhow!("--{flag}: {e}"))
    };
    let both = both.map(|s| parse("kv-cache-dtype", s)).transpose()?.flatten();
    let k = k.map(|s| parse("kv-cache-dtype-k", s)).transpose()?.flatten().or(both);
    let v = v.map(|s| parse("kv-cache-dtype-v", s)).transpose()?.flatten().or(both);
    if let Some(f) = v.filter(KvFormat::keys_only) {
        bail!("{}", KvFormatError::KeysOnly(f));
    }
    if let Some(f) = v.filter(|f| f.exact_keys().is_some()) {
        bail!("{}", KvFormatError::ExactKeysForValues(f));
    }
    Ok(KvRequest { k, v })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_override_the_shared_flag() {
        assert_eq!(kv_dtype(None, None, None).unwrap(), KvRequest::default());
        assert_eq!(kv_dtype(Some("auto"), None, Some("AUTO")).unwrap(), KvRequest::default());
        let d = kv_dtype(Some("int8"), Some("qjl1"), None).unwrap();
        assert_eq!(d.to_string(), "k=qjl1,v=int8");
        assert_eq!(kv_dtype(None, Some("f32"), None).unwrap().to_string(), "k=f32,v=auto");
        assert_eq!(kv_dtype(Some("hqmq-s96-r4"), Some("hqmq-s96-r4-sink4"), None).unwrap().to_string(), "k=hqmq-s96-r4-sink4,v=hqmq-s96-r4");
        let e = kv_dtype(Some("hqmq-s96-r4-sink4"), None, None).unwrap_err().to_string();
        assert!(e.contains("--kv-cache-dtype-k hqmq-s96-r4-sink4"), "{e}");
        let e = kv_dtype(Some("q4_0"), None, None).unwrap_err().to_string();
        assert!(e.contains("--kv-cache-dtype") && e.contains("q4_0"), "{e}");
    }
}
