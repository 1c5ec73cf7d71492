//! Mooncake trace reader (FAST'25 release format; docs/SPEC.md §6).
//!
//! One JSON object per line: `timestamp` (ms from the trace start), `input_length` and
//! `output_length` (tokens), `hash_ids` (one id per 512-token prompt block, the last one possibly
//! partial; equal ids at equal positions mean a reusable prefix).
//!
//! [`read`] takes plain `.jsonl` or gzip-compressed `.jsonl.gz` (recognised by the gzip magic
//! bytes, not the name), so the full trace shipped as [`FULL_TRACE`] reads like any other file.

use csa2::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Tokens per `hash_ids` block in Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// The first 300 requests of the Mooncake conversation trace, shipped for tests and as the
/// default input of `csa2 trace`.
pub const EXCERPT: &str = include_str!("../../../assets/mooncake_conversation_excerpt.jsonl");

/// The full Mooncake conversation trace (12,031 requests, one hour; kvcache-ai/Mooncake FAST'25
/// release, Apache-2.0, see `assets/NOTICE`), shipped gzip-compressed, relative to the
/// repository root. Its first 300 lines are [`EXCERPT`].
pub const FULL_TRACE: &str = "assets/mooncake_conversation_trace.jsonl.gz";

/// The two bytes every gzip member starts with (RFC 1952 §2.3.1).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time, ms.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Generated tokens.
    pub output_length: usize,
    /// Prefix-block ids, one per 512 prompt tokens.
    pub hash_ids: Vec<u64>,
}

/// Parses a JSONL trace; `path` only names the source in errors.
///
/// Errors: [`Error::Parse`] naming the line for malformed JSON, a zero `input_length`, a
/// `hash_ids` count that does not match `ceil(input_length / 512)`, or a timestamp earlier than
/// the previous line's.
pub fn parse(text: &str, path: &Path) -> Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    let mut last_ts = 0;
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| Error::Parse {
            path: path.to_path_buf(),
            reason: format!("line {}: {reason}", n + 1),
        };
        let r: TraceRequest = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if r.input_length == 0 {
            return Err(bad("input_length is 0".into()));
        }
        let want = r.input_length.div_ceil(TRACE_BLOCK_TOKENS);
        if r.hash_ids.len() != want {
            return Err(bad(format!(
                "{} hash_ids for input_length {} (expected {want})",
                r.hash_ids.len(),
                r.input_length
            )));
        }
        if r.timestamp < last_ts {
            return Err(bad(format!(
                "timestamp {} goes back (previous {last_ts})",
                r.timestamp
            )));
        }
        last_ts = r.timestamp;
        out.push(r);
    }
    Ok(out)
}

/// Reads and parses a trace file, plain JSONL or gzip-compressed JSONL (every member of a
/// multi-member gzip file is read).
///
/// Errors: [`Error::Io`] when the file cannot be read; [`Error::Parse`] naming the file for a
/// corrupt or truncated gzip stream, text that is not UTF-8, or any error [`parse`] reports.
pub fn read(path: &Path) -> Result<Vec<TraceRequest>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let bad = |reason: String| Error::Parse {
        path: path.to_path_buf(),
        reason,
    };
    let text = if bytes.starts_with(&GZIP_MAGIC) {
        use std::io::Read;
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(bytes.as_slice())
            .read_to_string(&mut text)
            .map_err(|e| bad(format!("gzip stream: {e}")))?;
        text
    } else {
        String::from_utf8(bytes).map_err(|e| bad(format!("not UTF-8 text: {e}")))?
    };
    parse(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpt_parses() {
        let t = parse(EXCERPT, Path::new("excerpt")).unwrap();
        assert_eq!(t.len(), 300);
        assert_eq!(t[0].input_length, 6758);
        assert_eq!(t[0].hash_ids.len(), 14);
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse(
            "{\"timestamp\":0,\"input_length\":5,\"output_length\":1,\"hash_ids\":[1]}\n{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1]}",
            Path::new("t.jsonl"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        assert!(parse("{", Path::new("t")).is_err());
    }

    fn shipped_full_trace() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(FULL_TRACE)
    }

    /// The shipped full trace reads through the gzip path: every request, and its first 300
    /// lines are the excerpt the CLI embeds.
    #[test]
    fn full_trace_ships_gzipped_and_reads() {
        let full = read(&shipped_full_trace()).unwrap();
        assert_eq!(full.len(), 12_031);
        let excerpt = parse(EXCERPT, Path::new("excerpt")).unwrap();
        assert_eq!(&full[..excerpt.len()], excerpt.as_slice());
        // One hour of traffic, as the release describes it.
        let last = full.last().unwrap().timestamp;
        assert!((3_000_000..=3_600_000).contains(&last), "{last}");
    }

    /// Plain and gzip files with the same text give the same requests; a truncated or corrupt
    /// gzip file and non-UTF-8 text are errors naming the file, never a short trace.
    #[test]
    fn gzip_and_plain_read_alike_and_damage_is_an_error() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("t.jsonl");
        std::fs::write(&plain, EXCERPT).unwrap();
        let gz = dir.path().join("t.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(EXCERPT.as_bytes()).unwrap();
        let packed = enc.finish().unwrap();
        std::fs::write(&gz, &packed).unwrap();
        assert_eq!(read(&plain).unwrap(), read(&gz).unwrap());

        let cut = dir.path().join("cut.jsonl.gz");
        std::fs::write(&cut, &packed[..packed.len() / 2]).unwrap();
        let e = read(&cut).unwrap_err().to_string();
        assert!(e.contains("cut.jsonl.gz") && e.contains("gzip"), "{e}");

        let mut flipped = packed.clone();
        let n = flipped.len();
        flipped[n - 6] ^= 0xff; // inside the CRC32 / length trailer
        let bad = dir.path().join("bad.jsonl.gz");
        std::fs::write(&bad, &flipped).unwrap();
        assert!(read(&bad).unwrap_err().to_string().contains("gzip"));

        let latin = dir.path().join("latin.jsonl");
        std::fs::write(&latin, [0xff, 0xfe, b'{']).unwrap();
        assert!(read(&latin).unwrap_err().to_string().contains("UTF-8"));
    }
}
