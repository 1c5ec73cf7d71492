//! The one instruction-set module of the CPU kernels: what this CPU has (detected once), the cap
//! that `CSA2_ISA` puts on it, and the resulting level and dot units that every kernel family
//! dispatches on: the row codecs (`formats::fast`), the generic-over-lanes op bodies
//! (`ops::simd`'s `multiversion!`), top-k, the mHC kernels, the projection GEMM
//! (`backend::gemm`) and the narrow-dot kernels of the indexer and of attention.
//!
//! `CSA2_ISA` is a cap, never a demand: a level the CPU lacks falls back to the best it has.
//!
//! | `CSA2_ISA` | vector kernels | dot units (`vpdpbusd`, `vpdpwssd`, `vdpbf16ps`) |
//! |---|---|---|
//! | `scalar` | scalar codecs, the portable op bodies (whatever the baseline target vectorises) | off |
//! | `avx2` | 8 f32 lanes (AVX2 + FMA) | off |
//! | `avx512` | 16 f32 lanes (AVX-512F) | off: f32 dots everywhere, the reference-grade A/B baseline |
//! | `avx512-dot`, or unset | 16 f32 lanes | AVX-512 VNNI and BF16 where the CPU has them |
//!
//! `portable` and `avx512dot` are accepted as the older spellings of `scalar` and `avx512-dot`;
//! any other value is ignored (no cap) and [`describe`] says so, so that a typo is visible in
//! `csa2 check` and benchmark headers instead of silently changing nothing.

use crate::error::{Error, Result};
use std::sync::OnceLock;

// Slowest first: the derived order is the cap order. (The doc line below is also the C header's
// comment for the opaque type, kept as it was.)
/// An instruction-set level of the row codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Isa {
    /// No intrinsics: the scalar reference codecs and the portable op bodies (any CPU).
    Scalar,
    /// x86-64 AVX2 + FMA: 8 f32 lanes.
    Avx2,
    /// x86-64 AVX-512F (with AVX2 + FMA): 16 f32 lanes.
    Avx512,
}

impl Isa {
    /// Every level, slowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run the level (detected once).
    pub fn is_supported(self) -> bool {
        self <= cpu().best
    }

    /// The levels this CPU supports, slowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The level every kernel uses in this process: the CPU's best under the `CSA2_ISA` cap.
    pub fn best() -> Isa {
        level()
    }

    /// Name used by `CSA2_ISA`, the CLI and benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses `scalar`, `avx2` or `avx512`.
    pub fn from_name(s: &str) -> Result<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s).ok_or_else(|| {
            Error::invalid(
                "isa",
                format!("unknown ISA `{s}` (expected scalar, avx2 or avx512)"),
            )
        })
    }

    /// Errors with [`Error::Unsupported`] when this CPU cannot run the level.
    pub fn check(self) -> Result<Isa> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(Error::Unsupported(format!(
                "ISA {} is not available on this CPU",
                self.name()
            )))
        }
    }
}

/// The narrow dot-product units beyond AVX-512F: AVX-512 VNNI (`vpdpbusd`, 64 int8 MACs per
/// instruction; `vpdpwssd`, 32 int16 MACs) and AVX-512 BF16 (`vdpbf16ps`, 32 bf16 MACs), against
/// 16 f32 MACs for an FMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DotUnits {
    /// AVX-512F/BW + VNNI (int8 indexer, int16 attention scores).
    pub vnni: bool,
    /// AVX-512F/BW + BF16.
    pub bf16: bool,
}

/// What the CPU has, uncapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    /// The best vector level.
    pub best: Isa,
    /// The dot units present (only with AVX-512F/BW).
    pub dots: DotUnits,
}

/// A parsed `CSA2_ISA` value: the highest vector level, and whether the dot units may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cap {
    /// Highest vector level allowed.
    pub isa: Isa,
    /// Dot units allowed (only `avx512-dot`).
    pub dots: bool,
}

impl Cap {
    /// No cap: everything the CPU has (a function, not an associated const, so that cbindgen
    /// does not list the type in the C header).
    pub fn none() -> Cap {
        Cap {
            isa: Isa::Avx512,
            dots: true,
        }
    }

    /// Parses one `CSA2_ISA` value (see the module table); `None` for an unknown one.
    pub fn parse(s: &str) -> Option<Cap> {
        let (isa, dots) = match s {
            "scalar" | "portable" => (Isa::Scalar, false),
            "avx2" => (Isa::Avx2, false),
            "avx512" => (Isa::Avx512, false),
            "avx512-dot" | "avx512dot" => (Isa::Avx512, true),
            _ => return None,
        };
        Some(Cap { isa, dots })
    }

    /// The level and dot units the kernels use on `cpu` under this cap.
    pub fn apply(self, cpu: Cpu) -> (Isa, DotUnits) {
        let isa = self.isa.min(cpu.best);
        let dots = if self.dots && isa == Isa::Avx512 {
            cpu.dots
        } else {
            DotUnits::default()
        };
        (isa, dots)
    }
}

/// What this CPU has, detected once.
pub fn cpu() -> Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    *CPU.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Cpu {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma");
    let avx512 = avx2 && has!("avx512f");
    let bw = avx512 && has!("avx512bw");
    Cpu {
        best: if avx512 {
            Isa::Avx512
        } else if avx2 {
            Isa::Avx2
        } else {
            Isa::Scalar
        },
        dots: DotUnits {
            vnni: bw && has!("avx512vnni"),
            bf16: bw && has!("avx512bf16"),
        },
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Cpu {
    Cpu {
        best: Isa::Scalar,
        dots: DotUnits::default(),
    }
}

/// The raw `CSA2_ISA` value and its parse (read once).
fn env_cap() -> &'static (Option<String>, Option<Cap>) {
    static CAP: OnceLock<(Option<String>, Option<Cap>)> = OnceLock::new();
    CAP.get_or_init(|| {
        let raw = std::env::var("CSA2_ISA").ok().filter(|s| !s.is_empty());
        let cap = raw.as_deref().and_then(Cap::parse);
        (raw, cap)
    })
}

/// The cap `CSA2_ISA` sets ([`Cap::none`] when unset or unknown).
pub fn cap() -> Cap {
    env_cap().1.unwrap_or(Cap::none())
}

fn effective() -> (Isa, DotUnits) {
    static EFF: OnceLock<(Isa, DotUnits)> = OnceLock::new();
    *EFF.get_or_init(|| cap().apply(cpu()))
}

/// The vector level every kernel uses in this process.
pub fn level() -> Isa {
    effective().0
}

/// The dot units the kernels may use in this process (off under any cap below `avx512-dot`).
pub fn dot_units() -> DotUnits {
    effective().1
}

/// One line for logs and benchmark headers: the level in use, the dot units, and the cap (with a
/// note when `CSA2_ISA` holds a value this module does not know).
pub fn describe() -> String {
    let (isa, d) = effective();
    let mut s = isa.name().to_string();
    if d.vnni {
        s.push_str(" + vnni");
    }
    if d.bf16 {
        s.push_str(" + bf16");
    }
    match env_cap() {
        (None, _) => s.push_str(" (CSA2_ISA unset)"),
        (Some(v), Some(_)) => s.push_str(&format!(" (CSA2_ISA={v})")),
        (Some(v), None) => s.push_str(&format!(
            " (CSA2_ISA={v} is not one of scalar, avx2, avx512, avx512-dot: ignored)"
        )),
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vocabulary word, on every kind of CPU: the level is the lower of cap and CPU, and
    /// the dot units are on only under `avx512-dot` (or no cap) at the AVX-512 level.
    #[test]
    fn caps_combine_with_every_cpu() {
        let full = DotUnits {
            vnni: true,
            bf16: true,
        };
        let cpus = [
            Cpu {
                best: Isa::Avx512,
                dots: full,
            },
            Cpu {
                best: Isa::Avx512,
                dots: DotUnits::default(),
            },
            Cpu {
                best: Isa::Avx2,
                dots: DotUnits::default(),
            },
            Cpu {
                best: Isa::Scalar,
                dots: DotUnits::default(),
            },
        ];
        for word in [
            "scalar",
            "portable",
            "avx2",
            "avx512",
            "avx512-dot",
            "avx512dot",
        ] {
            let cap = Cap::parse(word).unwrap();
            for c in cpus {
                let (isa, d) = cap.apply(c);
                assert_eq!(isa, cap.isa.min(c.best), "{word} on {c:?}");
                let want = if cap.dots && isa == Isa::Avx512 {
                    c.dots
                } else {
                    DotUnits::default()
                };
                assert_eq!(d, want, "{word} on {c:?}");
            }
        }
        assert_eq!(Cap::parse("scalar"), Cap::parse("portable"));
        assert_eq!(Cap::parse("avx512-dot"), Some(Cap::none()));
        assert_eq!(Cap::parse("avx512dot"), Some(Cap::none()));
        for bad in ["", "AVX2", "sse9", "avx512 ", "auto"] {
            assert_eq!(Cap::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Cap::none().apply(cpus[0]), (Isa::Avx512, full));
    }

    /// The process-wide values follow the environment and the CPU exactly as the pure rule says.
    #[test]
    fn process_level_is_the_rule_applied_to_this_cpu() {
        let want = std::env::var("CSA2_ISA")
            .ok()
            .and_then(|v| Cap::parse(&v))
            .unwrap_or(Cap::none())
            .apply(cpu());
        assert_eq!((level(), dot_units()), want);
        assert!(Isa::supported().contains(&level()));
        assert!(describe().starts_with(level().name()));
    }

    #[test]
    fn isa_names_round_trip_and_bad_names_fail() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()).unwrap(), isa);
            assert_eq!(Cap::parse(isa.name()).unwrap().isa, isa);
        }
        assert!(Isa::from_name("sse9").is_err());
        assert!(Isa::Scalar.check().is_ok());
        assert!(Isa::supported().contains(&Isa::best()));
    }
}
