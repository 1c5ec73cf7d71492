//! `csa2 trace`: replay a Mooncake trace through the cache manager, the SSD/DRAM tiers and the
//! replay planner for the V4.1 and V4 designs, and compare their footprints.

use crate::out::{JsonOut, Progress};
use csa2::replay::ReplayMode;
use csa2::store::FsyncPolicy;
use csa2::Error;
use csa2_harness::sim::{self, trace, Design, SimConfig, SimReport};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

const GIB: f64 = (1u64 << 30) as f64;

#[derive(clap::Args)]
pub struct Args {
    /// Mooncake JSONL trace, plain or gzip (`.jsonl.gz`; the full trace ships as assets/mooncake_conversation_trace.jsonl.gz; default: its embedded 300-request excerpt).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Design: v41, v4, or both (compared on the same trace).
    #[arg(long, default_value = "both", value_parser = ["v41", "v4", "both"])]
    design: String,
    /// HBM for global KV blocks, GiB.
    #[arg(long, default_value_t = 16.0, allow_negative_numbers = true, value_parser = crate::out::positive_f64)]
    hbm_gib: f64,
    /// Directory for the SSD tiers (one empty subdirectory per design is created); default: a
    /// temporary directory removed afterwards.
    #[arg(long)]
    ssd_dir: Option<PathBuf>,
    /// SSD capacity per design, GiB (real files are written up to this size). Default: sized to
    /// the input, 2 GiB × (its distinct prefix blocks / the 182,790 of the full conversation
    /// trace), between 64 MiB and 2 GiB: the same SSD pressure as the documented full-trace run.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::positive_f64)]
    ssd_gib: Option<f64>,
    /// SSD minimum lifetime, hours.
    #[arg(long, default_value_t = 72.0, allow_negative_numbers = true, value_parser = crate::out::positive_f64)]
    ssd_lifetime_h: f64,
    /// DRAM snapshot pool, GiB (default: 10% of this host's memory).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::non_negative_f64)]
    dram_gib: Option<f64>,
    /// DRAM snapshot TTL, seconds.
    #[arg(long, default_value_t = 300.0, allow_negative_numbers = true, value_parser = crate::out::non_negative_f64)]
    dram_ttl_s: f64,
    /// Replay mode of the V4.1 design: bounded, exact or off.
    #[arg(long, default_value = "bounded")]
    replay: String,
    /// Cache block size in tokens (multiple of 128 for V4; > 128).
    #[arg(long, default_value_t = 512, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    block_tokens: usize,
    /// Sync every SSD write (slow; the simulation default relies on the page cache).
    #[arg(long)]
    fsync: bool,
    /// Simulate only the first N requests.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    limit: Option<usize>,
    /// Write the full report (with time series) as JSON to PATH (`-` = stdout; the summary then
    /// goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
    /// Write the SVG plot of the footprint per tier over time into DIR (`footprint.svg`).
    #[arg(long, value_name = "DIR")]
    plots: Option<PathBuf>,
}

/// Distinct 512-token prefix blocks of the full Mooncake conversation trace (12,031 requests):
/// the documented run (docs/TRACE.md) gives it 2 GiB of SSD per design.
const FULL_TRACE_BLOCKS: f64 = 182_790.0;

/// The default SSD capacity per design for `reqs`: the full trace's 2 GiB scaled by the input's
/// distinct prefix blocks, clamped to [64 MiB, 2 GiB].
pub fn default_ssd_bytes(reqs: &[trace::TraceRequest]) -> u64 {
    let distinct: std::collections::HashSet<u64> = reqs
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    let full = 2.0 * GIB;
    let b = full * distinct.len() as f64 / FULL_TRACE_BLOCKS;
    b.clamp(64.0 * (1u64 << 20) as f64, full) as u64
}

#[derive(Serialize)]
struct Comparison {
    /// Persistent footprint (demand ledger) v41 / v4 at the end of the trace.
    persistent_ratio_end: f64,
    /// Peak persistent footprint v41 / v4.
    persistent_ratio_peak: f64,
    /// The paper's claim: about 1/8.
    paper_persistent_ratio: f64,
    /// Global KV bytes per token v41 / v4 (measured).
    global_ratio: f64,
    /// The paper's claim: about 1/4.
    paper_global_ratio: f64,
}

#[derive(Serialize)]
struct Output<'a> {
    trace: String,
    requests: usize,
    wall_seconds: f64,
    date_unix_s: u64,
    designs: &'a [SimReport],
    comparison: Option<Comparison>,
}

fn gib(x: f64, name: &str) -> csa2::Result<u64> {
    if !(x.is_finite() && x > 0.0) {
        return Err(Error::invalid(
            name,
            format!("must be a positive number of GiB, found {x}"),
        ));
    }
    Ok((x * GIB) as u64)
}

fn check_is_dir(dir: &Path) -> csa2::Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(Error::invalid(
            "ssd-dir",
            format!("{} is not a directory", dir.display()),
        ));
    }
    Ok(())
}

fn check_empty(dir: &Path) -> csa2::Result<()> {
    check_is_dir(dir)?;
    if let Ok(mut it) = std::fs::read_dir(dir) {
        if it.next().is_some() {
            return Err(Error::invalid(
                "ssd-dir",
                format!(
                    "{} is not empty; give an empty directory so no earlier run's records count as hits",
                    dir.display()
                ),
            ));
        }
    }
    Ok(())
}

pub fn run(a: Args) -> csa2::Result<()> {
    crate::out::json_dest(&a.json)?;
    crate::out::plots_dest(&a.plots)?;
    let (name, mut reqs) = match &a.trace {
        Some(p) => (p.display().to_string(), trace::read(p)?),
        None => (
            "assets/mooncake_conversation_excerpt.jsonl (built in)".to_string(),
            trace::parse(trace::EXCERPT, Path::new("excerpt"))?,
        ),
    };
    if let Some(n) = a.limit {
        reqs.truncate(n);
    }
    let designs: Vec<Design> = match a.design.as_str() {
        "v41" => vec![Design::V41],
        "v4" => vec![Design::V4],
        _ => vec![Design::V41, Design::V4],
    };
    let replay = ReplayMode::from_name(&a.replay)?;
    let (root, temporary) = match &a.ssd_dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("csa2-trace-{}", std::process::id())),
            true,
        ),
    };
    // Every design's directory is checked before anything is printed or run.
    check_is_dir(&root)?;
    for d in &designs {
        check_empty(&root.join(d.as_str()))?;
    }
    let ssd_bytes = match a.ssd_gib {
        Some(x) => gib(x, "ssd-gib")?,
        None => default_ssd_bytes(&reqs),
    };
    say!(
        "SSD tier: {:.0} MiB per design{}, files in {}{}",
        ssd_bytes as f64 / (1u64 << 20) as f64,
        if a.ssd_gib.is_none() {
            " (sized to the input; --ssd-gib to change)"
        } else {
            ""
        },
        root.display(),
        if temporary {
            " (temporary: removed at the end; --ssd-dir to keep them)"
        } else {
            ""
        }
    );
    let started = Instant::now();
    let mut reports = Vec::new();
    for d in designs {
        let mut cfg = SimConfig::new(d, root.join(d.as_str()))?;
        cfg.hbm_bytes = gib(a.hbm_gib, "hbm-gib")?;
        cfg.ssd_bytes = ssd_bytes;
        if let Some(x) = a.dram_gib {
            cfg.dram_bytes = gib(x, "dram-gib")?;
        }
        cfg.dram_ttl_ms = (a.dram_ttl_s * 1000.0) as u64;
        cfg.ssd_lifetime_ms = (a.ssd_lifetime_h * 3.6e6) as u64;
        cfg.block_tokens = a.block_tokens;
        cfg.replay = replay;
        cfg.fsync = if a.fsync {
            FsyncPolicy::Always
        } else {
            FsyncPolicy::Never
        };
        let bar = Progress::new(
            &format!("trace {} requests", d.as_str()),
            reqs.len() as u64,
            &format!(
                "{:>4} [{{bar:40}}] {{pos}}/{{len}} requests {{elapsed}}",
                d.as_str()
            ),
        );
        let r = sim::run(&reqs, &cfg, &|i| {
            if i % 64 == 0 {
                bar.set_position(i as u64 + 1);
            }
        });
        bar.set_position(reqs.len() as u64);
        bar.finish();
        if temporary {
            let _ = std::fs::remove_dir_all(&cfg.ssd_dir);
        }
        reports.push(r?);
    }
    if temporary {
        let _ = std::fs::remove_dir(&root);
    }
    let wall = started.elapsed().as_secs_f64();
    let comparison = match (
        reports.iter().find(|r| r.design == "v41"),
        reports.iter().find(|r| r.design == "v4"),
    ) {
        (Some(n), Some(o)) => Some(Comparison {
            persistent_ratio_end: ratio(
                n.persistent_demand_ssd_end + n.persistent_demand_dram_end,
                o.persistent_demand_ssd_end + o.persistent_demand_dram_end,
            ),
            persistent_ratio_peak: ratio(n.persistent_demand.peak, o.persistent_demand.peak),
            paper_persistent_ratio: 0.125,
            global_ratio: n
                .global_bytes_per_token_long
                .max(n.global_bytes_per_token_all)
                / o.global_bytes_per_token_long
                    .max(o.global_bytes_per_token_all),
            paper_global_ratio: 0.25,
        }),
        _ => None,
    };
    print_summary(&name, &reports, comparison.as_ref(), wall);
    let out = Output {
        trace: name,
        requests: reqs.len(),
        wall_seconds: wall,
        date_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        designs: &reports,
        comparison,
    };
    crate::out::write_json(&a.json, &out)?;
    if let Some(dir) = &a.plots {
        let p = crate::out::plot_path(dir, "footprint.svg")?;
        plot(&p, &reports)?;
        say!("wrote {}", p.display());
    }
    Ok(())
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn print_summary(name: &str, reports: &[SimReport], c: Option<&Comparison>, wall: f64) {
    say!("trace: {name}   wall time: {wall:.1} s");
    let g = |x: u64| x as f64 / GIB;
    for r in reports {
        let what = match r.design.as_str() {
            "v4" => "the DeepSeek-V4-Flash model: its own 43 layers, CSA 4:1 + HCA 128:1 (not `csa2 geometry`'s v4, which is V4.1 in launch-day records)",
            _ => "DeepSeek-V4.1-Flash: 4 Full layers, NVFP4 main KV",
        };
        say!(
            "── {} ({}) ── {what}\n  {}, {} refused for HBM",
            r.design,
            r.spec,
            crate::out::plural(r.requests, "request"),
            r.hbm_rejected
        );
        say!(
            "  global KV B/token: spec {:.2}, measured all {:.2}, long-context {:.2}; slab {} B, snapshot {} B",
            r.global_bytes_per_token_spec, r.global_bytes_per_token_all, r.global_bytes_per_token_long, r.slab_bytes, r.snapshot_bytes
        );
        say!(
            "  prefill tokens: {} total, {} saved, {} computed; token-layers {} of {} cold",
            r.prefill_tokens,
            r.prefill_tokens_saved,
            r.prefill_tokens_computed,
            r.prefill_token_layers,
            r.prefill_token_layers_cold
        );
        say!(
            "  replay: encoder bounded {} tokens, exact staircase {} token-layers, decoder kept {} / trimmed {} token-layers",
            r.replayed_encoder_bounded, r.replayed_exact_token_layers, r.decoder_rows_kept, r.decoder_rows_trimmed
        );
        say!(
            "  hits: HBM {} blocks, SSD {} blocks of {} queried; snapshots {} / {} lookups, {} expired on read, {} reclaimed",
            r.hbm_hit_blocks, r.ssd_hit_blocks, r.prefix_blocks_queried, r.snapshot_hits, r.snapshot_lookups,
            r.snapshot_expired_on_read, r.snapshot_expired_reclaimed
        );
        say!(
            "  SSD: {} records, {:.2} GiB written, {} admission refusals ({:.2} GiB), {} corrupt reads",
            r.ssd_puts, g(r.ssd_bytes_written), r.ssd_admission_refusals, g(r.ssd_refused_bytes), r.ssd_corrupt_reads
        );
        say!(
            "  GiB peak/mean: HBM {:.2}/{:.2}  SSD {:.2}/{:.2}  DRAM {:.2}/{:.2}  persistent demand {:.2}/{:.2} (end: SSD {:.2} + DRAM {:.2})",
            g(r.hbm.peak), r.hbm.mean / GIB, g(r.ssd.peak), r.ssd.mean / GIB, g(r.dram.peak), r.dram.mean / GIB,
            g(r.persistent_demand.peak), r.persistent_demand.mean / GIB,
            g(r.persistent_demand_ssd_end), g(r.persistent_demand_dram_end)
        );
    }
    if let Some(c) = c {
        say!(
            "v41/v4: persistent footprint {:.3} at the end, {:.3} at peak (paper: about {:.3}); global KV {:.3} (paper: about {:.2})",
            c.persistent_ratio_end, c.persistent_ratio_peak, c.paper_persistent_ratio, c.global_ratio, c.paper_global_ratio
        );
        if let Some(v4) = reports.iter().find(|r| r.design == "v4") {
            let new_per_req =
                (v4.prefill_tokens - v4.prefill_tokens_saved) as f64 / v4.requests.max(1) as f64;
            say!(
                "  why not 1/8: the paper's 1/8 = 1/2 (V4's SWA snapshots were about half its persistent cache) × 1/4 (global KV); \
                 this trace's turns add ≈{new_per_req:.0} new prompt tokens each, so a 3.2 MB snapshot is a small share of V4's \
                 footprint and the ratio stays near the global-KV ratio (docs/TRACE.md)"
            );
        }
    }
}

/// Picks one byte count out of a sample.
type Pick = fn(&sim::Sample) -> u64;

fn plot(path: &Path, reports: &[SimReport]) -> csa2::Result<()> {
    use plotters::prelude::*;
    let err = |e: String| Error::Internal(format!("plot {}: {e}", path.display()));
    let root = SVGBackend::new(path, (1000, 380 * reports.len().max(1) as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((reports.len().max(1), 1));
    for (r, area) in reports.iter().zip(areas) {
        let t_max = r.samples.last().map_or(1, |s| s.t_ms).max(1) as f64 / 60_000.0;
        let series: [(&str, RGBColor, Pick); 4] = [
            ("HBM (blocks + SWA rings)", BLUE, |s| s.hbm_bytes),
            ("SSD files", RED, |s| s.ssd_bytes),
            ("DRAM snapshots", GREEN, |s| s.dram_bytes),
            ("persistent demand (unbounded tiers)", BLACK, |s| {
                s.persistent_demand_bytes
            }),
        ];
        let y_max = r
            .samples
            .iter()
            .flat_map(|s| series.iter().map(move |(_, _, f)| f(s)))
            .max()
            .unwrap_or(1)
            .max(1) as f64
            / GIB
            * 1.05;
        let mut chart = ChartBuilder::on(&area)
            .caption(
                format!("{} ({}): footprint per tier", r.design, r.spec),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..t_max, 0f64..y_max)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("trace time (min)")
            .y_desc("GiB")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (label, color, f) in series.iter() {
            let pts: Vec<(f64, f64)> = r
                .samples
                .iter()
                .map(|s| (s.t_ms as f64 / 60_000.0, f(s) as f64 / GIB))
                .collect();
            let c = *color;
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(*label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
