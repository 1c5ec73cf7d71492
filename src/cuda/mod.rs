//! CUDA kernels (feature `cuda`): compiled by `build.rs` from `kernels/*.cu` for sm_90a (H100/H200)
//! and sm_100a (B200), embedded in the library, and launched through cudarc.
//!
//! - [`Device`]: opens a GPU only when a CUDA driver library is present (otherwise
//!   [`Error::Unsupported`](crate::Error::Unsupported), never a panic), loads each embedded module
//!   once per device (fatbin → PTX → compat PTX → NVRTC, see [`modules`]), and checks every launch.
//! - One wrapper per kernel family, each in two forms: a host form (takes host slices, copies in,
//!   launches, copies back; for tests, the CLI and validation) and a `_dev` form over device buffers
//!   (for the backend): [`formats`], [`compressor`], [`indexer`], [`attention`], [`mhc`].
//!
//! The launch code lives here rather than in `ops/<family>/cuda.rs` (ARCHITECTURE) because the ops
//! folders were being written in parallel; `docs/DESIGN.md` records the decision.
//!
//! Numerics follow the CPU semantics of docs/SPEC.md §1–§4: codecs are bit-identical to
//! [`crate::formats`]; float reductions differ from the CPU only in summation order.

pub mod compressor;
pub(crate) mod device;
pub mod formats;
pub mod indexer;
pub mod mhc;
pub mod modules;

/// The attention kernels' launch code lives with the family (`ops::attention::cuda`).
pub use crate::ops::attention::cuda as attention;

pub use device::{Device, DeviceBuffer};
pub use modules::{LoadPath, EXPECTED_KERNELS};
