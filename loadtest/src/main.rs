//! `tessera-bench`: see the crate README for the flags.

use anyhow::{bail, Result};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tessera_loadtest::report::{sweep_table, write_json};
use tessera_loadtest::{plot, run, run_sweep, Config, Report};

#[tokio::main]
async fn main() -> ExitCode {
    let config = match Config::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // --help and --version print to stdout and succeed; usage errors exit 1.
            let _ = e.print();
            return if e.use_stderr() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
        }
    };
    match bench(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn bench(config: Config) -> Result<()> {
    let Some(levels) = &config.sweep_concurrency else {
        let report = run(&config).await?;
        print!("{}", report.table());
        if let Some(path) = &config.output_json {
            report.write_json(path)?;
        }
        if let Some(path) = &config.output_csv {
            report.write_csv(path)?;
        }
        return succeeded(&[report]);
    };
    let reports = run_sweep(&config).await?;
    for (report, level) in reports.iter().zip(levels) {
        print!("{}", report.table());
        if let Some(path) = &config.output_csv {
            report.write_csv(&with_suffix(path, &format!("-c{level}")))?;
        }
    }
    print!("{}", sweep_table(&reports));
    plot::sweep_svg(&reports, &config.plot)?;
    println!("plot: {}", config.plot.display());
    if let Some(path) = &config.output_json {
        write_json(&serde_json::json!({ "sweep": reports }), path)?;
    }
    succeeded(&reports)
}

/// An error when not one request succeeded (a wrong URL, endpoint or model name).
fn succeeded(reports: &[Report]) -> Result<()> {
    if reports.iter().all(|r| r.summary.completed == 0) {
        bail!("no request succeeded");
    }
    Ok(())
}

/// `dir/name.ext` -> `dir/name{suffix}.ext`.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}{suffix}.{}", ext.to_string_lossy()),
        None => format!("{stem}{suffix}"),
    };
    path.with_file_name(name)
}
