//! The C ABI (`include/csa2.h`).
//!
//! Placeholder module root on the `shim` branch; the `found` branch owns this file (status codes,
//! thread-local last error, the boundary macro, handles) and the lead merges the two.

pub mod dlpack;
