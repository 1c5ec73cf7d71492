//! The DeepSeek-V4.1-Flash dimensions and scalars that code is compiled for: register arrays and
//! shared-memory tiles in the CUDA kernels, fixed-size rows in the CPU ops and record formats.
//!
//! One definition, read twice: the crate uses these constants (`formats::KV_DIM`,
//! `ops::attention::HEADS`, `ops::mhc::HC`, the kernels' launch checks …), and `build.rs` includes
//! this file by path and hands every entry of [`KERNEL_DEFINES`] to nvcc as `-D CSA2_<NAME>` (and
//! prepends it to the NVRTC source), so no `.cu` file writes a model dimension as a literal. A test
//! checks each value against the embedded `config.json` ([`super::Geometry::embedded`]); a
//! geometry with other values runs on the CPU paths that take them at run time, and each CUDA
//! launch refuses it with `Error::Unsupported`.
//!
//! This file must not use anything from the crate (build.rs compiles it on its own).

/// Query heads (`num_attention_heads`).
pub const HEADS: usize = 64;
/// Latent width: values per main-KV / SWA row and per attention head (`head_dim` = NoPE + RoPE).
pub const KV_DIM: usize = 512;
/// Rotated dims at the end of each latent and index-K row (`qk_rope_head_dim`).
pub const ROPE_DIM: usize = 64;
/// SWA window in tokens (`sliding_window`).
pub const WINDOW: usize = 128;
/// Indexer heads (`index_n_heads`).
pub const INDEX_HEADS: usize = 32;
/// Index-K / index-Q head dim (`index_head_dim`).
pub const INDEX_DIM: usize = 128;
/// Model width d (`hidden_size`); the largest stream width the CUDA mHC kernel's shared memory holds.
pub const HIDDEN_SIZE: usize = 5120;
/// Hyper-connection streams (`hc_mult`).
pub const HC: usize = 4;
/// Mix coefficients per token: pre (HC) + post (HC) + comb (HC × HC).
pub const MIX: usize = 2 * HC + HC * HC;
/// Sinkhorn iterations of the comb matrix, counting the first column normalization
/// (`hc_sinkhorn_iters`).
pub const HC_SINKHORN_ITERS: usize = 20;
/// `hc_eps`: added to pre, to the comb softmax and to every Sinkhorn denominator.
pub const HC_EPS: f64 = 1e-6;
/// Multiplier of the post sigmoid (vLLM `hc_post_mult`).
pub const HC_POST_MULT: f64 = 2.0;
/// RMSNorm epsilon (`rms_norm_eps`).
pub const RMS_NORM_EPS: f64 = 1e-20;
/// Entries per candidate-pool block (`candidate_block_size`).
pub const CANDIDATE_BLOCK_SIZE: usize = 8;

/// One `-D` define for the kernels: its C name and value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelDefine {
    /// An `int` constant.
    Int(&'static str, usize),
    /// A `float` constant (written as an f32 literal, `1e-20f`).
    Float(&'static str, f64),
}

impl KernelDefine {
    /// The define's name, `CSA2_…`.
    pub const fn name(&self) -> &'static str {
        match self {
            KernelDefine::Int(n, _) | KernelDefine::Float(n, _) => n,
        }
    }
    /// The define's value as C source.
    pub fn c_value(&self) -> String {
        match self {
            KernelDefine::Int(_, v) => format!("{v}"),
            // `{:?}` of an f64 round-trips and always has a '.' or an exponent ("2.0", "1e-20").
            KernelDefine::Float(_, v) => format!("{v:?}f"),
        }
    }
}

/// Every constant the kernels are compiled with (kernels/common.cuh refuses to compile without
/// them).
pub const KERNEL_DEFINES: &[KernelDefine] = &[
    KernelDefine::Int("CSA2_HEADS", HEADS),
    KernelDefine::Int("CSA2_KV_DIM", KV_DIM),
    KernelDefine::Int("CSA2_ROPE_DIM", ROPE_DIM),
    KernelDefine::Int("CSA2_WINDOW", WINDOW),
    KernelDefine::Int("CSA2_INDEX_HEADS", INDEX_HEADS),
    KernelDefine::Int("CSA2_INDEX_DIM", INDEX_DIM),
    KernelDefine::Int("CSA2_HIDDEN_SIZE", HIDDEN_SIZE),
    KernelDefine::Int("CSA2_HC", HC),
    KernelDefine::Int("CSA2_MIX", MIX),
    KernelDefine::Int("CSA2_HC_SINKHORN_ITERS", HC_SINKHORN_ITERS),
    KernelDefine::Float("CSA2_HC_EPS", HC_EPS),
    KernelDefine::Float("CSA2_HC_POST_MULT", HC_POST_MULT),
    KernelDefine::Float("CSA2_RMS_NORM_EPS", RMS_NORM_EPS),
    KernelDefine::Int("CSA2_CANDIDATE_BLOCK_SIZE", CANDIDATE_BLOCK_SIZE),
];
