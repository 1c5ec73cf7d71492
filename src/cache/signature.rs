//! The tensor signatures of the cache's record exports (`csa2_cache_write_entries`,
//! `csa2_cache_read_entries`, `csa2_cache_swa_write`, `csa2_cache_swa_read`, the compressor-state
//! pair). A row tensor has two forms: float rows of the record format's `dim` values (encoded or
//! decoded on the way), or uint8 records of its `record_bytes`; both sizes are bound from the
//! layer's format before the check ([`crate::shape::Dims::bind`]).

use crate::shape::{Arg, Dim};
use crate::tensor::{DType, FLOATS, INTS};

/// `[n]` int entry ids of the request's layer (−1 allowed where the export says so).
pub const ENTRIES: Arg = Arg::read("entries", INTS, &[Dim::Any("n")]);
/// `[n, dim]` float rows to store (encoded into the layer's format).
pub const SRC_ROWS: Arg = Arg::read("src", FLOATS, &[Dim::Any("n"), Dim::Any("dim")]);
/// `[n, record_bytes]` uint8 records to store: the other form of [`SRC_ROWS`].
pub const SRC_RECORDS: Arg = Arg::read(
    "src",
    &[DType::U8],
    &[Dim::Any("n"), Dim::Any("record_bytes")],
);
/// `[n, dim]` float rows read back (decoded).
pub const DST_ROWS: Arg = Arg::write("dst", FLOATS, &[Dim::Any("n"), Dim::Any("dim")]);
/// `[n, record_bytes]` uint8 records read back: the other form of [`DST_ROWS`].
pub const DST_RECORDS: Arg = Arg::write(
    "dst",
    &[DType::U8],
    &[Dim::Any("n"), Dim::Any("record_bytes")],
);
/// `[floats]` float32 compressor carry to set (null: clear it).
pub const STATE: Arg = Arg::read("state", &[DType::F32], &[Dim::Any("floats")]).optional();
/// `[floats]` float32 compressor carry read back (floats = the layer's carry size).
pub const STATE_OUT: Arg = Arg::write("out", &[DType::F32], &[Dim::Any("floats")]).optional();
