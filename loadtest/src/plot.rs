//! The concurrency sweep's SVG: output throughput and p50/p99 TPOT against concurrency, and
//! the end-to-end latency CDF of each level.

use crate::report::Report;
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

/// Writes the three-panel sweep plot to `path` (SVG).
pub fn sweep_svg(reports: &[Report], path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (1500, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let panels = root.split_evenly((1, 3));
    let levels: Vec<f64> = reports.iter().map(|r| r.max_concurrency.unwrap_or(1) as f64).collect();
    let x_max = levels.iter().copied().fold(1.0, f64::max) * 1.2;

    let throughput: Vec<(f64, f64)> =
        levels.iter().zip(reports).map(|(&c, r)| (c, r.summary.output_throughput)).collect();
    against_concurrency(&panels[0], "Output throughput", "tok/s", x_max, &[("output tok/s", &throughput)])?;

    let tpot = |pick: fn(&crate::metrics::Stats) -> f64| -> Vec<(f64, f64)> {
        levels.iter().zip(reports).filter_map(|(&c, r)| r.summary.tpot_ms.as_ref().map(|s| (c, pick(s)))).collect()
    };
    let (p50, p99) = (tpot(|s| s.median), tpot(|s| s.p99));
    against_concurrency(&panels[1], "TPOT", "ms", x_max, &[("p50 TPOT", &p50), ("p99 TPOT", &p99)])?;

    latency_cdf(&panels[2], reports)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

type Panel<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Lines of `(concurrency, value)` points on a log2 concurrency axis.
fn against_concurrency(
    area: &Panel,
    title: &str,
    unit: &str,
    x_max: f64,
    series: &[(&str, &[(f64, f64)])],
) -> Result<()> {
    let y_max = series.iter().flat_map(|(_, pts)| pts.iter().map(|p| p.1)).fold(0.0, f64::max).max(1e-9) * 1.15;
    let decimals = if y_max >= 10.0 { 0 } else { 2 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((0.8f64..x_max).log_scale().base(2.0), 0.0..y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("max concurrency")
        .y_desc(unit)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.decimals$}"))
        .draw()
        .map_err(plot_err)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = color(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(plot_err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// The empirical CDF of each level's end-to-end latencies (completed requests), on a log axis.
fn latency_cdf(area: &Panel, reports: &[Report]) -> Result<()> {
    let curves: Vec<(String, Vec<(f64, f64)>)> = reports
        .iter()
        .map(|r| {
            let mut e2e: Vec<f64> = r.requests.iter().filter(|q| q.ok()).map(|q| q.e2e_ms).collect();
            e2e.sort_by(f64::total_cmp);
            let n = e2e.len() as f64;
            let pts = e2e.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect();
            (format!("concurrency {}", r.max_concurrency.map_or("inf".into(), |c| c.to_string())), pts)
        })
        .collect();
    let all = || curves.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let x_max = all().fold(1e-3, f64::max) * 1.2;
    let x_min = all().fold(x_max, f64::min).max(1e-3) / 1.2;
    let mut chart = ChartBuilder::on(area)
        .caption("End-to-end latency CDF", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..1.0)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("E2E latency (ms, log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(plot_err)?;
    for (i, (name, pts)) in curves.into_iter().enumerate() {
        let color = color(i);
        // A step function: each latency raises the fraction by 1/n.
        let mut steps = Vec::with_capacity(pts.len() * 2 + 1);
        let mut prev = 0.0;
        for (x, y) in pts {
            steps.push((x, prev));
            steps.push((x, y));
            prev = y;
        }
        chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// Matplotlib's tab10 colours (less the pale ones), readable on white.
fn color(i: usize) -> RGBAColor {
    const TAB: [(u8, u8, u8); 8] = [
        (31, 119, 180),
        (214, 39, 40),
        (44, 160, 44),
        (255, 127, 14),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
    ];
    let (r, g, b) = TAB[i % TAB.len()];
    RGBColor(r, g, b).to_rgba()
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e}")
}
