//! The embedded kernel modules and how a device loads them.
//!
//! `build.rs` embeds, per kernel file: a fatbin with SASS for every compute capability of
//! [`SASS_ARCHS`](super::shapes::SASS_ARCHS) (8.0, 8.6, 8.9, 9.0a, 10.0a, 10.3a, 12.0) plus sm_80
//! PTX the driver JITs on any other GPU of compute capability ≥ 8.0; PTX at the toolkit's ISA (9.5
//! for CUDA 13.5) for sm_80 (portable) and for sm_90a / sm_100a; a "compat" copy of each re-stamped
//! with the oldest ISA that knows its target (7.0, 8.0, 8.6; kept only if ptxas assembles it under
//! that ISA); and the flattened source. A device tries, in order ([`LoadPath`]):
//! 1. the fatbin — exact SASS where the table has the GPU, else the driver's JIT of its PTX;
//!    needs a driver that accepts CUDA 13 binaries (R580+);
//! 2. the PTX — its own arch's, else the portable one; JIT by the driver (R580+, PTX ISA 9.5);
//! 3. the compat PTX — JIT by older drivers (CUDA 11.0+ for the portable copy);
//! 4. NVRTC on the embedded source, if a libnvrtc is loadable — whatever that NVRTC emits, its
//!    driver can JIT.
//!
//! The first that loads wins; the errors of the others are kept for the report, and a GPU that
//! loads none is `Error::CudaModule` (`CSA2_ERR_CUDA_MODULE`), never a quiet move to the host.
//! Setting `CSA2_CUDA_LOAD=fatbin|ptx|compat|nvrtc` forces one path (validation uses it to test
//! each).

use std::fmt;

include!(concat!(env!("OUT_DIR"), "/embedded_kernels.rs"));

/// One kernel file's embedded images.
#[cfg(not(feature = "cuda-emu"))]
#[derive(Debug)]
pub struct EmbeddedModule {
    /// Kernel file stem (`kernels/<name>.cu`).
    pub name: &'static str,
    /// Fatbin with sm_90a and sm_100a SASS.
    pub fatbin: &'static [u8],
    /// Portable PTX (sm_80) at the toolkit's ISA: JIT on any GPU of compute capability ≥ 8.0.
    pub ptx_sm80: &'static str,
    /// PTX for sm_90a at the toolkit's ISA.
    pub ptx_sm90a: &'static str,
    /// PTX for sm_100a at the toolkit's ISA.
    pub ptx_sm100a: &'static str,
    /// The portable PTX re-stamped to ISA 7.0 (empty when ptxas rejected it).
    pub compat_ptx_sm80: &'static str,
    /// PTX for sm_90a re-stamped to ISA 8.0 (empty when ptxas rejected it).
    pub compat_ptx_sm90a: &'static str,
    /// PTX for sm_100a re-stamped to ISA 8.6 (empty when ptxas rejected it).
    pub compat_ptx_sm100a: &'static str,
    /// The kernel source with its headers inlined, for NVRTC.
    pub source: &'static str,
}

#[cfg(not(feature = "cuda-emu"))]
impl EmbeddedModule {
    /// The embedded module named `name`.
    pub fn get(name: &str) -> Option<&'static EmbeddedModule> {
        MODULES.iter().find(|m| m.name == name)
    }
    /// PTX at the toolkit ISA for `arch` (`sm_90a` / `sm_100a`).
    pub fn ptx(&self, arch: &str) -> Option<&'static str> {
        match arch {
            "sm_80" => Some(self.ptx_sm80),
            "sm_90a" => Some(self.ptx_sm90a),
            "sm_100a" => Some(self.ptx_sm100a),
            _ => None,
        }
    }
    /// Compat PTX for `arch`, if embedded.
    pub fn compat_ptx(&self, arch: &str) -> Option<&'static str> {
        let p = match arch {
            "sm_80" => self.compat_ptx_sm80,
            "sm_90a" => self.compat_ptx_sm90a,
            "sm_100a" => self.compat_ptx_sm100a,
            _ => "",
        };
        (!p.is_empty()).then_some(p)
    }
}

/// One kernel file compiled as host C++ for the host SIMT harness (feature `cuda-emu`): a shared
/// object per emulated architecture, loaded by the emulated device (`cuda::emu`).
#[cfg(feature = "cuda-emu")]
#[derive(Debug)]
pub struct EmbeddedModule {
    /// Kernel file stem (`kernels/<name>.cu`).
    pub name: &'static str,
    /// The module built as for sm_90a (no SM100 branches).
    pub host_sm90a: &'static [u8],
    /// The module built as for sm_100a (`__CUDA_ARCH_FEAT_SM100_ALL`: the hardware E2M1 branch).
    pub host_sm100a: &'static [u8],
    /// The sm_90a build under ThreadSanitizer (`CSA2_EMU_SANITIZER=thread`).
    pub host_sm90a_tsan: &'static [u8],
    /// The sm_90a build under AddressSanitizer + UBSan (`CSA2_EMU_SANITIZER=address`).
    pub host_sm90a_asan: &'static [u8],
}

#[cfg(feature = "cuda-emu")]
impl EmbeddedModule {
    /// The embedded module named `name`.
    pub fn get(name: &str) -> Option<&'static EmbeddedModule> {
        MODULES.iter().find(|m| m.name == name)
    }
    /// The host image for `arch` (`sm_90a` / `sm_100a`) and sanitizer (`None`, `thread`,
    /// `address`; sanitizer builds exist for sm_90a).
    pub fn host_image(&self, arch: &str, sanitizer: Option<&str>) -> Option<&'static [u8]> {
        match (arch, sanitizer) {
            ("sm_90a", None) => Some(self.host_sm90a),
            ("sm_100a", None) => Some(self.host_sm100a),
            ("sm_90a", Some("thread")) => Some(self.host_sm90a_tsan),
            ("sm_90a", Some("address")) => Some(self.host_sm90a_asan),
            _ => None,
        }
    }
}

/// Every `extern "C" __global__` entry point each module must export.
pub const EXPECTED_KERNELS: &[(&str, &[&str])] = &[
    (
        "kv_cache",
        &[
            "nvfp4ds_encode_f32",
            "mxfp4_index_encode_f32",
            "mxfp8_encode_f32",
            "kv_decode_f32",
        ],
    ),
    ("compressor", &["compressor_f32"]),
    (
        "indexer",
        &[
            "indexer_logits_f32",
            "indexer_logits_pool_f32_qnone",
            "indexer_logits_pool_f32_qmxfp4",
            "indexer_logits_pool_f32_qfp8",
            "indexer_logits_pool_f32_qbf16",
            "candidate_mask_from_blocks",
        ],
    ),
    ("topk", &["topk_f32", "candidate_blocks_f32"]),
    (
        "attention",
        &[
            "sparse_decode_attn_f32",
            "attn_pools_bf16",
            "attn_pools_bf16_mma",
            "attn_pools_bf16_split",
            "attn_pools_bf16_split_h32",
            "attn_pools_combine",
        ],
    ),
    ("mhc", &["mega_mhc_bf16"]),
];

/// The `.entry` names a PTX module defines.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix(".visible .entry ")
                .or_else(|| l.strip_prefix(".entry "))?;
            Some(
                rest.split(|c: char| c == '(' || c.is_whitespace())
                    .next()?
                    .to_string(),
            )
        })
        .collect()
}

/// The `.version` (PTX ISA) a PTX module declares.
pub fn ptx_isa(ptx: &str) -> Option<&str> {
    ptx.lines()
        .find_map(|l| l.trim().strip_prefix(".version "))
        .map(str::trim)
}

/// How a module was loaded on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadPath {
    /// SASS from the embedded fatbin.
    Fatbin,
    /// Driver JIT of the embedded PTX.
    Ptx,
    /// Driver JIT of the re-stamped, older-ISA PTX.
    CompatPtx,
    /// NVRTC compile of the embedded source at run time.
    Nvrtc,
    /// The host SIMT harness's shared object (feature `cuda-emu`; the only path there).
    HostSimt,
}

impl LoadPath {
    /// All paths, in the order a device tries them.
    #[cfg(not(feature = "cuda-emu"))]
    pub const ORDER: &'static [LoadPath] = &[
        LoadPath::Fatbin,
        LoadPath::Ptx,
        LoadPath::CompatPtx,
        LoadPath::Nvrtc,
    ];
    /// The emulated device loads host images only.
    #[cfg(feature = "cuda-emu")]
    pub const ORDER: &'static [LoadPath] = &[LoadPath::HostSimt];
    /// Name used by `CSA2_CUDA_LOAD`.
    pub fn name(self) -> &'static str {
        match self {
            LoadPath::Fatbin => "fatbin",
            LoadPath::Ptx => "ptx",
            LoadPath::CompatPtx => "compat",
            LoadPath::Nvrtc => "nvrtc",
            LoadPath::HostSimt => "host",
        }
    }
    /// Parses a `CSA2_CUDA_LOAD` value.
    pub fn from_name(s: &str) -> Option<LoadPath> {
        LoadPath::ORDER.iter().copied().find(|p| p.name() == s)
    }
}

impl fmt::Display for LoadPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
