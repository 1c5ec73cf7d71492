//! Record schemes: which [`RecordFormat`] each region of a KV cache stores (docs/SPEC.md §1 and §5).
//!
//! This is the one definition the geometry byte counts, the cache spec, the engine's caches, the C
//! ABI (`Csa2KvLayout`, by [`KvScheme::abi_id`]) and the Python shim (through
//! `csa2_record_formats`) all read.

use super::RecordFormat;
use crate::error::{Error, Result};

/// The record formats of one KV cache: main KV (the compressed 512-d latent), index K (the 128-d
/// indexer key) and the SWA window rows. Only the named schemes below exist; `name` is the JSON and
/// CLI name and part of the prefix-key salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvScheme {
    /// `nvfp4`, `mxfp8` or `v4`.
    pub name: &'static str,
    /// Main-KV record format (512 values).
    pub main: RecordFormat,
    /// Index-K record format (128 values).
    pub index: RecordFormat,
    /// SWA window record format (512 values).
    pub swa: RecordFormat,
}

impl KvScheme {
    /// CSA2 on V4.1 (vLLM `nvfp4_ds_mla` compressed cache): NVFP4-DS main KV (288 B), MXFP4 index K
    /// (68 B), MXFP8 SWA (528 B). 890 B of global KV per token on the released geometry.
    pub const CSA2: KvScheme = KvScheme {
        name: "nvfp4",
        main: RecordFormat::Nvfp4Ds,
        index: RecordFormat::Mxfp4Index,
        swa: RecordFormat::Mxfp8,
    };
    /// The SM100 MXFP8 variant (vLLM `fp8_ds_mla` on SM100 with FlashMLA): MXFP8 main KV (528 B),
    /// MXFP4 index K, MXFP8 SWA.
    pub const MXFP8: KvScheme = KvScheme {
        name: "mxfp8",
        main: RecordFormat::Mxfp8,
        index: RecordFormat::Mxfp4Index,
        swa: RecordFormat::Mxfp8,
    };
    /// What vLLM first shipped for V4.1 (`fp8_ds_mla` elsewhere, docs/SPEC.md §5): the V4 record
    /// (584 B) for main KV and SWA, FP8 index K (132 B).
    pub const LAUNCH_DAY: KvScheme = KvScheme {
        name: "v4",
        main: RecordFormat::V4Record,
        index: RecordFormat::Fp8Index,
        swa: RecordFormat::V4Record,
    };

    /// Every scheme, in report order, which is also ABI-id order (`Csa2KvLayout`).
    pub const ALL: [KvScheme; 3] = [KvScheme::CSA2, KvScheme::MXFP8, KvScheme::LAUNCH_DAY];

    /// The `Csa2KvLayout` value of this scheme (its index in [`KvScheme::ALL`]).
    pub fn abi_id(self) -> i32 {
        KvScheme::ALL
            .iter()
            .position(|&s| s == self)
            .map_or(-1, |i| i as i32)
    }

    /// The scheme of a `Csa2KvLayout` value.
    ///
    /// Errors: [`Error::Invalid`] (named `layout`) for any other value.
    pub fn from_abi_id(v: i32) -> Result<KvScheme> {
        usize::try_from(v)
            .ok()
            .and_then(|i| KvScheme::ALL.get(i).copied())
            .ok_or_else(|| {
                Error::invalid(
                    "layout",
                    format!("{v} is not a Csa2KvLayout (0 nvfp4, 1 mxfp8, 2 v4)"),
                )
            })
    }

    /// The scheme called `name` (`nvfp4`, `mxfp8`, `v4`).
    ///
    /// Errors: [`Error::Invalid`] (named `layout`) for any other name.
    pub fn from_name(name: &str) -> Result<KvScheme> {
        KvScheme::ALL
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| {
                Error::invalid(
                    "layout",
                    format!("unknown KV layout `{name}` (expected nvfp4, mxfp8 or v4)"),
                )
            })
    }

    /// Name used in JSON and the CLI.
    pub fn as_str(self) -> &'static str {
        self.name
    }
    /// Bytes of one main-KV record.
    pub fn main_record_bytes(self) -> usize {
        self.main.record_bytes()
    }
    /// Bytes of one index-K record.
    pub fn index_record_bytes(self) -> usize {
        self.index.record_bytes()
    }
    /// Bytes of one SWA-window token record.
    pub fn swa_record_bytes(self) -> usize {
        self.swa.record_bytes()
    }
}

impl serde::Serialize for KvScheme {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_have_their_record_sizes_ids_and_names() {
        let bytes: Vec<_> = KvScheme::ALL
            .iter()
            .map(|s| {
                (
                    s.main_record_bytes(),
                    s.index_record_bytes(),
                    s.swa_record_bytes(),
                )
            })
            .collect();
        assert_eq!(bytes, [(288, 68, 528), (528, 68, 528), (584, 132, 584)]);
        for (i, s) in KvScheme::ALL.into_iter().enumerate() {
            assert_eq!(s.abi_id(), i as i32);
            assert_eq!(KvScheme::from_abi_id(i as i32).unwrap(), s);
            assert_eq!(KvScheme::from_name(s.name).unwrap(), s);
        }
        assert!(KvScheme::from_abi_id(3).is_err() && KvScheme::from_abi_id(-1).is_err());
        assert!(KvScheme::from_name("fp8").is_err());
        assert_eq!(serde_json::to_string(&KvScheme::CSA2).unwrap(), "\"nvfp4\"");
    }
}
