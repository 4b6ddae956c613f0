//! `tessera quantize`: file-to-file quantization of a Hugging Face directory into a
//! compressed-tensors or Quark checkpoint, with the histogram-gate report.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use tessera_engine::quantize::calibrate::CalibrationOptions;
use tessera_engine::quantize::{quantize_dir, Calibrated, Format, QuantizeOptions, Recipe, Scheme};

/// Quantization scheme.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum SchemeArg {
    /// int4 weights (group scales), 16-bit activations.
    W4a16,
    /// int4 weights per channel, 8-bit dynamic activations.
    W4a8,
    /// FP8 weights per channel, FP8 dynamic per-token activations.
    W8a8Fp8,
    /// int8 weights per channel, int8 dynamic per-token activations.
    W8a8Int8,
}

impl SchemeArg {
    fn scheme(self) -> Scheme {
        match self {
            SchemeArg::W4a16 => Scheme::W4A16,
            SchemeArg::W4a8 => Scheme::W4A8,
            SchemeArg::W8a8Fp8 => Scheme::W8A8Fp8,
            SchemeArg::W8a8Int8 => Scheme::W8A8Int8,
        }
    }
}

/// Output format.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormatArg {
    /// compressed-tensors (default for w4a16, w8a8-int8, w8a8-fp8).
    CompressedTensors,
    /// AMD Quark (default for w4a8).
    Quark,
}

/// Arguments of `tessera quantize`.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Input Hugging Face directory (F32/F16/BF16 weights).
    #[arg(long)]
    input: PathBuf,
    /// Output directory (created if missing).
    #[arg(long)]
    output: PathBuf,
    /// Quantization scheme.
    #[arg(long, value_enum)]
    scheme: SchemeArg,
    /// Output format (default: quark for w4a8, compressed-tensors otherwise).
    #[arg(long, value_enum)]
    format: Option<FormatArg>,
    /// Columns per int4 scale for w4a16 (default 128).
    #[arg(long)]
    group_size: Option<usize>,
    /// Asymmetric int4 weights with a zero point per scale (compressed-tensors W4A16_ASYM):
    /// w4a16, or w4a8 with --format compressed-tensors.
    #[arg(long)]
    asymmetric: bool,
    /// Module-name glob (fnmatch, e.g. '*self_attn*', '*mlp.gate') to leave unquantized; repeatable.
    #[arg(long)]
    exclude: Vec<String>,
    /// Quantize only MoE experts (`.mlp.experts.`): every other linear stays as it is.
    #[arg(long)]
    experts_only: bool,
    /// SmoothQuant before quantizing, with this migration strength α in [0, 1] (0.5 in the
    /// paper; larger moves more of the activations' range into the weights). Needs --calibration.
    #[arg(long, value_name = "ALPHA")]
    smoothquant: Option<f32>,
    /// GPTQ: round each layer's weights minimizing its output error on the calibration inputs
    /// (activation order, static groups). Needs --calibration. For int4, add --mse-observer:
    /// together they were the best here (docs/quantization.md, "Quality").
    #[arg(long)]
    gptq: bool,
    /// Choose each scale by searching the clipping ratio that minimizes the squared error
    /// (weighted by the inputs' energy per column with --gptq), not the range's min/max.
    #[arg(long)]
    mse_observer: bool,
    /// Plain-text calibration file for --smoothquant / --gptq (use text unlike what you evaluate on).
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// Calibration tokens used at most, from the start of the file.
    #[arg(long, default_value_t = 16384)]
    calibration_tokens: usize,
    /// Tokens per calibration sequence (capped at the model's context).
    #[arg(long, default_value_t = 1024)]
    calibration_seq_len: usize,
    /// Also quantize the output head (`lm_head`) with this scheme, in the model's format
    /// (by default it stays as it is, as llm-compressor leaves it). A head tied to the
    /// embedding is written untied. w8a8-int8 is what llama.cpp's Q8_0 output head does.
    #[arg(long, value_enum, value_name = "SCHEME")]
    lm_head: Option<SchemeArg>,
    /// Write the per-tensor reconstruction report (JSON) here.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// Runs the command.
pub fn run(args: QuantizeArgs) -> Result<()> {
    let scheme = args.scheme.scheme();
    let format = args.format.map(|f| match f {
        FormatArg::CompressedTensors => Format::CompressedTensors,
        FormatArg::Quark => Format::Quark,
    });
    let recipe = Recipe::resolve(scheme, format, args.group_size, args.asymmetric)?;
    let head = args.lm_head.map(|h| Recipe::head(h.scheme(), &recipe)).transpose().context("--lm-head")?;
    let calibrated = match (args.calibration, args.smoothquant.is_some() || args.gptq) {
        (Some(text), true) => Some(Calibrated {
            data: CalibrationOptions { text, max_tokens: args.calibration_tokens, seq_len: args.calibration_seq_len },
            smoothquant: args.smoothquant,
            gptq: args.gptq,
        }),
        (None, false) => None,
        (None, true) => bail!("--smoothquant and --gptq calibrate on text: give it with --calibration FILE"),
        (Some(_), false) => bail!("--calibration is only used by --smoothquant and --gptq; add one of them"),
    };
    let opts = QuantizeOptions {
        input: args.input.clone(),
        output: args.output.clone(),
        recipe,
        exclude: args.exclude,
        experts_only: args.experts_only,
        calibrated,
        mse_observer: args.mse_observer,
        head,
    };
    let s = quantize_dir(&opts).with_context(|| format!("quantizing {}", args.input.display()))?;
    if !s.uncalibrated.is_empty() {
        eprintln!("warning: GPTQ had no calibration inputs for {} module(s), rounded to nearest: {}", s.uncalibrated.len(), s.uncalibrated.join(", "));
    }
    if s.smoothed > 0 {
        println!("SmoothQuant rewrote {} tensors", s.smoothed);
    }
    for p in &s.unmatched_patterns {
        eprintln!("warning: --exclude {p:?} matched no linear module");
    }
    println!(
        "wrote {} ({}): {} shard(s), {} tensors quantized, {} copied, {} linear modules left unquantized; copied {}",
        args.output.display(),
        recipe.format().name(),
        s.shards.len(),
        s.report.tensors.len(),
        s.copied,
        s.ignored.len(),
        s.copied_files.join(", ")
    );
    print!("{}", s.report.summary(5));
    if let Some(path) = &args.report {
        std::fs::write(path, s.report.to_json() + "\n").with_context(|| format!("writing {}", path.display()))?;
        println!("report: {}", path.display());
    }
    Ok(())
}
