//! The chart in BENCHMARKS.md: throughput bars and latency percentiles, as SVG.

use std::path::Path;

use plotters::prelude::*;

use crate::report::Report;

/// Draws `report` into `path`.
pub(crate) fn render(report: &Report, path: &Path) {
    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).expect("fill");
    let (left, right) = root.split_horizontally(560);

    let mut bars: Vec<(String, f64)> = vec![
        ("raw ceiling".to_owned(), report.ceiling_msgs_per_s),
        ("same work".to_owned(), report.same_work_per_s),
    ];
    for r in &report.scaling {
        bars.push((format!("{}w", r.workers), r.throughput));
    }
    for b in &report.backlog {
        bars.push((format!("{}k queued", b.queued / 1000), b.throughput));
    }
    draw_bars(&left, "Throughput (per second)", &bars);

    let lat = |name: &str, l: &crate::report::Latency| {
        vec![
            (format!("{name} p50"), l.p50_ms),
            ("p90".to_owned(), l.p90_ms),
            ("p99".to_owned(), l.p99_ms),
        ]
    };
    let mut latency = lat(
        &format!("{}/s", report.open_loop_offered_per_s),
        &report.open_loop.latency,
    );
    latency.extend(lat("sat.", &report.saturation.latency));
    draw_bars(&right, "Submit → wake latency (ms)", &latency);
    root.present().expect("write svg");
}

fn draw_bars(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    bars: &[(String, f64)],
) {
    let top = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..bars.len() as f64, 0f64..top)
        .expect("chart");
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 && i < labels.len() {
                labels[i].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 12))
        .draw()
        .expect("mesh");
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            Rectangle::new(
                [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, *v)],
                BLUE.mix(0.6).filled(),
            )
        }))
        .expect("bars");
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            Text::new(
                format!("{v:.0}"),
                (i as f64 + 0.2, *v + top * 0.02),
                ("sans-serif", 11),
            )
        }))
        .expect("values");
}
