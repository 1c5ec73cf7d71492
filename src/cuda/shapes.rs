//! Launch shapes that a kernel and its launch must agree on (threads per block, work per block).
//!
//! One definition, read twice: the launches in `ops/*/cuda.rs` and `formats/cuda.rs` use these
//! constants for their grids, and `build.rs` includes this file by path and hands every entry of
//! [`LAUNCH_DEFINES`] to nvcc as `-D CSA2_<NAME>`, so a kernel's tile and its grid cannot drift.
//!
//! This file must not use anything from the crate (build.rs compiles it on its own).

/// `kernels/kv_cache.cu`: records per block (one warp per record).
pub const KV_ROWS_PER_BLOCK: usize = 4;
/// `kernels/kv_cache.cu`: threads per block.
pub const KV_THREADS: usize = 32 * KV_ROWS_PER_BLOCK;
/// `kernels/compressor.cu`: threads per block (one per index-K dim; the kernel checks that).
pub const COMPRESSOR_THREADS: usize = 128;
/// `kernels/indexer.cu` `indexer_logits_f32`: entries one block scores.
pub const INDEXER_ENTRIES_PER_BLOCK: usize = 64;
/// `kernels/indexer.cu` `indexer_logits_f32`: threads per block (4 warps, one entry each at a time).
pub const INDEXER_THREADS: usize = 128;
/// `kernels/indexer.cu` candidate kernels: threads per block.
pub const CANDIDATE_THREADS: usize = 256;
/// `kernels/mhc.cu`: tokens one block handles (they share the `hc_fn` reads).
pub const MHC_TOKENS_PER_BLOCK: usize = 4;
/// `kernels/mhc.cu`: threads per block.
pub const MHC_THREADS: usize = 256;
/// `kernels/topk.cu`: threads per block (the radix select needs exactly this many).
pub const TOPK_THREADS: usize = 1024;
/// `kernels/topk.cu`: the most entries one row's selection may hold when it is sorted into the
/// order contract in shared memory (a power of two; 8 B each: 32 KiB). A CUDA top-k with a larger
/// k is refused.
pub const TOPK_SORT_MAX: usize = 4096;
/// `kernels/attention.cu`: threads per block of every attention kernel.
pub const ATTN_THREADS: usize = 256;
/// `kernels/attention.cu`: heads per block of the f32 kernels (16 threads per head).
pub const ATTN_HEADS_PER_BLOCK: usize = 16;
/// `kernels/attention.cu`: heads per block of the tensor-core kernel (4 warps × 16-head tiles).
pub const ATTN_MMA_HEADS_PER_BLOCK: usize = 64;
/// `kernels/attention.cu` `attn_pools_bf16_split_h32`: heads per block (2 × 16-head tiles, each
/// warp a quarter of the dims).
pub const ATTN_SPLIT_H32_HEADS_PER_BLOCK: usize = 32;
/// `kernels/attention.cu` `attn_pools_combine`: heads per block (one warp each).
pub const ATTN_COMBINE_HEADS_PER_BLOCK: usize = ATTN_THREADS / 32;

/// Element-type codes of float tensor arguments whose dtype is a launch parameter (the pooled
/// indexer's `q`, `w` and logits accept what the host entry accepts: f32, bf16, f16).
pub const DTYPE_F32: usize = 0;
/// bf16 (see [`DTYPE_F32`]).
pub const DTYPE_BF16: usize = 1;
/// IEEE half (see [`DTYPE_F32`]).
pub const DTYPE_F16: usize = 2;

/// Every launch shape and code the kernels are compiled with, as `(name, value)`.
pub const LAUNCH_DEFINES: &[(&str, usize)] = &[
    ("CSA2_DTYPE_F32", DTYPE_F32),
    ("CSA2_DTYPE_BF16", DTYPE_BF16),
    ("CSA2_DTYPE_F16", DTYPE_F16),
    ("CSA2_KV_ROWS_PER_BLOCK", KV_ROWS_PER_BLOCK),
    ("CSA2_KV_THREADS", KV_THREADS),
    ("CSA2_COMPRESSOR_THREADS", COMPRESSOR_THREADS),
    ("CSA2_INDEXER_ENTRIES_PER_BLOCK", INDEXER_ENTRIES_PER_BLOCK),
    ("CSA2_INDEXER_THREADS", INDEXER_THREADS),
    ("CSA2_CANDIDATE_THREADS", CANDIDATE_THREADS),
    ("CSA2_MHC_TOKENS_PER_BLOCK", MHC_TOKENS_PER_BLOCK),
    ("CSA2_MHC_THREADS", MHC_THREADS),
    ("CSA2_TOPK_THREADS", TOPK_THREADS),
    ("CSA2_TOPK_SORT_MAX", TOPK_SORT_MAX),
    ("CSA2_ATTN_THREADS", ATTN_THREADS),
    ("CSA2_ATTN_HEADS_PER_BLOCK", ATTN_HEADS_PER_BLOCK),
    ("CSA2_ATTN_MMA_HEADS_PER_BLOCK", ATTN_MMA_HEADS_PER_BLOCK),
];

/// The GPUs csa2 ships SASS for: compute capability → the `-arch` its image is built for (build.rs
/// puts one image per row in every module's fatbin, plus sm_80 PTX the driver JITs on any other
/// GPU of compute capability ≥ 8.0; nothing older has the bf16 `mma.sync` the kernels use).
pub const SASS_ARCHS: &[((i32, i32), &str)] = &[
    ((8, 0), "sm_80"),    // A100
    ((8, 6), "sm_86"),    // A10, RTX 30
    ((8, 9), "sm_89"),    // L4, L40S, RTX 40
    ((9, 0), "sm_90a"),   // H100, H200, GH200
    ((10, 0), "sm_100a"), // B200, GB200
    ((10, 3), "sm_103a"), // B300, GB300
    ((12, 0), "sm_120"),  // RTX PRO 6000 Blackwell, RTX 50
];

/// The oldest compute capability the kernels run on (bf16 `mma.sync`).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);
