use csa2::geometry::{CandidateUse, KvLayout};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face config.json (default: the released DeepSeek-V4.1-Flash config, compiled in).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Accelerator memory in GiB for the capacity plan (141 ≈ one H200).
    #[arg(long, default_value_t = 141.0)]
    gpu_mem_gib: f64,
    /// Memory taken by weights and activations on that accelerator, GiB.
    #[arg(long, default_value_t = 0.0)]
    weights_gib: f64,
    /// Context length (tokens) per session for the capacity plan.
    #[arg(long, default_value_t = 1 << 20)]
    context: usize,
}

pub fn run(a: Args) -> csa2::Result<()> {
    let g = crate::load_geometry(a.config.as_deref())?;
    if !(a.gpu_mem_gib.is_finite()
        && a.weights_gib.is_finite()
        && a.gpu_mem_gib >= 0.0
        && a.weights_gib >= 0.0)
    {
        return Err(csa2::Error::invalid(
            "gpu-mem-gib/weights-gib",
            "must be finite and ≥ 0",
        ));
    }
    let free = (a.gpu_mem_gib - a.weights_gib) * (1u64 << 30) as f64;
    let bytes: serde_json::Map<String, serde_json::Value> = KvLayout::ALL
        .iter()
        .map(|l| {
            (
                l.as_str().to_string(),
                json!(g.global_kv_bytes_per_token(*l)),
            )
        })
        .collect();
    let swa: serde_json::Map<String, serde_json::Value> = KvLayout::ALL
        .iter()
        .map(|l| (l.as_str().to_string(), json!(g.swa_bytes_per_request(*l))))
        .collect();
    let fit: serde_json::Map<String, serde_json::Value> = KvLayout::ALL
        .iter()
        .map(|l| {
            (
                l.as_str().to_string(),
                json!(g.sessions_that_fit(*l, free, a.context)),
            )
        })
        .collect();
    if a.json {
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
            "swa_bytes_per_request": g.swa_bytes_per_request(KvLayout::Nvfp4),
            "swa_bytes_per_request_by_layout": swa,
            "capacity": {
                "gpu_mem_gib": a.gpu_mem_gib, "weights_gib": a.weights_gib, "context": a.context,
                "sessions": fit,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
        return Ok(());
    }
    println!("layer  role      ratio  kv_src  idx_src  candidates  half     rope");
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
        println!(
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
    println!();
    println!(
        "global KV bytes per token:  nvfp4 {}  |  mxfp8 {}  |  v4 (launch-day) {}",
        bytes["nvfp4"], bytes["mxfp8"], bytes["v4"]
    );
    println!(
        "SWA state per live request: {:.2} MB (nvfp4/mxfp8 layouts), {:.2} MB (v4)",
        g.swa_bytes_per_request(KvLayout::Nvfp4) as f64 / 1e6,
        g.swa_bytes_per_request(KvLayout::V4) as f64 / 1e6
    );
    println!(
        "capacity: {:.1} GiB free ({} − {} GiB weights), {} tokens/session → sessions: nvfp4 {}  mxfp8 {}  v4 {}",
        a.gpu_mem_gib - a.weights_gib,
        a.gpu_mem_gib,
        a.weights_gib,
        a.context,
        fit["nvfp4"],
        fit["mxfp8"],
        fit["v4"]
    );
    Ok(())
}
