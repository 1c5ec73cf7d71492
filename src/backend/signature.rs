//! The tensor signature of one engine step (`csa2_engine_step`, the C face of
//! [`crate::backend::Backend::run_plan`]): token ids in, the output rows' final hidden state and
//! their positions and request ids out. `T` is the step's rows (the sum of its sequences' `len`),
//! `rows` the output rows the planner keeps (decoder bounded replay trims a prefill chunk to its
//! last `window` rows), `d` the model's hidden size; `T`, `rows` and `d` are bound from the plan
//! and the geometry before the tensors are checked.

use crate::shape::{Arg, Dim, Signature};
use crate::tensor::{DType, FLOATS, INTS};

/// `[T]` int token ids, one per row, requests in step order, each request's rows by position
/// (values `0 ..= u32::MAX`).
pub const TOKENS: Arg = Arg::read("tokens", INTS, &[Dim::Any("T")]);
/// `[rows, d]` float final hidden state of the output rows (float32 exact; bfloat16 / float16
/// rounded to nearest even). Absent: the step is planned, not run (count only).
pub const HIDDEN: Arg = Arg::write("hidden", FLOATS, &[Dim::Any("rows"), Dim::Any("d")]).optional();
/// `[rows]` int64 absolute position of each output row.
pub const POSITIONS: Arg = Arg::write("positions", &[DType::I64], &[Dim::Any("rows")]).optional();
/// `[rows]` int64 request id of each output row (the `uint64` id's bits).
pub const REQUESTS: Arg = Arg::write("requests", &[DType::I64], &[Dim::Any("rows")]).optional();
/// `csa2_engine_step`.
pub const STEP: Signature = Signature {
    op: "engine_step",
    args: &[TOKENS, HIDDEN, POSITIONS, REQUESTS],
};
