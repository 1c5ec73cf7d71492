use crate::out::JsonOut;
use csa2::cache::spec::CacheSpec;
use csa2::geometry::CandidateUse;
use csa2::KvScheme;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face config.json (default: the released DeepSeek-V4.1-Flash config, compiled in).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Write the plan as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
    /// Capacity plan preset: `h200-tp4-engram-offload` (the vLLM recipe's 8×H200 node, TP4, Engram
    /// tables in host memory: 81.2 GiB of weights and 38.5 GiB of KV per GPU) or `kv-only` (one
    /// H200, nothing but KV: an upper bound). --gpu-mem-gib / --weights-gib / --kv-gib override it.
    #[arg(long, default_value = "h200-tp4-engram-offload", value_parser = ["h200-tp4-engram-offload", "kv-only"])]
    deployment: String,
    /// Accelerator memory in GiB (default: the preset's; one H200 = 141 GB = 131.3 GiB).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::positive_f64)]
    gpu_mem_gib: Option<f64>,
    /// Memory taken by weights on that accelerator, GiB (default: the preset's).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::non_negative_f64)]
    weights_gib: Option<f64>,
    /// Memory given to the KV cache, GiB (default: the preset's published KV budget, or
    /// gpu − weights when either of those is given).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::non_negative_f64)]
    kv_gib: Option<f64>,
    /// Context length (tokens, ≥ 1) per session for the capacity plan.
    #[arg(long, default_value_t = 1 << 20, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    context: usize,
}

/// One H200: 141 GB of HBM3e, in GiB.
const H200_GIB: f64 = 141e9 / (1u64 << 30) as f64;

/// A published deployment for the capacity plan.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Deployment {
    pub name: &'static str,
    pub gpu_mem_gib: f64,
    pub weights_gib: f64,
    pub kv_gib: f64,
    pub source: &'static str,
}

/// The presets of `--deployment`.
pub fn deployment(name: &str) -> Option<Deployment> {
    match name {
        // vLLM recipe for DeepSeek-V4.1-Flash (updated 2026-10-25), as quoted in the 2026-09 article
        // "DeepSeek V4.1 Flash grows as its KV cache shrinks 4x": "8x H200 node: fits in 1,128 GB,
        // and with TP4 and Engram offload, 81.2 GiB of weights plus 38.5 GiB of KV per GPU".
        "h200-tp4-engram-offload" => Some(Deployment {
            name: "h200-tp4-engram-offload",
            gpu_mem_gib: H200_GIB,
            weights_gib: 81.2,
            kv_gib: 38.5,
            source: "vLLM DeepSeek-V4.1-Flash recipe (2026-10-25): 8×H200, TP4, Engram offload — 81.2 GiB weights + 38.5 GiB KV per GPU",
        }),
        "kv-only" => Some(Deployment {
            name: "kv-only",
            gpu_mem_gib: H200_GIB,
            weights_gib: 0.0,
            kv_gib: H200_GIB,
            source: "one H200 (141 GB) holding nothing but KV: an upper bound, not a deployment",
        }),
        _ => None,
    }
}

pub fn run(a: Args) -> csa2::Result<()> {
    crate::out::json_dest(&a.json)?;
    let g = crate::load_geometry(a.config.as_deref())?;
    if a.context == 0 {
        return Err(csa2::Error::invalid(
            "context",
            "must be ≥ 1 token (the capacity plan divides memory by a session's bytes)",
        ));
    }
    let mut d = deployment(&a.deployment).ok_or_else(|| {
        csa2::Error::invalid("deployment", format!("unknown preset `{}`", a.deployment))
    })?;
    for (name, v) in [
        ("gpu-mem-gib", a.gpu_mem_gib),
        ("weights-gib", a.weights_gib),
        ("kv-gib", a.kv_gib),
    ] {
        if let Some(x) = v {
            if !(x.is_finite() && x >= 0.0) {
                return Err(csa2::Error::invalid(
                    name,
                    format!("must be finite and ≥ 0, found {x}"),
                ));
            }
        }
    }
    let overridden = a.gpu_mem_gib.is_some() || a.weights_gib.is_some() || a.kv_gib.is_some();
    if overridden {
        d.name = "custom";
        d.source = "command-line flags over the preset";
        d.gpu_mem_gib = a.gpu_mem_gib.unwrap_or(d.gpu_mem_gib);
        d.weights_gib = a.weights_gib.unwrap_or(d.weights_gib);
        if d.weights_gib >= d.gpu_mem_gib {
            return Err(csa2::Error::invalid(
                "gpu-mem-gib/weights-gib",
                format!(
                    "weights of {} GiB leave no room for a KV cache on a {} GiB accelerator",
                    fmt_gib(d.weights_gib),
                    fmt_gib(d.gpu_mem_gib)
                ),
            ));
        }
        d.kv_gib = a.kv_gib.unwrap_or(d.gpu_mem_gib - d.weights_gib);
        if d.weights_gib + d.kv_gib > d.gpu_mem_gib + 1e-9 {
            return Err(csa2::Error::invalid(
                "kv-gib/weights-gib",
                format!(
                    "weights {} GiB + KV {} GiB exceed the accelerator's {} GiB",
                    fmt_gib(d.weights_gib),
                    fmt_gib(d.kv_gib),
                    fmt_gib(d.gpu_mem_gib)
                ),
            ));
        }
    }
    let free = d.kv_gib * (1u64 << 30) as f64;
    let bytes: serde_json::Map<String, serde_json::Value> = KvScheme::ALL
        .iter()
        .map(|l| {
            (
                l.as_str().to_string(),
                json!(g.global_kv_bytes_per_token(*l)),
            )
        })
        .collect();
    let swa: serde_json::Map<String, serde_json::Value> = KvScheme::ALL
        .iter()
        .map(|l| (l.as_str().to_string(), json!(g.swa_bytes_per_request(*l))))
        .collect();
    let fit: serde_json::Map<String, serde_json::Value> = KvScheme::ALL
        .iter()
        .map(|l| {
            (
                l.as_str().to_string(),
                json!(g.sessions_that_fit(*l, free, a.context)),
            )
        })
        .collect();
    if a.json.is_some() {
        let layers: Vec<_> = g
            .layers
            .iter()
            .map(|l| {
                json!({
                    "id": l.id, "role": l.role.as_str(), "ratio": l.ratio, "kv_source": l.kv_source,
                    "index_source": l.index_source, "candidates": l.candidates, "encoder": l.encoder,
                    "rope_theta": l.rope.theta, "yarn": l.rope.yarn.is_some(),
                })
            })
            .collect();
        let out = json!({
            "num_layers": g.num_layers,
            "layers": layers,
            "global_kv_bytes_per_token": bytes,
            "swa_bytes_per_request": g.swa_bytes_per_request(KvScheme::CSA2),
            "swa_bytes_per_request_by_layout": swa,
            "launch_day_note": LAUNCH_DAY_NOTE,
            "v4_flash_global_kv_bytes_per_token": CacheSpec::v4_flash().global_bytes_per_token(),
            "capacity": {
                "deployment": d,
                "gpu_mem_gib": d.gpu_mem_gib, "weights_gib": d.weights_gib, "kv_gib": d.kv_gib,
                "context": a.context,
                "sessions": fit,
            },
        });
        crate::out::write_json(&a.json, &out)?;
    }
    say!("layer  role      ratio  kv_src  idx_src  candidates  half     rope");
    for l in &g.layers {
        let opt = |o: Option<usize>| o.map_or("-".to_string(), |v| v.to_string());
        let cand = match l.candidates {
            CandidateUse::None => "",
            CandidateUse::Writes => "writes",
            CandidateUse::Reads => "reads",
        };
        let rope = format!(
            "θ={}{}",
            l.rope.theta,
            if l.rope.yarn.is_some() { "+YaRN" } else { "" }
        );
        say!(
            "{:>5}  {:<8}  {:>5}  {:>6}  {:>7}  {:<10}  {:<7}  {}",
            l.id,
            l.role.as_str(),
            l.ratio,
            opt(l.kv_source),
            opt(l.index_source),
            cand,
            if l.encoder { "encoder" } else { "decoder" },
            rope
        );
    }
    say!();
    say!(
        "global KV bytes per token:  nvfp4 {}  |  mxfp8 {}  |  v4 (launch-day records) {}",
        bytes["nvfp4"],
        bytes["mxfp8"],
        bytes["v4"]
    );
    say!("  {LAUNCH_DAY_NOTE}");
    say!(
        "  (the V4-Flash model itself, 21 CSA layers at 4:1 + 20 HCA at 128:1: {} B/token — what `csa2 trace` compares against)",
        CacheSpec::v4_flash().global_bytes_per_token()
    );
    say!(
        "SWA state per live request: {:.2} MB (nvfp4/mxfp8 layouts), {:.2} MB (v4)",
        g.swa_bytes_per_request(KvScheme::CSA2) as f64 / 1e6,
        g.swa_bytes_per_request(KvScheme::LAUNCH_DAY) as f64 / 1e6
    );
    say!(
        "capacity plan `{}`: {} GiB per GPU = {:.1} weights + {:.1} KV ({})",
        d.name,
        fmt_gib(d.gpu_mem_gib),
        d.weights_gib,
        d.kv_gib,
        d.source
    );
    say!(
        "  sessions of {} tokens in {:.1} GiB of KV: nvfp4 {}  mxfp8 {}  v4 {}",
        a.context,
        d.kv_gib,
        fit["nvfp4"],
        fit["mxfp8"],
        fit["v4"]
    );
    Ok(())
}

/// What the `v4` layout is, printed beside its figure (one name, one thing).
pub const LAUNCH_DAY_NOTE: &str =
    "v4 = V4.1's geometry (4 Full layers) stored in the launch-day records \
(584-B V4 main record + 132-B FP8 index K), i.e. what vLLM's launch-day backend keeps for V4.1";

fn fmt_gib(x: f64) -> String {
    format!("{x:.1}")
}
