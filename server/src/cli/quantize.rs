//! `tessera quantize`: file-to-file quantization of a Hugging Face directory into a
//! compressed-tensors or Quark checkpoint, with the histogram-gate report.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use tessera_engine::quantize::calibrate::{CalibrationOptions, CalibrationText};
use tessera_engine::quantize::{self, calibration_supported, quantize_dir, Calibrated, Format, Progress, QuantizeOptions, Recipe, Scheme, Stage};
use tessera_engine::quantize::rotate::Online;

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
    /// Columns per int4 scale for w4a16 (default 128, or where 128 does not divide some linear
    /// layer's input width the largest of 64 and 32 that divides them all).
    #[arg(long)]
    group_size: Option<usize>,
    /// Asymmetric int4 weights with a zero point per scale (compressed-tensors W4A16_ASYM):
    /// the default for w4a16 in compressed-tensors format; w4a8 takes it with --format
    /// compressed-tensors.
    #[arg(long, conflicts_with = "symmetric")]
    asymmetric: bool,
    /// Symmetric int4 weights (no zero points), also for w4a16.
    #[arg(long)]
    symmetric: bool,
    /// Module-name glob (fnmatch, e.g. '*self_attn*', '*mlp.gate') to leave unquantized; repeatable.
    #[arg(long)]
    exclude: Vec<String>,
    /// Quantize only MoE experts (`.mlp.experts.`): every other linear stays as it is.
    #[arg(long)]
    experts_only: bool,
    /// Round to nearest without calibration (the quick path): no GPTQ and no SmoothQuant, scales
    /// from each group's min/max unless --mse-observer. Without it, quantization is calibrated
    /// (docs/quantization.md): GPTQ, the MSE observer for int4, and SmoothQuant 0.5 for
    /// schemes with 8-bit activations.
    #[arg(long, conflicts_with_all = ["gptq", "gptq_damping", "smoothquant", "no_smoothquant", "calibration", "calibration_sampled", "calibration_seed"])]
    rtn: bool,
    /// SmoothQuant before quantizing, with this migration strength α in [0, 1] (0.5 in the
    /// paper, and the default for w4a8, w8a8-int8 and w8a8-fp8; larger moves more of the
    /// activations' range into the weights).
    #[arg(long, value_name = "ALPHA", conflicts_with = "no_smoothquant")]
    smoothquant: Option<f32>,
    /// No SmoothQuant, also for the schemes that smooth by default.
    #[arg(long)]
    no_smoothquant: bool,
    /// GPTQ: round each layer's weights minimizing its output error on the calibration inputs
    /// (activation order, static groups). The default unless --rtn.
    #[arg(long)]
    gptq: bool,
    /// GPTQ's damping as a fraction of the Hessian's mean diagonal (llm-compressor's
    /// dampening_frac): 0.3 for w4a16 and w4a8, 0.01 (the paper's) for the 8-bit schemes. More
    /// leans less on correlations measured in the calibration text.
    #[arg(long, value_name = "FRACTION")]
    gptq_damping: Option<f64>,
    /// Choose each scale by searching the clipping ratio that minimizes the squared error
    /// (weighted by the inputs' energy per column with GPTQ), not the range's min/max. The
    /// default for int4 schemes unless --rtn.
    #[arg(long)]
    mse_observer: bool,
    /// Plain-text calibration file (use text like what the model will serve, unlike what you
    /// evaluate on). Without it, the built-in text: chapters 1-16 of Moby-Dick (public domain
    /// English prose, about 40,000 tokens).
    #[arg(long, value_name = "FILE", conflicts_with = "calibration_sampled")]
    calibration: Option<PathBuf>,
    /// Calibrate on text the model samples itself (data-free: each sequence opened by a random
    /// token and continued at temperature 1) instead of the built-in text.
    #[arg(long)]
    calibration_sampled: bool,
    /// Seed of the sampled calibration text (--calibration-sampled).
    #[arg(long, value_name = "SEED", requires = "calibration_sampled")]
    calibration_seed: Option<u64>,
    /// Calibration tokens used at most (from the start of the text).
    #[arg(long, default_value_t = 16384)]
    calibration_tokens: usize,
    /// Tokens per calibration sequence (capped at the model's context).
    #[arg(long, default_value_t = 1024)]
    calibration_seq_len: usize,
    /// Rotate the model before quantizing (QuaRot's and SpinQuant's rotations; the same
    /// function, outliers spread over each row): the residual stream by a random orthogonal
    /// matrix (R1: norms folded into the linears, the rotation into every weight that reads or
    /// writes the residual), each head's values by a Hadamard matrix (R2, folded into V and
    /// O), and, in compressed-tensors output, down_proj's input by a Hadamard matrix online
    /// (R4, recorded in the checkpoint's transform_config and run by its loader). For one int4
    /// scale per row (w4a8); turns SmoothQuant off unless --smoothquant is given. Dense
    /// Llama-family models; the output head is written untied.
    #[arg(long, conflicts_with = "rtn")]
    rotate: bool,
    /// Also quantize the output head (`lm_head`) with this scheme, in the model's format
    /// (by default it stays as it is, as llm-compressor leaves it). A head tied to the
    /// embedding is written untied. w8a8-int8 is what llama.cpp's Q8_0 output head does.
    #[arg(long, value_enum, value_name = "SCHEME")]
    lm_head: Option<SchemeArg>,
    /// Write the per-tensor reconstruction report (JSON) here.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// How the scales and values are chosen: the default calibrated recipe, what the flags
/// change in it, or rounding to nearest (`--rtn`). MoE models, which calibration does not
/// support yet, are rounded to nearest with a warning unless a calibration flag was given.
fn how(args: &QuantizeArgs, scheme: Scheme, moe: bool) -> (Option<Calibrated>, bool) {
    let int4 = matches!(scheme, Scheme::W4A16 | Scheme::W4A8);
    let asked = args.gptq || args.gptq_damping.is_some() || args.smoothquant.is_some() || args.calibration.is_some() || args.calibration_sampled;
    if args.rtn || (moe && !asked) {
        if moe && !args.rtn {
            eprintln!("warning: calibrated quantization supports dense models; this one has MoE layers: rounding to nearest (--rtn)");
        }
        return (None, args.mse_observer || (int4 && !args.rtn));
    }
    let text = match &args.calibration {
        Some(file) => CalibrationText::File(file.clone()),
        None if args.calibration_sampled => CalibrationText::Sampled { seed: args.calibration_seed.unwrap_or(0) },
        None => CalibrationText::BuiltIn,
    };
    let smooths = !matches!(scheme, Scheme::W4A16) && !args.no_smoothquant && !args.rotate;
    let smoothquant = args.smoothquant.or(smooths.then_some(DEFAULT_SMOOTHQUANT));
    let data = CalibrationOptions { text, max_tokens: args.calibration_tokens, seq_len: args.calibration_seq_len };
    let damping = args.gptq_damping.unwrap_or(scheme.gptq_damping());
    (Some(Calibrated { data, smoothquant, gptq: true, damping }), args.mse_observer || int4)
}

/// SmoothQuant's migration strength in the default recipe of the schemes with 8-bit activations.
const DEFAULT_SMOOTHQUANT: f32 = 0.5;

/// A progress bar on stderr for the long passes (hidden when stderr is not a terminal).
fn progress_bar() -> Progress {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(indicatif::ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} ({elapsed})").expect("a valid template").progress_chars("=> "));
    Progress::new(move |stage, done, total| {
        bar.set_message(match stage {
            Stage::Sampling => "calibration text (tokens)",
            Stage::Gptq => "GPTQ (blocks)",
            Stage::Shards => "shards written",
        });
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        if stage == Stage::Shards && done == total {
            bar.finish_and_clear();
        }
    })
}

/// The group size of a w4a16 run without `--group-size` ([`quantize::fitted_group_size`]),
/// saying why when it is not 128.
fn fitted_group_size(input: &std::path::Path) -> Result<usize> {
    let (group, ragged) = quantize::fitted_group_size(input).with_context(|| format!("reading {}", input.display()))?;
    if let Some((name, width)) = ragged {
        println!(
            "group size {group}: {name} is {width} columns wide, which groups of 128 do not divide \
             (vLLM's Marlin kernels and compressed-tensors' decompression refuse a short last group; --group-size overrides)"
        );
    }
    Ok(group)
}

/// Runs the command.
pub fn run(args: QuantizeArgs) -> Result<()> {
    let scheme = args.scheme.scheme();
    let format = args.format.map(|f| match f {
        FormatArg::CompressedTensors => Format::CompressedTensors,
        FormatArg::Quark => Format::Quark,
    });
    // Zero points by default where the format has them (compressed-tensors int4 with groups).
    let asymmetric = args.asymmetric || (!args.symmetric && matches!(scheme, Scheme::W4A16) && format != Some(Format::Quark));
    let group_size = match args.group_size {
        None if scheme == Scheme::W4A16 => Some(fitted_group_size(&args.input)?),
        g => g,
    };
    let recipe = Recipe::resolve(scheme, format, group_size, asymmetric)?;
    let head = args.lm_head.map(|h| Recipe::head(h.scheme(), &recipe)).transpose().context("--lm-head")?;
    let moe = !calibration_supported(&args.input)?;
    let (calibrated, mse_observer) = how(&args, scheme, moe);
    // The rotated model is the quantizer's input, written beside the output and removed after.
    let rotated = args.rotate.then(|| args.output.with_file_name(format!("{}.rotated-input", args.output.file_name().map_or("out".into(), |n| n.to_string_lossy()))));
    if let Some(dir) = &rotated {
        // R4 (an online Hadamard before down_proj) where the output format can carry it.
        let online = if recipe.format() == Format::CompressedTensors { Online::DownHadamard } else { Online::None };
        if let Err(e) = quantize::rotate::rotate_dir(&args.input, dir, 0, online) {
            // Leave no half-written directory behind (it may not exist: nothing to report).
            let _ = std::fs::remove_dir_all(dir);
            return Err(e).with_context(|| format!("rotating {}", args.input.display()));
        }
        match online {
            Online::DownHadamard => println!("rotated the residual stream, the heads' values and, online, down_proj's input ({})", dir.display()),
            Online::None => println!("rotated the residual stream and the heads' values ({}; down_proj's input is rotated online only in compressed-tensors checkpoints)", dir.display()),
        }
    }
    let opts = QuantizeOptions {
        input: rotated.clone().unwrap_or_else(|| args.input.clone()),
        output: args.output.clone(),
        recipe,
        exclude: args.exclude,
        experts_only: args.experts_only,
        calibrated,
        mse_observer,
        head,
        progress: progress_bar(),
    };
    let s = quantize_dir(&opts).with_context(|| format!("quantizing {}", args.input.display()));
    if let Some(dir) = &rotated {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let s = s?;
    if let Some((sequences, tokens)) = s.calibrated_on {
        println!("calibrated on {tokens} tokens in {sequences} sequence(s)");
        if tokens + args.calibration_seq_len <= args.calibration_tokens {
            eprintln!("warning: the calibration text held {tokens} tokens in whole sequences, fewer than --calibration-tokens {}", args.calibration_tokens);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::path::Path;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: QuantizeArgs,
    }

    fn parse(flags: &[&str]) -> Result<QuantizeArgs, clap::Error> {
        let base = ["quantize", "--input", "in", "--output", "out"];
        Cli::try_parse_from(base.iter().chain(flags)).map(|c| c.args)
    }

    /// (GPTQ, SmoothQuant α, the built-in text, MSE observer) of `flags` on a dense or MoE model.
    fn recipe(flags: &[&str], moe: bool) -> (bool, Option<f32>, bool, bool) {
        let args = parse(flags).unwrap();
        let (cal, mse) = how(&args, args.scheme.scheme(), moe);
        match cal {
            Some(c) => (c.gptq, c.smoothquant, matches!(c.data.text, CalibrationText::BuiltIn), mse),
            None => (false, None, false, mse),
        }
    }

    /// The calibration text of `flags`.
    fn text(flags: &[&str]) -> CalibrationText {
        let args = parse(flags).unwrap();
        how(&args, args.scheme.scheme(), false).0.unwrap().data.text
    }

    #[test]
    fn the_default_recipe_is_calibrated_and_rtn_is_the_quick_path() {
        // Defaults per scheme: GPTQ on the built-in text; MSE for int4; SmoothQuant 0.5 for 8-bit activations.
        assert_eq!(recipe(&["--scheme", "w4a16"], false), (true, None, true, true));
        assert_eq!(recipe(&["--scheme", "w4a8"], false), (true, Some(0.5), true, true));
        assert_eq!(recipe(&["--scheme", "w8a8-int8"], false), (true, Some(0.5), true, false));
        assert_eq!(recipe(&["--scheme", "w8a8-fp8"], false), (true, Some(0.5), true, false));
        // Flags change the default.
        assert_eq!(recipe(&["--scheme", "w8a8-int8", "--smoothquant", "0.8", "--calibration", "f.txt"], false), (true, Some(0.8), false, false));
        assert_eq!(recipe(&["--scheme", "w4a8", "--no-smoothquant"], false), (true, None, true, true));
        // A rotated residual stream turns SmoothQuant off unless it is asked for.
        assert_eq!(recipe(&["--scheme", "w4a8", "--rotate"], false), (true, None, true, true));
        assert_eq!(recipe(&["--scheme", "w4a8", "--rotate", "--smoothquant", "0.5"], false), (true, Some(0.5), true, true));
        // Rounding to nearest: no calibration; the MSE observer only when asked.
        assert_eq!(recipe(&["--scheme", "w4a16", "--rtn"], false), (false, None, false, false));
        assert_eq!(recipe(&["--scheme", "w4a16", "--rtn", "--mse-observer"], false), (false, None, false, true));
        // MoE: rounded to nearest by default (with a warning), calibrated when asked (and then
        // refused by the quantizer, which names the reason).
        assert_eq!(recipe(&["--scheme", "w4a16"], true), (false, None, false, true));
        assert_eq!(recipe(&["--scheme", "w4a16", "--gptq"], true), (true, None, true, true));
        // Contradictions are refused.
        for bad in [&["--scheme", "w4a16", "--rtn", "--gptq"][..], &["--scheme", "w4a16", "--rtn", "--calibration", "f"], &["--scheme", "w4a16", "--rtn", "--calibration-sampled"], &["--scheme", "w4a8", "--rtn", "--rotate"], &["--scheme", "w8a8-int8", "--smoothquant", "0.5", "--no-smoothquant"], &["--scheme", "w4a16", "--symmetric", "--asymmetric"], &["--scheme", "w4a16", "--rtn", "--gptq-damping", "0.1"]] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_calibration_text_is_built_in_a_file_or_sampled() {
        assert!(matches!(text(&["--scheme", "w4a16"]), CalibrationText::BuiltIn));
        assert!(matches!(text(&["--scheme", "w4a16", "--calibration", "f.txt"]), CalibrationText::File(f) if f == Path::new("f.txt")));
        assert!(matches!(text(&["--scheme", "w4a8", "--calibration-sampled"]), CalibrationText::Sampled { seed: 0 }));
        assert!(matches!(text(&["--scheme", "w4a8", "--calibration-sampled", "--calibration-seed", "7"]), CalibrationText::Sampled { seed: 7 }));
        // A seed without sampling, or a file and sampling, contradict each other.
        for bad in [&["--scheme", "w4a16", "--calibration-seed", "7"][..], &["--scheme", "w4a16", "--calibration", "f", "--calibration-sampled"]] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        // Sampling asks for calibration on an MoE model, as --calibration does.
        let args = parse(&["--scheme", "w4a16", "--calibration-sampled"]).unwrap();
        assert!(how(&args, Scheme::W4A16, true).0.is_some());
    }

    #[test]
    fn gptq_damping_defaults_per_scheme_and_the_flag_overrides_it() {
        let damping = |flags: &[&str], moe: bool| {
            let args = parse(flags).unwrap();
            how(&args, args.scheme.scheme(), moe).0.map(|c| c.damping)
        };
        for scheme in ["w4a16", "w4a8"] {
            assert_eq!(damping(&["--scheme", scheme], false), Some(tessera_engine::quantize::INT4_DAMPING), "{scheme}");
        }
        for scheme in ["w8a8-int8", "w8a8-fp8"] {
            assert_eq!(damping(&["--scheme", scheme], false), Some(tessera_engine::quantize::gptq::PAPER_DAMPING), "{scheme}");
        }
        assert_eq!(damping(&["--scheme", "w4a16", "--gptq-damping", "0.05"], false), Some(0.05));
        assert_eq!(damping(&["--scheme", "w8a8-int8", "--gptq-damping", "0.2"], false), Some(0.2));
        // On an MoE model the flag asks for calibration, as --gptq does.
        assert_eq!(damping(&["--scheme", "w4a16", "--gptq-damping", "0.05"], true), Some(0.05));
    }
}
