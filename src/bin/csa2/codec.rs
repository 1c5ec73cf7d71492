use csa2::formats::{decode_rows, encode_rows, RecordFormat};
use csa2::Error;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// encode (f32 rows → records) or decode (records → f32 rows).
    #[arg(value_parser = ["encode", "decode"])]
    op: String,
    /// Record format: nvfp4 (288 B), mxfp4 (68 B), mxfp8 (528 B), v4 (584 B), fp8index (132 B).
    #[arg(long)]
    format: String,
    /// Input file: little-endian f32 rows (encode) or records back to back (decode).
    #[arg(long = "in")]
    input: PathBuf,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args) -> csa2::Result<()> {
    let fmt = RecordFormat::from_name(&a.format)?;
    let bytes = std::fs::read(&a.input).map_err(|e| Error::io(&a.input, e))?;
    let out = if a.op == "encode" {
        let row_bytes = fmt.dim() * 4;
        if bytes.len() % row_bytes != 0 {
            return Err(Error::Parse {
                path: a.input.clone(),
                reason: format!(
                    "{} bytes is not a whole number of {}-value f32 rows ({} B each)",
                    bytes.len(),
                    fmt.dim(),
                    row_bytes
                ),
            });
        }
        let x: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut recs = vec![0u8; x.len() / fmt.dim() * fmt.record_bytes()];
        encode_rows(fmt, &x, &mut recs)?;
        recs
    } else {
        if bytes.len() % fmt.record_bytes() != 0 {
            return Err(Error::Parse {
                path: a.input.clone(),
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
    };
    std::fs::write(&a.out, out).map_err(|e| Error::io(&a.out, e))?;
    Ok(())
}
