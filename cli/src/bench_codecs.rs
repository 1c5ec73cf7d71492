use csa2::formats::fast::Isa;
use csa2::formats::{decode_rows_with, encode_rows_with, RecordFormat};
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Rows per call (each a 512- or 128-value latent).
    #[arg(long, default_value_t = 4096, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    rows: usize,
    /// Timed repetitions; the best is reported.
    #[arg(long, default_value_t = 15, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    reps: usize,
    /// Worker threads (0 = rayon's default, all cores).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    threads: usize,
    /// Write every figure as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<crate::out::JsonOut>,
}

/// Best wall time of `reps` runs of `f`, in seconds.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

pub fn run(a: Args) -> csa2::Result<()> {
    crate::out::json_dest(&a.json)?;
    if a.rows == 0 {
        return Err(csa2::Error::invalid("rows", "must be > 0"));
    }
    crate::out::in_pool(a.threads, || codecs(&a))
}

fn codecs(a: &Args) -> csa2::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut figures = vec![];
    {
        say!(
            "rows {}  threads {}  best of {}  (GB/s of f32 values: read by encode, written by decode)",
            a.rows,
            rayon::current_num_threads(),
            a.reps
        );
        say!(
            "{:<9} {:<7} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
            "format",
            "isa",
            "enc GB/s",
            "dec GB/s",
            "memcpy",
            "enc/cpy",
            "enc Mrow/s",
            "dec Mrow/s"
        );
    }
    for fmt in RecordFormat::ALL {
        let n = a.rows * fmt.dim();
        let x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let mut rec = vec![0u8; a.rows * fmt.record_bytes()];
        let mut y = vec![0f32; n];
        let mut copy = vec![0f32; n];
        let bytes = (n * 4) as f64;
        // The baseline: a plain copy of the same f32 bytes, measured in the same run.
        let t_copy = best(a.reps, || {
            copy.copy_from_slice(black_box(&x));
            black_box(&copy);
        });
        for isa in Isa::supported() {
            let t_enc = best(a.reps, || {
                encode_rows_with(isa, fmt, black_box(&x), &mut rec).expect("sizes are consistent");
                black_box(&rec);
            });
            let t_dec = best(a.reps, || {
                decode_rows_with(isa, fmt, black_box(&rec), &mut y).expect("sizes are consistent");
                black_box(&y);
            });
            let (enc, dec, cpy) = (
                bytes / t_enc / 1e9,
                bytes / t_dec / 1e9,
                bytes / t_copy / 1e9,
            );
            let (enc_rows, dec_rows) = (a.rows as f64 / t_enc / 1e6, a.rows as f64 / t_dec / 1e6);
            figures.push(serde_json::json!({
                "format": fmt.name(), "isa": isa.name(), "rows": a.rows,
                "threads": rayon::current_num_threads(),
                "encode_gbps": enc, "decode_gbps": dec, "memcpy_gbps": cpy,
                "encode_us": t_enc * 1e6, "decode_us": t_dec * 1e6, "memcpy_us": t_copy * 1e6,
            }));
            {
                say!(
                    "{:<9} {:<7} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2}",
                    fmt.name(),
                    isa.name(),
                    enc,
                    dec,
                    cpy,
                    enc / cpy,
                    enc_rows,
                    dec_rows
                );
            }
        }
    }
    crate::out::write_json(
        &a.json,
        &serde_json::json!({"rows": a.rows, "reps": a.reps, "figures": figures}),
    )?;
    Ok(())
}
