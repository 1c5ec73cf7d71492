//! The record numbers the crate, the C ABI and the CUDA kernels agree on, defined once: the
//! `Csa2Format` id of each record format, the data and scale bytes of each record (docs/SPEC.md
//! §1), and the `Csa2PoolLayout` id of each page layout.
//!
//! [`super::records::RecordFormat`] and `ops::pool::PoolLayout` take their discriminants and
//! widths from here; build.rs reads this file by path and hands every entry of
//! [`RECORD_DEFINES`] to nvcc as `-D CSA2_<NAME>` (and heads the NVRTC source with them), so
//! kernels/common.cuh writes none of these numbers itself and refuses to compile without them.
//!
//! This file must use nothing from the crate but `super::consts` (src/geometry/consts.rs: the
//! formats module imports it under that name, and build.rs compiles the two files side by side).

use super::consts::{KernelDefine, INDEX_DIM, KV_DIM, ROPE_DIM};

/// `Csa2Format` of the NVFP4-DS main-KV record.
pub const FORMAT_NVFP4: i32 = 0;
/// `Csa2Format` of the MXFP4 index-K record.
pub const FORMAT_MXFP4_INDEX: i32 = 1;
/// `Csa2Format` of the MXFP8 record.
pub const FORMAT_MXFP8: i32 = 2;
/// `Csa2Format` of the launch-day V4 main record.
pub const FORMAT_V4: i32 = 3;
/// `Csa2Format` of the launch-day FP8 index-K record.
pub const FORMAT_FP8_INDEX: i32 = 4;

/// NoPE dims of a latent (the V4 record's E4M3 part).
pub const NOPE_DIM: usize = KV_DIM - ROPE_DIM;

/// NVFP4-DS data: E2M1 pairs, two values per byte.
pub const NVFP4_DATA: usize = KV_DIM / 2;
/// NVFP4-DS scales: one E4M3 per 16 values.
pub const NVFP4_SCALE: usize = KV_DIM / 16;
/// MXFP4 index-K data: E2M1 pairs.
pub const MXFP4_INDEX_DATA: usize = INDEX_DIM / 2;
/// MXFP4 index-K scales: one UE8M0 per 32 values.
pub const MXFP4_INDEX_SCALE: usize = INDEX_DIM / 32;
/// MXFP8 data: one E4M3 per value.
pub const MXFP8_DATA: usize = KV_DIM;
/// MXFP8 scales: one UE8M0 per 32 values.
pub const MXFP8_SCALE: usize = KV_DIM / 32;
/// V4 data: E4M3 NoPE values, then the RoPE values as bf16.
pub const V4_DATA: usize = NOPE_DIM + 2 * ROPE_DIM;
/// V4 scales: one UE8M0 per 64 NoPE values, then one zero pad byte.
pub const V4_SCALE: usize = NOPE_DIM / 64 + 1;
/// FP8 index-K data: one E4M3 per value.
pub const FP8_INDEX_DATA: usize = INDEX_DIM;
/// FP8 index-K scale: one little-endian f32 power of two.
pub const FP8_INDEX_SCALE: usize = 4;

/// `Csa2PoolLayout` of a page whose states each hold their data, then their own scales.
pub const POOL_INTERLEAVED: i32 = 0;
/// `Csa2PoolLayout` of a page holding every state's data, then every state's scales.
pub const POOL_BLOCK_PLANAR: i32 = 1;

/// Every record define the kernels are compiled with (kernels/common.cuh refuses to compile
/// without them). The ids are small non-negative numbers, so the casts are exact.
pub const RECORD_DEFINES: &[KernelDefine] = &[
    KernelDefine::Int("CSA2_FMT_NVFP4", FORMAT_NVFP4 as usize),
    KernelDefine::Int("CSA2_FMT_MXFP4_INDEX", FORMAT_MXFP4_INDEX as usize),
    KernelDefine::Int("CSA2_FMT_MXFP8", FORMAT_MXFP8 as usize),
    KernelDefine::Int("CSA2_FMT_V4", FORMAT_V4 as usize),
    KernelDefine::Int("CSA2_FMT_FP8_INDEX", FORMAT_FP8_INDEX as usize),
    KernelDefine::Int("CSA2_NOPE_DIM", NOPE_DIM),
    KernelDefine::Int("CSA2_NVFP4_DATA", NVFP4_DATA),
    KernelDefine::Int("CSA2_NVFP4_SCALE", NVFP4_SCALE),
    KernelDefine::Int("CSA2_MXFP4_INDEX_DATA", MXFP4_INDEX_DATA),
    KernelDefine::Int("CSA2_MXFP4_INDEX_SCALE", MXFP4_INDEX_SCALE),
    KernelDefine::Int("CSA2_MXFP8_DATA", MXFP8_DATA),
    KernelDefine::Int("CSA2_MXFP8_SCALE", MXFP8_SCALE),
    KernelDefine::Int("CSA2_V4_DATA", V4_DATA),
    KernelDefine::Int("CSA2_V4_SCALE", V4_SCALE),
    KernelDefine::Int("CSA2_FP8_INDEX_DATA", FP8_INDEX_DATA),
    KernelDefine::Int("CSA2_FP8_INDEX_SCALE", FP8_INDEX_SCALE),
    KernelDefine::Int("CSA2_POOL_INTERLEAVED", POOL_INTERLEAVED as usize),
    KernelDefine::Int("CSA2_POOL_BLOCK_PLANAR", POOL_BLOCK_PLANAR as usize),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::RecordFormat;
    use crate::ops::pool::PoolLayout;

    fn define(name: &str) -> usize {
        match RECORD_DEFINES.iter().find(|d| d.name() == name) {
            Some(KernelDefine::Int(_, v)) => *v,
            other => panic!("{name}: {other:?}"),
        }
    }

    /// The defines the kernels get name the crate's own numbers: every format's id and widths,
    /// and both pool layouts' ids.
    #[test]
    fn record_defines_are_the_crate_numbers() {
        let kernel_name = |f: RecordFormat| match f {
            RecordFormat::Nvfp4Ds => "NVFP4",
            RecordFormat::Mxfp4Index => "MXFP4_INDEX",
            RecordFormat::Mxfp8 => "MXFP8",
            RecordFormat::V4Record => "V4",
            RecordFormat::Fp8Index => "FP8_INDEX",
        };
        for f in RecordFormat::ALL {
            let k = kernel_name(f);
            assert_eq!(define(&format!("CSA2_FMT_{k}")) as i32, f.abi_id(), "{f:?}");
            assert_eq!(define(&format!("CSA2_{k}_DATA")), f.data_bytes(), "{f:?}");
            assert_eq!(define(&format!("CSA2_{k}_SCALE")), f.scale_bytes(), "{f:?}");
        }
        assert_eq!(
            define("CSA2_POOL_INTERLEAVED") as i32,
            PoolLayout::Interleaved.abi_id()
        );
        assert_eq!(
            define("CSA2_POOL_BLOCK_PLANAR") as i32,
            PoolLayout::BlockPlanar.abi_id()
        );
        assert_eq!(define("CSA2_NOPE_DIM"), NOPE_DIM);
        // The widths docs/SPEC.md §1 gives.
        let bytes: Vec<usize> = RecordFormat::ALL.map(|f| f.record_bytes()).to_vec();
        assert_eq!(bytes, [288, 68, 528, 584, 132]);
        let mut names: Vec<&str> = RECORD_DEFINES.iter().map(|d| d.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            RECORD_DEFINES.len(),
            "a define is listed twice"
        );
    }

    /// kernels/common.cuh takes these numbers from the defines: it `#define`s none of them.
    #[test]
    fn common_cuh_defines_no_record_number() {
        let src = include_str!("../../kernels/common.cuh");
        for d in RECORD_DEFINES {
            let own = format!("#define {} ", d.name());
            assert!(
                !src.contains(&own),
                "kernels/common.cuh defines {} itself",
                d.name()
            );
        }
    }
}
