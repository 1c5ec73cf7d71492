//! Mooncake trace reader (FAST'25 release format; SPEC §6).
//!
//! One JSON object per line: `timestamp` (ms from the trace start), `input_length` and
//! `output_length` (tokens), `hash_ids` (one id per 512-token prompt block, the last one possibly
//! partial; equal ids at equal positions mean a reusable prefix).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Tokens per `hash_ids` block in Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// The first 300 requests of the Mooncake conversation trace, shipped for tests and as the
/// default input of `csa2 trace`.
pub const EXCERPT: &str = include_str!("../../assets/mooncake_conversation_excerpt.jsonl");

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

/// Reads and parses a trace file.
pub fn read(path: &Path) -> Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
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
}
