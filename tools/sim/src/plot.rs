//! SVG figures (plotters' SVG backend: no system font libraries needed).
//!
//! - [`plot_worker_loads`]: per-worker KV load over decode steps, one panel per policy side by
//!   side on a shared y axis (the paper's Figure 3).
//! - [`plot_scaling`]: throughput gain over the best baseline, average imbalance, and the share
//!   of the best baseline's steady gap to the fluid (or aligned) limit each policy removes,
//!   against G (the paper's Figure 4, and the wide-EP share).
//!
//! Both take plain data, so they do not depend on the simulation engine.

use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

/// The share of the best baseline's gap the scaling figure marks with a dashed line: what
/// BR-0 is asked to keep at every G, so a reader sees at once where it holds.
pub const GAP_SHARE_GUIDE: f64 = 90.0;

/// Per-step per-worker loads of one run.
#[derive(Debug, Clone, Default)]
pub struct LoadSeries {
    /// Panel title (policy name).
    pub policy: String,
    /// Number of workers G (the stride of `loads`).
    pub workers: usize,
    /// Step-major loads: `loads[k * workers + g]` is L_g at step k (KV tokens).
    pub loads: Vec<u64>,
}

impl LoadSeries {
    /// Number of steps recorded.
    pub fn steps(&self) -> usize {
        self.loads.len().checked_div(self.workers).unwrap_or(0)
    }
}

/// One point of a scaling sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalingPoint {
    /// Policy name.
    pub policy: String,
    /// G.
    pub workers: usize,
    /// Whole-run throughput gain over the best baseline at this G, percent.
    pub gain_pct: f64,
    /// Steady-state (while requests wait) throughput gain over the best baseline, percent.
    pub steady_gain_pct: f64,
    /// Average imbalance (max − min load), KV tokens.
    pub avg_imbalance: f64,
    /// Average imbalance over the steady-state steps (while requests wait), KV tokens.
    pub steady_imbalance: f64,
    /// Share of the best baseline's steady gap to its fluid limit the policy removes, percent,
    /// paired by seed: mean and standard error over the seeds (`s.gap%`). `None` for the
    /// baseline itself and where the baseline has no gap.
    pub steady_gap_pct: Option<(f64, f64)>,
    /// The baseline the gains at this G are measured against (the best by whole-run
    /// throughput), so the figure can say which one "best baseline" was.
    pub baseline: String,
}

/// Names the best baseline of each G for the gain panel's caption: one name if it is the same
/// at every G, else `G=4 jsq, G=8 mintok, ...`.
pub fn baseline_caption(points: &[ScalingPoint]) -> String {
    let mut per_g: Vec<(usize, &str)> = points
        .iter()
        .map(|p| (p.workers, p.baseline.as_str()))
        .collect();
    per_g.sort_unstable();
    per_g.dedup();
    let mut names: Vec<&str> = per_g.iter().map(|(_, b)| *b).collect();
    names.sort_unstable();
    names.dedup();
    match names.as_slice() {
        [] => "best baseline".into(),
        [one] => format!("best baseline ({one} at every G)"),
        _ => {
            let each: Vec<String> = per_g.iter().map(|(g, b)| format!("G={g} {b}")).collect();
            format!("best baseline ({})", each.join(", "))
        }
    }
}

/// The i-th policy's colour in the scaling figure: Tableau's ten, which stay apart on white
/// and in print (Palette99's third is a yellow that thin lines lose on white).
fn series_color(i: usize) -> RGBAColor {
    const TABLEAU10: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    let (r, g, b) = TABLEAU10[i % TABLEAU10.len()];
    RGBColor(r, g, b).to_rgba()
}

/// Mean of max − min load over the steps in `win` (the imbalance of the plotted window).
fn window_imbalance(s: &LoadSeries, win: &Range<usize>) -> f64 {
    let g = s.workers.max(1);
    let steps: Vec<f64> = s
        .loads
        .chunks(g)
        .skip(win.start)
        .take(win.len())
        .map(|step| {
            let max = step.iter().copied().max().unwrap_or(0);
            let min = step.iter().copied().min().unwrap_or(0);
            (max - min) as f64
        })
        .collect();
    if steps.is_empty() {
        0.0
    } else {
        steps.iter().sum::<f64>() / steps.len() as f64
    }
}

/// Plot errors.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Drawing or writing the file failed.
    #[error("plot {path}: {msg}")]
    Draw {
        /// Output file.
        path: PathBuf,
        /// Cause.
        msg: String,
    },
    /// Nothing to draw.
    #[error("plot {path}: no data")]
    Empty {
        /// Output file.
        path: PathBuf,
    },
}

fn draw_err<E: std::fmt::Display>(path: &Path) -> impl Fn(E) -> PlotError + '_ {
    move |e| PlotError::Draw {
        path: path.to_path_buf(),
        msg: e.to_string(),
    }
}

fn fmt_tokens(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v.abs() >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Writes the per-worker load figure: one panel per series (two columns), every worker a line,
/// all panels on the same axes. `window` selects the steps to show (the paper shows a
/// 1,500-step segment of the steady state; `None` shows every step, clamped per series); the y
/// range is fitted to the loads inside it. At most `max_points` steps are drawn per line
/// (evenly sampled) so the SVG stays small.
pub fn plot_worker_loads(
    path: &Path,
    title: &str,
    series: &[LoadSeries],
    window: Option<Range<usize>>,
    max_points: usize,
) -> Result<(), PlotError> {
    let panels: Vec<(&LoadSeries, Range<usize>)> = series
        .iter()
        .filter_map(|s| {
            let n = s.steps();
            let w = window.clone().unwrap_or(0..n);
            let w = w.start.min(n)..w.end.min(n);
            (!w.is_empty()).then_some((s, w))
        })
        .collect();
    if panels.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
        });
    }
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for (s, w) in &panels {
        for &v in &s.loads[w.start * s.workers..w.end * s.workers] {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    let pad = ((hi - lo) as f64 * 0.05).max(1.0);
    let yr = ((lo as f64 - pad).max(0.0))..(hi as f64 + pad);
    let cols = if panels.len() == 1 { 1 } else { 2 };
    let rows = panels.len().div_ceil(cols);
    let (w, h) = (720 * cols as u32, 80 + 380 * rows as u32);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err(path))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(draw_err(path))?;
    let areas = root.split_evenly((rows, cols));
    for ((s, win), area) in panels.iter().zip(areas.iter()) {
        draw_load_panel(path, area, s, win.clone(), yr.clone(), max_points.max(2))?;
    }
    root.present().map_err(draw_err(path))?;
    Ok(())
}

fn draw_load_panel(
    path: &Path,
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    s: &LoadSeries,
    win: Range<usize>,
    yr: Range<f64>,
    max_points: usize,
) -> Result<(), PlotError> {
    let stride = win.len().div_ceil(max_points).max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "{} (G = {}): mean imbalance {} tokens",
                s.policy,
                s.workers,
                fmt_tokens(window_imbalance(s, &win))
            ),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(65)
        .build_cartesian_2d(
            win.start as f64..(win.end - 1).max(win.start + 1) as f64,
            yr,
        )
        .map_err(draw_err(path))?;
    chart
        .configure_mesh()
        .x_desc("decode step")
        .y_desc("KV tokens per worker")
        .y_label_formatter(&|v| fmt_tokens(*v))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(draw_err(path))?;
    for g in 0..s.workers {
        let color = Palette99::pick(g).mix(0.9);
        let pts = win
            .clone()
            .step_by(stride)
            .chain(std::iter::once(win.end - 1))
            .map(|k| (k as f64, s.loads[k * s.workers + g] as f64));
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(1)))
            .map_err(draw_err(path))?;
    }
    Ok(())
}

/// The top of the share panel's axis (just above 100%, so a point at 100% is whole).
const SHARE_TOP: f64 = 101.0;

/// How far to extend a panel's value range of `span` beyond its data so that a legend of
/// `rows` rows fits in the added band, clear of the data. Estimated from the 2400×600 layout
/// (a panel plots about 480 px high, a legend row takes about 14 px); at most 60% of the panel
/// goes to the legend.
fn legend_room(span: f64, rows: usize) -> f64 {
    const ROW_PX: f64 = 14.0;
    const PAD_PX: f64 = 16.0;
    const PLOT_PX: f64 = 480.0;
    let legend = ((rows as f64 * ROW_PX + PAD_PX) / PLOT_PX).min(0.6);
    span * legend / (1.0 - legend)
}

/// The limit a scaling figure's share of the gap is taken against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Every step balanced (the decode tier).
    Fluid,
    /// Every rank's prefill in the same steps and decode KV balanced (`--colocated`).
    Aligned,
}

impl Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::Fluid => "fluid",
            Limit::Aligned => "aligned",
        }
    }
}

/// Writes the scaling figure: left, throughput gain over the best baseline against G (solid:
/// whole run, thin: steady state while requests wait); middle, average imbalance against G
/// (solid: whole run, thin: steady state); right, each policy's steady share of the best
/// baseline's gap to `limit` (the fluid limit of the decode tier, or under colocated prefill
/// the aligned one), ± its standard error, with the 90% guide. G is on a log2 axis; every
/// legend sits in a band of its panel that the data leaves clear.
pub fn plot_scaling(
    path: &Path,
    title: &str,
    limit: Limit,
    points: &[ScalingPoint],
) -> Result<(), PlotError> {
    if points.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
        });
    }
    let mut policies: Vec<&str> = Vec::new();
    for p in points {
        if !policies.contains(&p.policy.as_str()) {
            policies.push(&p.policy);
        }
    }
    let lg = |g: usize| (g.max(1) as f64).log2();
    let xmin = points
        .iter()
        .map(|p| lg(p.workers))
        .fold(f64::INFINITY, f64::min)
        - 0.5;
    let xmax = points
        .iter()
        .map(|p| lg(p.workers))
        .fold(f64::NEG_INFINITY, f64::max)
        + 0.5;
    // ticks every half octave; only whole powers of two get a label
    let xticks = (2.0 * (xmax - xmin)).round() as usize + 1;
    let gmin = points
        .iter()
        .flat_map(|p| [p.gain_pct, p.steady_gain_pct])
        .fold(0.0f64, f64::min);
    let gmax = points
        .iter()
        .flat_map(|p| [p.gain_pct, p.steady_gain_pct])
        .fold(0.0f64, f64::max);
    // the gain and imbalance panels list two series per policy (whole run, steady) in their
    // upper-left legends: their ranges grow upwards to leave that band clear of the data
    let rows = 2 * policies.len();
    let gpad = ((gmax - gmin) * 0.1).max(1.0);
    let (g_lo, g_hi) = (gmin - gpad, gmax + gpad);
    let g_hi = g_hi + legend_room(g_hi - g_lo, rows);
    let imax = points
        .iter()
        .flat_map(|p| [p.avg_imbalance, p.steady_imbalance])
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.1;
    let imax = imax + legend_room(imax, rows);

    // the share panel zooms in on where policies differ (a few points apart near 90%), always
    // shows the guide and 100%, and leaves a band below the data for its lower-right legend
    // (one row per policy with a share, and the guide)
    let share_rows = 1 + policies
        .iter()
        .filter(|pol| {
            points
                .iter()
                .any(|p| p.policy == **pol && p.steady_gap_pct.is_some())
        })
        .count();
    let share_lo = points
        .iter()
        .filter_map(|p| p.steady_gap_pct.map(|(m, se)| m - se))
        .fold(GAP_SHARE_GUIDE - 5.0, f64::min)
        - 2.0;
    let share_lo = share_lo - legend_room(SHARE_TOP - share_lo, share_rows);
    let share_lo = (share_lo / 5.0).floor() * 5.0;

    let root = SVGBackend::new(path, (2400, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err(path))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(draw_err(path))?;
    let panels = root.split_evenly((1, 3));
    let (left, right, share_area) = (&panels[0], &panels[1], &panels[2]);
    let xfmt = |v: &f64| {
        if (v - v.round()).abs() < 1e-6 {
            format!("{:.0}", v.round().exp2())
        } else {
            String::new()
        }
    };

    let mut gain = ChartBuilder::on(left)
        .caption(
            format!("throughput gain over {}", baseline_caption(points)),
            ("sans-serif", 15),
        )
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(xmin..xmax, g_lo..g_hi)
        .map_err(draw_err(path))?;
    gain.configure_mesh()
        .x_desc("G (workers)")
        .y_desc("gain %")
        .x_labels(xticks)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(draw_err(path))?;

    let mut imb = ChartBuilder::on(right)
        .caption("average imbalance (max − min load)", ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(65)
        .build_cartesian_2d(xmin..xmax, 0f64..imax)
        .map_err(draw_err(path))?;
    imb.configure_mesh()
        .x_desc("G (workers)")
        .y_desc("KV tokens")
        .x_labels(xticks)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&|v| fmt_tokens(*v))
        .draw()
        .map_err(draw_err(path))?;

    let share_caption = format!(
        "steady share of the gap between the best baseline and the {} limit (± s.e.)",
        limit.name()
    );
    let mut share = ChartBuilder::on(share_area)
        .caption(share_caption, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(xmin..xmax, share_lo..SHARE_TOP)
        .map_err(draw_err(path))?;
    share
        .configure_mesh()
        .x_desc("G (workers)")
        .y_desc("s.gap %")
        .x_labels(xticks)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(draw_err(path))?;
    share
        .draw_series(DashedLineSeries::new(
            [(xmin, GAP_SHARE_GUIDE), (xmax, GAP_SHARE_GUIDE)],
            6,
            4,
            BLACK.mix(0.5).stroke_width(1),
        ))
        .map_err(draw_err(path))?
        .label(format!("{GAP_SHARE_GUIDE:.0}% of the gap"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.5)));

    for (i, pol) in policies.iter().enumerate() {
        let color = series_color(i);
        let mut pts: Vec<&ScalingPoint> = points.iter().filter(|p| p.policy == *pol).collect();
        pts.sort_by_key(|p| p.workers);
        let whole: Vec<(f64, f64)> = pts.iter().map(|p| (lg(p.workers), p.gain_pct)).collect();
        let steady: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (lg(p.workers), p.steady_gain_pct))
            .collect();
        let imbs: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (lg(p.workers), p.avg_imbalance))
            .collect();
        let steady_imbs: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (lg(p.workers), p.steady_imbalance))
            .collect();
        gain.draw_series(LineSeries::new(whole.clone(), color.stroke_width(2)))
            .map_err(draw_err(path))?
            .label(pol.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        gain.draw_series(whole.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(draw_err(path))?;
        gain.draw_series(LineSeries::new(
            steady.clone(),
            color.mix(0.6).stroke_width(1),
        ))
        .map_err(draw_err(path))?
        .label(format!("{pol} (steady)"))
        .legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 18, y)], color.mix(0.6).stroke_width(1))
        });
        gain.draw_series(steady.iter().map(|&p| Circle::new(p, 2, color.mix(0.6))))
            .map_err(draw_err(path))?;
        imb.draw_series(LineSeries::new(imbs.clone(), color.stroke_width(2)))
            .map_err(draw_err(path))?
            .label(pol.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        imb.draw_series(imbs.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(draw_err(path))?;
        imb.draw_series(LineSeries::new(
            steady_imbs.clone(),
            color.mix(0.6).stroke_width(1),
        ))
        .map_err(draw_err(path))?
        .label(format!("{pol} (steady)"))
        .legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 18, y)], color.mix(0.6).stroke_width(1))
        });
        imb.draw_series(
            steady_imbs
                .iter()
                .map(|&p| Circle::new(p, 2, color.mix(0.6))),
        )
        .map_err(draw_err(path))?;
        let shares: Vec<(f64, f64, f64)> = pts
            .iter()
            .filter_map(|p| p.steady_gap_pct.map(|(m, se)| (lg(p.workers), m, se)))
            .collect();
        if shares.is_empty() {
            continue;
        }
        share
            .draw_series(LineSeries::new(
                shares.iter().map(|&(x, m, _)| (x, m)),
                color.stroke_width(2),
            ))
            .map_err(draw_err(path))?
            .label(pol.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        share
            .draw_series(
                shares
                    .iter()
                    .map(|&(x, m, _)| Circle::new((x, m), 3, color.filled())),
            )
            .map_err(draw_err(path))?;
        // one standard error either side, with caps a tenth of an octave wide (none for one
        // seed: no spread to show)
        share
            .draw_series(shares.iter().filter(|s| s.2 > 0.0).flat_map(|&(x, m, se)| {
                let (lo, hi) = (m - se, m + se);
                [
                    PathElement::new(vec![(x, lo), (x, hi)], color.stroke_width(1)),
                    PathElement::new(vec![(x - 0.05, lo), (x + 0.05, lo)], color.stroke_width(1)),
                    PathElement::new(vec![(x - 0.05, hi), (x + 0.05, hi)], color.stroke_width(1)),
                ]
            }))
            .map_err(draw_err(path))?;
    }
    // the bands `legend_room` left clear: above the data for gain and imbalance, below for the
    // share
    for (chart, corner) in [
        (&mut gain, SeriesLabelPosition::UpperLeft),
        (&mut imb, SeriesLabelPosition::UpperLeft),
        (&mut share, SeriesLabelPosition::LowerRight),
    ] {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(corner)
            .draw()
            .map_err(draw_err(path))?;
    }
    root.present().map_err(draw_err(path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_load_figure_is_written() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("loads.svg");
        let mk = |name: &str, spread: u64| LoadSeries {
            policy: name.into(),
            workers: 4,
            loads: (0..3000u64)
                .flat_map(|k| (0..4u64).map(move |g| 100_000 + k * 10 + g * spread))
                .collect(),
        };
        let series = vec![mk("jsq", 20_000), mk("br0", 2_000), mk("brh", 1_000)];
        plot_worker_loads(&p, "synthetic test", &series, Some(500..2000), 500).expect("plot");
        let svg = std::fs::read_to_string(&p).expect("read");
        if let Ok(d) = std::env::var("BR_SIM_KEEP_PLOTS") {
            let _ = std::fs::copy(
                &p,
                std::path::Path::new(&d).join(p.file_name().expect("name")),
            );
        }
        assert!(svg.starts_with("<svg"), "{}", &svg[..50.min(svg.len())]);
        // Each panel names its policy and the mean imbalance of the plotted steps
        // (max − min = 3 · spread at every step).
        assert!(
            svg.contains("jsq (G = 4): mean imbalance 60k tokens")
                && svg.contains("br0 (G = 4): mean imbalance 6k tokens")
                && svg.contains("brh (G = 4): mean imbalance 3k tokens"),
            "panel captions"
        );
        assert!(
            svg.matches("<polyline").count() >= 12,
            "a line per worker per panel"
        );
        assert!(svg.len() < 400_000, "{} bytes", svg.len());
        assert!(matches!(
            plot_worker_loads(&p, "x", &[], None, 10),
            Err(PlotError::Empty { .. })
        ));
        assert!(matches!(
            plot_worker_loads(&p, "x", &series, Some(5000..6000), 10),
            Err(PlotError::Empty { .. })
        ));
    }

    #[test]
    fn legends_get_a_band_clear_of_the_data() {
        // 12 rows (six policies, whole run and steady): 12·14 + 16 px of a 480 px panel go to
        // the legend, the data keeps the rest of the range
        let room = legend_room(10.0, 12);
        assert!(
            (room / (10.0 + room) - 184.0 / 480.0).abs() < 1e-9,
            "{room}"
        );
        // never more than 60% of the panel, however many series
        let room = legend_room(10.0, 100);
        assert!((room / (10.0 + room) - 0.6).abs() < 1e-9, "{room}");
        assert!(legend_room(10.0, 1) > 0.0);
    }

    #[test]
    fn scaling_figure_is_written() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("scaling.svg");
        let pts: Vec<ScalingPoint> = [4usize, 8, 16, 32, 64]
            .iter()
            .flat_map(|&g| {
                [("br0", 1.0), ("jsq", 0.0)].map(|(pol, f)| ScalingPoint {
                    policy: pol.into(),
                    workers: g,
                    gain_pct: f * (g as f64).sqrt(),
                    steady_gain_pct: f * 1.5 * (g as f64).sqrt(),
                    avg_imbalance: 1000.0 * g as f64 / (1.0 + 3.0 * f),
                    steady_imbalance: 800.0 * g as f64 / (1.0 + 3.0 * f),
                    // br0 falls from 89 to 73% (± 1.5) as G grows; none for the baseline
                    steady_gap_pct: (f > 0.0).then(|| (97.0 - 4.0 * (g as f64).log2(), 1.5)),
                    baseline: if g < 16 { "jsq" } else { "mintok" }.into(),
                })
            })
            .collect();
        plot_scaling(&p, "scaling test", Limit::Fluid, &pts).expect("plot");
        let svg = std::fs::read_to_string(&p).expect("read");
        if let Ok(d) = std::env::var("BR_SIM_KEEP_PLOTS") {
            let _ = std::fs::copy(
                &p,
                std::path::Path::new(&d).join(p.file_name().expect("name")),
            );
        }
        assert!(svg.contains("br0 (steady)"));
        assert!(
            svg.contains("best baseline (G=4 jsq, G=8 jsq, G=16 mintok, G=32 mintok, G=64 mintok)"),
            "the gain panel names the baseline of each G"
        );
        assert_eq!(
            baseline_caption(&pts[..4]),
            "best baseline (jsq at every G)"
        );
        assert!(svg.contains("\n64\n</text>"), "G tick labels");
        assert!(
            svg.contains(
                "steady share of the gap between the best baseline and the fluid limit (± s.e.)"
            ) && svg.contains("90% of the gap"),
            "the share panel and its guide"
        );
        // the share axis reaches below br0's lowest point less its error (73 − 1.5), and below
        // that leaves its legend's band (two rows: br0 and the guide)
        assert!(svg.contains("\n65\n</text>"), "share axis down to 65%");
        // an error bar and two caps per br0 point, none for the baseline: 15 more segments
        // (`<line>` or `<polyline>`) than the same figure with no spread (one seed), whose
        // axes are the same
        let segments = |svg: &str| svg.matches("<line").count() + svg.matches("<polyline").count();
        let with = segments(&svg);
        plot_scaling(
            &p,
            "scaling test",
            Limit::Fluid,
            &pts.iter()
                .map(|q| ScalingPoint {
                    steady_gap_pct: q.steady_gap_pct.map(|(m, _)| (m, 0.0)),
                    ..q.clone()
                })
                .collect::<Vec<_>>(),
        )
        .expect("plot without spread");
        let without = segments(&std::fs::read_to_string(&p).expect("read"));
        assert_eq!(with, without + 15, "error bars with a spread, none without");
        assert!(matches!(
            plot_scaling(&p, "x", Limit::Aligned, &[]),
            Err(PlotError::Empty { .. })
        ));
    }
}
