//! GPU validation: every CUDA kernel against the CPU path at model shapes on fresh random inputs,
//! then timed (CUDA events, 3 warm-ups, median of N) beside the device's measured copy bandwidth.
//!
//! Run through `tests/gpu/validate.sh` (it builds this with `--features cuda` and keeps the log);
//! directly: `cargo run --release --features cuda --example gpu_validate -- [--iters N] [--seed S]
//! [--small] [--model-json PATH]`. `--model-json` also writes the split kernels' decode model
//! (blocks, SMs covered, blocks per SM from this build's ptxas figures, waves, bytes, partials,
//! FLOPs per batch and context) for `tests/gpu/check_attention.py --model`, which prints it beside
//! its measured times. Exit status 0 only when every check passed; 2 when there is no GPU.

#[path = "../tests/cuda_support/mod.rs"]
mod cuda_support;

use csa2::cuda::CudaDevice;
use cuda_support::checks::{self, Size};

fn main() {
    let mut iters = 50usize;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(1);
    let mut small = false;
    let mut model_json: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iters" => iters = args.next().and_then(|v| v.parse().ok()).expect("--iters N"),
            "--seed" => seed = args.next().and_then(|v| v.parse().ok()).expect("--seed S"),
            "--small" => small = true,
            "--model-json" => model_json = Some(args.next().expect("--model-json PATH")),
            other => {
                eprintln!(
                    "unknown argument {other}; usage: gpu_validate [--iters N] [--seed S] \
                     [--small] [--model-json PATH]"
                );
                std::process::exit(64);
            }
        }
    }
    println!(
        "csa2 GPU validation — seed {seed}, {iters} timed iterations, kernels built by {}",
        csa2::cuda::modules::NVCC_VERSION
    );
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("SKIPPED: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "device: {} (compute capability {}.{})",
        dev.name(),
        dev.compute_capability().0,
        dev.compute_capability().1
    );
    match dev.preload_all() {
        Ok(paths) => {
            for (m, p) in paths {
                println!("module {m:<11} loaded via {p}");
            }
        }
        Err(e) => {
            println!("FAIL: cannot load the kernel modules: {e}");
            std::process::exit(1);
        }
    }
    let bw = match checks::copy_bandwidth(&dev, 20) {
        Ok(b) => b,
        Err(e) => {
            println!("FAIL: copy bandwidth: {e}");
            std::process::exit(1);
        }
    };
    println!("measured device copy bandwidth (read + write, 1 GiB memcpy D2D): {bw:.0} GB/s\n");
    let model = print_decode_model(&dev, bw);
    if let Some(path) = &model_json {
        let text = serde_json::to_string_pretty(&model).expect("plain JSON values");
        if let Err(e) = std::fs::write(path, text) {
            println!("FAIL: writing {path}: {e}");
            std::process::exit(1);
        }
        println!("decode model written to {path}\n");
    }

    let size = Size {
        large: !small,
        iters,
    };
    let mut failed = 0;
    let mut rows = vec![];
    for (name, r) in checks::all(&dev, size, seed) {
        match r {
            Ok(rep) => {
                println!("== {} — {}", rep.name, if rep.ok { "PASS" } else { "FAIL" });
                print!("{}", rep.detail);
                if !rep.ok {
                    failed += 1;
                }
                if let Some((us, bytes)) = rep.timing {
                    let gbs = bytes / (us * 1e-6) / 1e9;
                    rows.push(format!(
                        "| {:<48} | {:>10.1} | {:>8.0} | {:>5.1} % |",
                        rep.name,
                        us,
                        gbs,
                        100.0 * gbs / bw
                    ));
                }
            }
            Err(e) => {
                failed += 1;
                println!("== {name} — FAIL (error: {e})");
            }
        }
    }
    println!("\n| kernel | µs (median) | GB/s | % of copy bw |\n|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    println!("\ncopy bandwidth baseline: {bw:.0} GB/s; {failed} check(s) failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

/// The split attention kernel's performance model for this device (modeled, not measured): blocks
/// per SM from this build's ptxas figures, the SM count from the driver, the roofline from the
/// copy bandwidth measured above and the bf16 dense tensor rate of the datasheet (989 TFLOP/s on
/// H100 SXM / H200; no matmul is timed here). The measured times are `tests/gpu/check_attention.py`'s,
/// which prints this model beside them (`--model`, from `--model-json`) with the roofline from its
/// own measured copy and matmul. Returns the model as JSON: the device's SM count and, per split kernel (by its
/// `CSA2_ATTENTION_KERNEL` name), its ptxas figures, blocks per SM and rows.
fn print_decode_model(dev: &CudaDevice, bw: f64) -> serde_json::Value {
    let mut kernels = serde_json::Map::new();
    use csa2::ops::attention::cuda::PoolsKernel;
    use csa2::ops::attention::decode_model::{blocks_per_sm, decode_table, HOPPER};
    let arch = dev.arch().unwrap_or("sm_90a");
    for kernel in [PoolsKernel::Split, PoolsKernel::SplitH32] {
        let name = kernel.entry();
        let fig = csa2::cuda::modules::PTXAS
            .iter()
            .find(|f| f.0 == name && f.1 == arch);
        let Some(&(_, _, regs, smem, _, _, _)) = fig else {
            println!("decode model: no ptxas figures for {name} on {arch} in this build\n");
            continue;
        };
        let bps = blocks_per_sm(regs, smem, 256, &HOPPER);
        let tflops = 989.0;
        println!(
            "decode attention model (MODELED; {} SMs, {name} {regs} registers, {smem} B shared \
             → {bps} block(s)/SM; {bw:.0} GB/s measured copy, {tflops} TFLOP/s datasheet bf16):",
            dev.sm_count()
        );
        println!("  batch context  chunk splits blocks SMs  waves   MB  partials MB  GFLOP  roofline µs  plan floor µs");
        let rows = decode_table(dev.sm_count(), (kernel.heads_per_block(), bps), bw, tflops);
        kernels.insert(
            kernel.setting().to_string(),
            serde_json::json!({
                "entry": name,
                "registers": regs,
                "shared_bytes": smem,
                "blocks_per_sm": bps,
                "rows": rows.iter().map(|r| serde_json::json!({
                    "batch": r.tokens,
                    "context": r.context,
                    "chunk_keys": r.plan.chunk_keys,
                    "splits": r.plan.splits,
                    "blocks": r.blocks,
                    "sms_covered": r.sms_covered,
                    "waves": r.waves,
                    "bytes": r.bytes,
                    "partial_bytes": r.partial_bytes,
                    "flops": r.flops,
                })).collect::<Vec<_>>(),
            }),
        );
        for r in rows {
            println!(
                "  {:>5} {:>7} {:>6} {:>6} {:>6} {:>4} {:>6} {:>7.2} {:>9.2} {:>7.2} {:>11.2} {:>11.2}",
                r.tokens,
                if r.context >= 1 << 20 {
                    "1M".to_string()
                } else {
                    format!("{}K", r.context >> 10)
                },
                r.plan.chunk_keys,
                r.plan.splits,
                r.blocks,
                r.sms_covered,
                r.waves,
                r.bytes / 1e6,
                r.partial_bytes / 1e6,
                r.flops / 1e9,
                r.roofline_us,
                r.coverage_floor_us
            );
        }
        println!();
    }
    serde_json::json!({
        "device": dev.name(),
        "sm_count": dev.sm_count(),
        "arch": arch,
        "copy_GBps": bw,
        "kernels": kernels,
    })
}
