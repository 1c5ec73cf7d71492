//! CUDA plumbing (feature `cuda`): the device, the embedded kernel modules and the launch helpers.
//! The kernels themselves are compiled by `build.rs` from `kernels/*.cu` for sm_90a (H100/H200) and
//! sm_100a (B200), embedded in the library, and launched through cudarc.
//!
//! - [`CudaDevice`]: opens a GPU only when a CUDA driver library is present (otherwise
//!   [`Error::Unsupported`](crate::Error::Unsupported), never a panic), loads each embedded module
//!   once per device (fatbin → PTX → compat PTX → NVRTC, see [`modules`]), and checks every launch.
//! - Each op's launch sits beside its CPU path, with the same parameter types, and is tested
//!   against the same f64 reference: `ops/<family>/cuda.rs` (compressor, indexer, topk,
//!   candidates, mhc, attention) and `formats/cuda.rs` (the record codecs over cache pages);
//!   [`attention`] re-exports `ops::attention::cuda` under its earlier path.
//!
//! Numerics follow the CPU semantics of docs/SPEC.md §1–§4: codecs are bit-identical to
//! [`crate::formats`]; float reductions differ from the CPU only in summation order.

pub(crate) mod device;
pub mod driver;
#[cfg(feature = "cuda-emu")]
pub mod emu;
pub mod modules;
pub mod shapes;

/// The attention kernels' launch code lives with the family (`ops::attention::cuda`).
pub use crate::ops::attention::cuda as attention;

/// The driver crate a GPU build launches through (the NVRTC test and the validation binary use it
/// directly); tests reach the driver API through [`driver`], which is cudarc's or the emulator's.
#[cfg(not(feature = "cuda-emu"))]
pub use cudarc;
pub use device::{sass_arch, CudaDevice, DeviceBuffer};
pub use modules::{LoadPath, EXPECTED_KERNELS};
