//! Shared support of the CUDA tests and the GPU validation binary.
pub mod checks;
pub mod reference;
