//! Shared support of the CUDA tests and the GPU validation binary. The f64 references are the
//! library's own (`csa2::ops::<family>::reference`, `csa2::formats`), the same the CPU tests use.
pub mod checks;
pub mod host;
