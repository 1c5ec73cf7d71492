use csa2::formats::scalar::{
    e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode, e8m0_encode_ceil,
};
use csa2::formats::{decode_rows, encode_rows, RecordFormat};
use csa2::Error;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// encode (f32 rows → records), decode (records → f32 rows), or sample (write --rows rows of
    /// seeded normal f32 values of the format's width: an input for encode).
    #[arg(value_parser = ["encode", "decode", "sample"])]
    op: String,
    /// Record format: nvfp4 (288 B), mxfp4 (68 B), mxfp8 (528 B), v4 (584 B), fp8index (132 B);
    /// or an element codec, one byte per value: e2m1 (code in the low nibble), e4m3 (saturating),
    /// e8m0 (encode = 2^ceil(log2 v), the scale rule).
    #[arg(long)]
    format: String,
    /// Input file: little-endian f32 values (encode) or records / codes back to back (decode).
    #[arg(long = "in", required_if_eq_any = [("op", "encode"), ("op", "decode")])]
    input: Option<PathBuf>,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// sample: rows to write (values, for an element codec).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    rows: usize,
    /// sample: seed of the values (standard normal).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::out::count::<u64>)]
    seed: u64,
}

/// One element format's scalar codec: (encode, decode).
type ElementCodec = (fn(f32) -> u8, fn(u8) -> f32);

fn element(name: &str) -> Option<ElementCodec> {
    match name {
        "e2m1" => Some((e2m1_encode, e2m1_decode)),
        "e4m3" => Some((e4m3_encode, e4m3_decode)),
        "e8m0" => Some((e8m0_encode_ceil, e8m0_decode)),
        _ => None,
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `codec sample`: `rows` rows of the format's width (one value per row for an element codec),
/// standard normal, seeded.
fn sample(a: &Args) -> csa2::Result<()> {
    use csa2_rng::{rand_normal, NewRng, Rng};
    let dim = match element(&a.format) {
        Some(_) => 1,
        None => record_format(&a.format)?.dim(),
    };
    let n = a
        .rows
        .checked_mul(dim)
        .filter(|&n| n <= 1 << 28)
        .ok_or_else(|| {
            Error::invalid(
                "rows",
                format!("{} rows of {dim} values is too many", a.rows),
            )
        })?;
    let x = rand_normal(&mut Rng::new(a.seed), n, 1.0);
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&a.out, &bytes).map_err(|e| Error::io(&a.out, e))?;
    println!(
        "sample {}: {} × {dim} f32 values (seed {}) → {} bytes in {}",
        a.format,
        crate::out::plural(a.rows, "row"),
        a.seed,
        bytes.len(),
        a.out.display()
    );
    Ok(())
}

fn record_format(name: &str) -> csa2::Result<RecordFormat> {
    RecordFormat::from_name(name).map_err(|_| {
        Error::invalid(
            "format",
            format!(
                "unknown format `{name}` (expected nvfp4, mxfp4, mxfp8, v4, fp8index, e2m1, e4m3 or e8m0)"
            ),
        )
    })
}

pub fn run(a: Args) -> csa2::Result<()> {
    if a.op == "sample" {
        return sample(&a);
    }
    let input = a
        .input
        .clone()
        .ok_or_else(|| Error::invalid("in", format!("`codec {}` needs --in FILE", a.op)))?;
    let bytes = std::fs::read(&input).map_err(|e| Error::io(&input, e))?;
    let encode = a.op == "encode";
    let out = if let Some((enc, dec)) = element(&a.format) {
        if encode {
            if bytes.len() % 4 != 0 {
                return Err(Error::Parse {
                    path: input.clone(),
                    reason: format!("{} bytes is not a whole number of f32 values", bytes.len()),
                });
            }
            f32s(&bytes).into_iter().map(enc).collect()
        } else {
            bytes.iter().flat_map(|&b| dec(b).to_le_bytes()).collect()
        }
    } else {
        let fmt = record_format(&a.format)?;
        if encode {
            let row_bytes = fmt.dim() * 4;
            if bytes.len() % row_bytes != 0 {
                return Err(Error::Parse {
                    path: input.clone(),
                    reason: format!(
                        "{} bytes is not a whole number of {}-value f32 rows ({} B each)",
                        bytes.len(),
                        fmt.dim(),
                        row_bytes
                    ),
                });
            }
            let x = f32s(&bytes);
            let mut recs = vec![0u8; x.len() / fmt.dim() * fmt.record_bytes()];
            encode_rows(fmt, &x, &mut recs)?;
            recs
        } else {
            if bytes.len() % fmt.record_bytes() != 0 {
                return Err(Error::Parse {
                    path: input.clone(),
                    reason: format!(
                        "{} bytes is not a whole number of {} records ({} B each)",
                        bytes.len(),
                        fmt.name(),
                        fmt.record_bytes()
                    ),
                });
            }
            let mut x = vec![0f32; bytes.len() / fmt.record_bytes() * fmt.dim()];
            decode_rows(fmt, &bytes, &mut x)?;
            x.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
    };
    std::fs::write(&a.out, &out).map_err(|e| Error::io(&a.out, e))?;
    let (what_in, what_out) = if encode {
        ("f32 values", "record bytes")
    } else {
        ("record bytes", "f32 bytes")
    };
    println!(
        "{} {}: {} {what_in} from {} → {} {what_out} in {}",
        a.op,
        a.format,
        if encode { bytes.len() / 4 } else { bytes.len() },
        input.display(),
        out.len(),
        a.out.display()
    );
    Ok(())
}
