//! The driver API every launch goes through: cudarc's on a GPU build, the emulated device's
//! ([`super::emu`]) with feature `cuda-emu`. Launch code names types through this module only, so
//! both builds run the same launch functions.

#[cfg(not(feature = "cuda-emu"))]
pub use cudarc::driver::*;

#[cfg(feature = "cuda-emu")]
pub use super::emu::*;
