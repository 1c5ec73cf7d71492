//! SWA bounded replay planner over the C ABI: the C face of [`crate::replay`].
//!
//! [`csa2_replay_plan`] returns a handle owned by the caller; free it once with
//! [`csa2_replay_plan_free`]. It does not borrow the geometry it was built from. A
//! `Csa2ReplayPlan` is immutable: its accessors may run concurrently.
//! `csa2_replay_plan_protected_entries` follows [`super::sized_out`]'s output-buffer convention.

use super::geometry::geometry;
use super::handle;
use super::Csa2Status;
use super::{arg_out, guarded, guarded_free, sized_out, Csa2Geometry};
use crate::error::{Error, Result};
use crate::replay::{plan, ReplayConfig, ReplayMode, ReplayPlan};
use std::sync::Arc;

/// Opaque replay plan handle (one prefill step). Free with [`csa2_replay_plan_free`]. Immutable.
pub struct Csa2ReplayPlan {
    p: ReplayPlan,
}
handle_type!(Csa2ReplayPlan, 0xC3);

fn replay_plan(p: *const Csa2ReplayPlan) -> Result<Arc<Csa2ReplayPlan>> {
    handle::get(p, "plan")
}

/// Replay mode (pass as `int32_t`; docs/SPEC.md §3).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2ReplayMode {
    /// SWA bounded replay (the default).
    Csa2ReplayBounded = 0,
    /// The exact `L × window` staircase.
    Csa2ReplayExact = 1,
    /// Encoder as bounded, no decoder trimming.
    Csa2ReplayOff = 2,
}
/// Rows one layer runs in a replay step and its window floor.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2LayerRun {
    /// First row (absolute token position) the layer runs.
    pub row_start: u64,
    /// One past the last row.
    pub row_end: u64,
    /// The SWA window of row `p` starts at `max(p − (window − 1), window_floor)`.
    pub window_floor: u64,
}

/// Summary of a replay plan (ranges are half-open token positions).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2ReplaySummary {
    /// Prompt tokens.
    pub prompt_len: u64,
    /// Prefix tokens adopted from the cache (0 when the hit is too short to use).
    pub hit_used: u64,
    /// 1 when the SWA snapshot was used.
    pub snapshot_used: u8,
    /// 1 when the compressor group at `hit_used` must come from saved state.
    pub needs_compressor_state: u8,
    /// Rows the first layer recomputes inside the hit.
    pub replayed_tokens: u64,
    /// Layers in the plan.
    pub num_layers: u64,
    /// Tokens whose global KV is computed and written: `[kv_write_start, kv_write_end)`.
    pub kv_write_start: u64,
    /// End of the written range.
    pub kv_write_end: u64,
    /// Tokens recomputed whose cached global entries must not be rewritten.
    pub protected_start: u64,
    /// End of the protected range.
    pub protected_end: u64,
}

/// Cached compressed entries of one KV source that a replay must not rewrite.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2ProtectedEntries {
    /// KV-source layer.
    pub layer: u64,
    /// First protected compressed entry.
    pub entry_start: u64,
    /// One past the last.
    pub entry_end: u64,
}

fn replay_mode(v: i32) -> Result<ReplayMode> {
    match v {
        0 => Ok(ReplayMode::Bounded),
        1 => Ok(ReplayMode::Exact),
        2 => Ok(ReplayMode::Off),
        _ => Err(Error::invalid(
            "mode",
            format!("{v} is not a Csa2ReplayMode (0 bounded, 1 exact, 2 off)"),
        )),
    }
}

/// Plans one prefill step for geometry `g` (docs/SPEC.md §3): `prompt_len` tokens whose first
/// `hit_tokens` hit the prefix cache, with the SWA snapshot at the hit present (`snapshot_present`
/// ≠ 0) or not. `mode` is a `Csa2ReplayMode`. The plan is a new handle in `*out`.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (unknown mode, `prompt_len` 0, `hit_tokens > prompt_len`).
///
/// # Safety
/// `g` must be a live geometry handle; `out` a writable pointer slot.
#[no_mangle]
pub unsafe extern "C" fn csa2_replay_plan(
    g: *const Csa2Geometry,
    mode: i32,
    prompt_len: usize,
    hit_tokens: usize,
    snapshot_present: u8,
    out: *mut *mut Csa2ReplayPlan,
) -> Csa2Status {
    guarded("csa2_replay_plan", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (g, out) = (geometry(g)?, unsafe { arg_out(out, "out") }?);
        let cfg = ReplayConfig::from_geometry(&g.g, replay_mode(mode)?);
        let p = plan(&cfg, prompt_len, hit_tokens, snapshot_present != 0)?;
        *out = handle::register(Csa2ReplayPlan { p })?;
        Ok(())
    })
}

/// Frees a replay plan. Null is a no-op (`CSA2_OK`).
///
/// Errors: `CSA2_ERR_INVALID_HANDLE` (already freed, garbage, another handle type). A successful
/// free leaves the thread's last error alone.
///
/// # Safety
/// None beyond the C ABI's: any value of `p` is checked (kept `unsafe` for source compatibility).
#[no_mangle]
pub unsafe extern "C" fn csa2_replay_plan_free(p: *mut Csa2ReplayPlan) -> Csa2Status {
    guarded_free("csa2_replay_plan_free", || handle::free(p, "plan"))
}

/// Writes the plan's summary (hit used, replayed tokens, written and protected ranges) to `*out`.
///
/// # Safety
/// `p` must be a live plan; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_replay_plan_summary(
    p: *const Csa2ReplayPlan,
    out: *mut Csa2ReplaySummary,
) -> Csa2Status {
    guarded("csa2_replay_plan_summary", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (plan, out) = (replay_plan(p)?, unsafe { arg_out(out, "out") }?);
        let p = &plan.p;
        *out = Csa2ReplaySummary {
            prompt_len: p.prompt_len as u64,
            hit_used: p.hit_used as u64,
            snapshot_used: p.snapshot_used as u8,
            needs_compressor_state: p.needs_compressor_state as u8,
            replayed_tokens: p.replayed_tokens() as u64,
            num_layers: p.layers.len() as u64,
            kv_write_start: p.kv_write.start as u64,
            kv_write_end: p.kv_write.end as u64,
            protected_start: p.protected.start as u64,
            protected_end: p.protected.end as u64,
        };
        Ok(())
    })
}

/// Writes what layer `layer` runs (row range and window floor) to `*out`.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` when `layer` ≥ the plan's layers.
///
/// # Safety
/// `p` must be a live plan; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_replay_plan_layer(
    p: *const Csa2ReplayPlan,
    layer: usize,
    out: *mut Csa2LayerRun,
) -> Csa2Status {
    guarded("csa2_replay_plan_layer", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (plan, out) = (replay_plan(p)?, unsafe { arg_out(out, "out") }?);
        let p = &plan.p;
        let l = p.layers.get(layer).ok_or_else(|| {
            Error::invalid(
                "layer",
                format!(
                    "{layer} is out of range (plan has {} layers)",
                    p.layers.len()
                ),
            )
        })?;
        *out = Csa2LayerRun {
            row_start: l.rows.start as u64,
            row_end: l.rows.end as u64,
            window_floor: l.window_floor as u64,
        };
        Ok(())
    })
}

/// Copies the per-KV-source protected entry ranges to `out` (`cap` entries) and their count to
/// `*n_out`; see the module docs for `out = NULL, cap = 0`.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (`cap` too small; the message gives the count needed).
///
/// # Safety
/// `p` must be a live plan; `out` must have room for `cap` entries; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_replay_plan_protected_entries(
    p: *const Csa2ReplayPlan,
    out: *mut Csa2ProtectedEntries,
    cap: usize,
    n_out: *mut usize,
) -> Csa2Status {
    guarded("csa2_replay_plan_protected_entries", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (plan, n_out) = (replay_plan(p)?, unsafe { arg_out(n_out, "n_out") }?);
        let p = &plan.p;
        let e = &p.protected_entries;
        // SAFETY: room for `cap` entries is the caller's contract.
        if let Some(dst) = unsafe { sized_out(out, cap, e.len(), "protected entries") }? {
            for (d, (layer, r)) in dst.iter_mut().zip(e) {
                *d = Csa2ProtectedEntries {
                    layer: *layer as u64,
                    entry_start: r.start as u64,
                    entry_end: r.end as u64,
                };
            }
        }
        *n_out = e.len();
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::super::csa2_geometry_free;
    use super::super::test_support::{geometry, last_error};
    use super::*;
    use std::ptr::null_mut;

    #[test]
    fn replay_plan_matches_the_planner_and_rejects_bad_input() {
        let g = geometry();
        unsafe {
            let mut p = null_mut();
            assert_eq!(
                csa2_replay_plan(g, 3, 1000, 512, 0, &mut p),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert!(last_error().contains("mode"));
            assert_eq!(
                csa2_replay_plan(g, 0, 100, 512, 0, &mut p),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert!(p.is_null());
            assert_eq!(
                csa2_replay_plan(g, 0, 1000, 512, 0, &mut p),
                Csa2Status::Csa2Ok
            );
            let cfg =
                ReplayConfig::from_geometry(&super::geometry(g).unwrap().g, ReplayMode::Bounded);
            let want = plan(&cfg, 1000, 512, false).unwrap();
            let mut s = Csa2ReplaySummary::default();
            assert_eq!(csa2_replay_plan_summary(p, &mut s), Csa2Status::Csa2Ok);
            assert_eq!(s.hit_used as usize, want.hit_used);
            assert_eq!(s.replayed_tokens as usize, want.replayed_tokens());
            assert_eq!(s.num_layers as usize, want.layers.len());
            assert_eq!(
                (s.protected_start as usize)..(s.protected_end as usize),
                want.protected
            );
            for (i, l) in want.layers.iter().enumerate() {
                let mut r = Csa2LayerRun::default();
                assert_eq!(csa2_replay_plan_layer(p, i, &mut r), Csa2Status::Csa2Ok);
                assert_eq!((r.row_start as usize)..(r.row_end as usize), l.rows);
                assert_eq!(r.window_floor as usize, l.window_floor);
            }
            let mut r = Csa2LayerRun::default();
            assert_eq!(
                csa2_replay_plan_layer(p, want.layers.len(), &mut r),
                Csa2Status::Csa2ErrInvalidArgument
            );
            let mut n = 0usize;
            assert_eq!(
                csa2_replay_plan_protected_entries(p, null_mut(), 0, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, want.protected_entries.len());
            let mut e = vec![Csa2ProtectedEntries::default(); n];
            assert_eq!(
                csa2_replay_plan_protected_entries(p, e.as_mut_ptr(), n, &mut n),
                Csa2Status::Csa2Ok
            );
            for (got, (layer, r)) in e.iter().zip(&want.protected_entries) {
                assert_eq!(got.layer as usize, *layer);
                assert_eq!((got.entry_start as usize)..(got.entry_end as usize), *r);
            }
            if n > 0 {
                assert_eq!(
                    csa2_replay_plan_protected_entries(p, e.as_mut_ptr(), n - 1, &mut n),
                    Csa2Status::Csa2ErrInvalidArgument
                );
            }
            csa2_replay_plan_free(p);
            csa2_replay_plan_free(null_mut());
            csa2_geometry_free(g);
        }
    }
}
