//! Resolving `--model`: an explicit path, `$TESSERA_MODEL`, or the default model
//! (fetched by `scripts/fetch-default-model.sh` when missing).

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::Command;
use super::perplexity::ComputePath;
use std::sync::Arc;
use tessera_engine::default_model;
use tessera_engine::device::Device;
use tessera_engine::parallel::TpOptions;
use tessera_engine::LoadedModel;
use tessera_kernels::linear::LinearPolicy;

/// The `--model` flag shared by every command that loads a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArg {
    /// GGUF file or Hugging Face directory (default: $TESSERA_MODEL, else the project's default model).
    #[arg(long)]
    model: Option<PathBuf>,
}

impl ModelArg {
    /// The resolved path (fetching the default model when it is missing).
    pub fn path(&self) -> Result<PathBuf> {
        resolve(self.model.as_deref())
    }

    /// Resolves and loads the model with a kernel policy.
    pub fn load(&self, policy: LinearPolicy) -> Result<LoadedModel> {
        Ok(LoadedModel::load(&self.path()?, policy)?)
    }

    /// [`Self::load`], sharded over the ranks `tp` asks for.
    pub fn load_parallel(&self, policy: LinearPolicy, tp: &TpArgs) -> Result<LoadedModel> {
        if tp.tensor_parallel_size == 0 {
            bail!("--tensor-parallel-size must be positive");
        }
        let opts = TpOptions { size: tp.tensor_parallel_size, cpu_bind: tp.cpu_bind.clone() };
        Ok(LoadedModel::load_parallel(&self.path()?, policy, &opts)?)
    }

    /// Loads the model for a command that runs it on `device` through the engine. `compute`
    /// chooses the CPU's arithmetic (default: what `serve` runs); the CUDA backend has one,
    /// f32 activations over dequantized weights (`float`), and refuses any other.
    pub fn load_for(&self, tp: &TpArgs, device: Device, compute: Option<ComputePath>) -> Result<Arc<LoadedModel>> {
        if matches!(device, Device::Cuda(_)) && compute.is_some_and(|c| c != ComputePath::Float) {
            bail!("--compute chooses the CPU's arithmetic; the CUDA backend has one (float: f32 activations over dequantized weights)");
        }
        Ok(Arc::new(self.load_parallel(compute.map_or(LinearPolicy::DEFAULT, ComputePath::policy), tp)?))
    }
}

/// Tensor parallelism on the CPU, for the commands that run a model.
#[derive(Args, Debug, Clone)]
pub struct TpArgs {
    /// Tensor-parallel ranks: the model's heads, feed-forwards and output head sharded over
    /// this many ranks, each on its own cores.
    #[arg(long, alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// CPUs of each tensor-parallel rank, ranks separated by `|` (`0-31|32-63`) [default: one
    /// NUMA node per rank when there are enough, else an even split of the usable CPUs].
    #[arg(long)]
    pub cpu_bind: Option<String>,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("server/ has a parent").to_path_buf()
}

/// The model to load: `explicit`, else `$TESSERA_MODEL`, else the default model.
pub fn resolve(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.exists() {
            bail!("model not found: {}", p.display());
        }
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("TESSERA_MODEL") {
        return resolve(Some(Path::new(&p)));
    }
    let path = default_model::fetched();
    if path.exists() {
        return Ok(path);
    }
    let script = repo_root().join("scripts/fetch-default-model.sh");
    if !script.exists() {
        bail!("default model {} is missing and {} is not available; pass --model", path.display(), script.display());
    }
    eprintln!("default model missing; running {}", script.display());
    let status = Command::new(&script)
        .env("TESSERA_MODELS_DIR", path.parent().expect("the model path has a folder"))
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() || !path.exists() {
        bail!("fetching the default model failed ({status})");
    }
    Ok(path)
}
