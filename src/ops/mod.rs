//! Op families (ARCHITECTURE.md): each has `mod.rs` (params, shape validation, dispatch), `cpu.rs`
//! (the fast CPU path) and `reference.rs` (readable f64 references used by tests and `csa2 check`).

pub mod mhc;
