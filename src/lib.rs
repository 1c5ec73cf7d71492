//! # csa2 — DeepSeek-V4.1-Flash's KV-cache design for an existing serving engine
//!
//! CSA2 attention (Full / Reindex / Reuse layers, lightning indexer, hierarchical candidate pool),
//! an FP4 KV cache that stores 890 bytes per token, SWA bounded replay with persistent SSD / DRAM
//! tiers, and fused mHC — one backend with three faces: this Rust API, the C ABI
//! (`include/csa2.h`) and the `csa2` CLI
//! (the `csa2-cli` crate, over this library and the `csa2-harness` crate of measurements).
//!
//! The normative rules are in docs/SPEC.md (sections cited on each item); the released model
//! geometry is compiled in ([`geometry::Geometry::embedded`]).
#![deny(missing_docs)]

pub mod backend;
pub mod cache;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod ffi;
pub mod formats;
pub mod geometry;
pub mod isa;
pub mod ops;
pub mod replay;
pub mod shape;
pub mod store;
pub mod tensor;
pub mod tolerance;
pub mod weights;

pub use error::{Error, Result};
pub use formats::KvScheme;
pub use geometry::{Geometry, LayerPlan, Role};
