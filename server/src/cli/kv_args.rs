//! KV-cache format flags shared by `serve`, `generate` and `perplexity`.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use tessera_engine::kv::KvDtype;
use tessera_kernels::kv::{KvFormat, KvFormatError};

/// `--kv-cache-dtype`, `--kv-cache-dtype-k`, `--kv-cache-dtype-v`.
#[derive(Args, Debug, Clone, Default)]
pub struct KvCacheArgs {
    /// KV-cache format for keys and values: auto (= f32, the compute type), bf16, f16,
    /// fp8_e4m3, int8, tq3_0, hqmq-s{24,48,96,192}-r{3,4,6}[-med3]; qjl1 compresses keys only
    /// (give it with --kv-cache-dtype-k).
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
    /// The formats asked for (f32 where nothing is given).
    pub fn dtype(&self) -> Result<KvDtype> {
        kv_dtype(self.kv_cache_dtype.as_deref(), self.kv_cache_dtype_k.as_deref(), self.kv_cache_dtype_v.as_deref())
    }
}

/// Resolves the three flags: a side's own flag, else the shared one, else f32.
pub fn kv_dtype(both: Option<&str>, k: Option<&str>, v: Option<&str>) -> Result<KvDtype> {
    let parse = |flag: &str, s: &str| s.parse::<KvFormat>().map_err(|e| anyhow!("--{flag}: {e}"));
    let both = both.map(|s| parse("kv-cache-dtype", s)).transpose()?;
    let k = k.map(|s| parse("kv-cache-dtype-k", s)).transpose()?.or(both).unwrap_or(KvFormat::F32);
    let v = v.map(|s| parse("kv-cache-dtype-v", s)).transpose()?.or(both).unwrap_or(KvFormat::F32);
    if v == KvFormat::Qjl1 {
        bail!("{}", KvFormatError::KeysOnly(v));
    }
    Ok(KvDtype { k, v })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_override_the_shared_flag() {
        assert_eq!(kv_dtype(None, None, None).unwrap(), KvDtype::default());
        let d = kv_dtype(Some("int8"), Some("qjl1"), None).unwrap();
        assert_eq!((d.k.to_string(), d.v.to_string()), ("qjl1".into(), "int8".into()));
        let e = kv_dtype(Some("q4_0"), None, None).unwrap_err().to_string();
        assert!(e.contains("--kv-cache-dtype") && e.contains("q4_0"), "{e}");
    }
}
