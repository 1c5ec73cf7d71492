//! Geometry handle: the per-layer CSA2 plan and byte accounting over the C ABI.

use super::handle;
use super::{arg_out, arg_slice, guarded, guarded_free, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::KvScheme;
use crate::geometry::{Geometry, LayerPlan, Role};
use std::ffi::c_char;

/// Opaque geometry handle (a parsed `config.json`). Free with [`csa2_geometry_free`]. A checked
/// token, not an address (see the header's "Handles" section). Immutable: calls may run
/// concurrently.
pub struct Csa2Geometry {
    pub(super) g: Geometry,
}

handle_type!(Csa2Geometry, 0xC1);

/// The live geometry behind `g` (null: `CSA2_ERR_NULL_POINTER`; freed, garbage or another
/// handle type: `CSA2_ERR_INVALID_HANDLE`).
pub(super) fn geometry(g: *const Csa2Geometry) -> Result<std::sync::Arc<Csa2Geometry>> {
    handle::get(g, "geometry")
}

/// Role of a layer (docs/SPEC.md §0).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2Role {
    /// Sliding-window attention only.
    Csa2RoleSwaOnly = 0,
    /// Owns compressor, main KV, index K and indexer.
    Csa2RoleFull = 1,
    /// Own indexer over a Full layer's index K (inside its candidate pool).
    Csa2RoleReindex = 2,
    /// Reads another layer's main KV and top-k.
    Csa2RoleReuse = 3,
}

/// KV byte layout for accounting (pass as `int32_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2KvLayout {
    /// NVFP4-DS main (288 B) + MXFP4 index (68 B); MXFP8 SWA.
    Csa2LayoutNvfp4 = 0,
    /// MXFP8 main (528 B) + MXFP4 index; MXFP8 SWA.
    Csa2LayoutMxfp8 = 1,
    /// Launch-day V4 record (584 B) + FP8 index (132 B); V4-record SWA.
    Csa2LayoutV4 = 2,
}

/// One layer of the plan, as returned by [`csa2_geometry_layer`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2LayerInfo {
    /// CSA2 role.
    pub role: Csa2Role,
    /// Compression ratio m (0 = SWA only).
    pub ratio: u32,
    /// Layer whose main KV this layer reads, −1 for none.
    pub kv_source: i32,
    /// Layer whose top-k this layer uses, −1 for none.
    pub index_source: i32,
    /// 1 for an encoder layer of the CED split, 0 for a decoder layer.
    pub encoder: u8,
}

fn publish(out: *mut *mut Csa2Geometry, g: Geometry) -> Result<()> {
    // SAFETY: `out` is a caller-provided slot for one pointer (null checked by `arg_out`).
    let slot = unsafe { arg_out(out, "out") }?;
    *slot = handle::register(Csa2Geometry { g })?;
    Ok(())
}

/// Parses a Hugging Face `config.json` of `len` bytes (UTF-8, no NUL needed) into a new handle
/// stored in `*out`.
///
/// Errors: `CSA2_ERR_NULL_POINTER` (`json`, `out`), `CSA2_ERR_CONFIG_JSON` (not UTF-8 / not JSON),
/// `CSA2_ERR_CONFIG_MISSING` / `CSA2_ERR_CONFIG_INVALID` naming the field. `*out` is untouched on error.
///
/// # Safety
/// `json` must point to `len` readable bytes; `out` to a writable pointer slot.
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_from_json(
    json: *const c_char,
    len: usize,
    out: *mut *mut Csa2Geometry,
) -> Csa2Status {
    guarded("csa2_geometry_from_json", || {
        if json.is_null() {
            return Err(Error::NullPointer("json"));
        }
        // SAFETY: `json` covers `len` bytes (caller's contract).
        let bytes = unsafe { arg_slice(json.cast::<u8>(), len, "json") }?;
        let text = std::str::from_utf8(bytes)
            .map_err(|e| Error::ConfigJson(format!("config is not UTF-8: {e}")))?;
        publish(out, Geometry::from_json_str(text)?)
    })
}

/// The released DeepSeek-V4.1-Flash geometry (compiled in) as a new handle in `*out`.
///
/// # Safety
/// `out` must point to a writable pointer slot.
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_embedded(out: *mut *mut Csa2Geometry) -> Csa2Status {
    guarded("csa2_geometry_embedded", || {
        publish(out, Geometry::embedded())
    })
}

/// Frees a handle from `csa2_geometry_from_json` / `csa2_geometry_embedded`. Null is a no-op
/// (`CSA2_OK`). Handles built from it (caches, compressor states) stay valid.
///
/// Errors: `CSA2_ERR_INVALID_HANDLE` (already freed, garbage, another handle type); nothing is
/// freed then.
///
/// # Safety
/// None beyond the C ABI's: any value of `g` is checked (kept `unsafe` for source compatibility).
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_free(g: *mut Csa2Geometry) -> Csa2Status {
    guarded_free("csa2_geometry_free", || handle::free(g, "geometry"))
}

/// Writes the number of backbone layers to `*out`.
///
/// # Safety
/// `g` must be a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_num_layers(
    g: *const Csa2Geometry,
    out: *mut usize,
) -> Csa2Status {
    guarded("csa2_geometry_num_layers", || {
        // SAFETY: pointer validity is the caller's contract; null is checked.
        let (g, out) = (geometry(g)?, unsafe { arg_out(out, "out") }?);
        *out = g.g.num_layers;
        Ok(())
    })
}

/// Writes the plan of layer `layer` (0-based) to `*out`.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` when `layer` ≥ the number of layers.
///
/// # Safety
/// `g` must be a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_layer(
    g: *const Csa2Geometry,
    layer: usize,
    out: *mut Csa2LayerInfo,
) -> Csa2Status {
    guarded("csa2_geometry_layer", || {
        // SAFETY: pointer validity is the caller's contract; null is checked.
        let (g, out) = (geometry(g)?, unsafe { arg_out(out, "out") }?);
        let l = g.g.layers.get(layer).ok_or_else(|| {
            Error::invalid(
                "layer",
                format!("{layer} is out of range 0..{}", g.g.num_layers),
            )
        })?;
        let id = |o: Option<usize>| o.map_or(-1, |v| v as i32);
        *out = Csa2LayerInfo {
            role: match l.role {
                Role::SwaOnly => Csa2Role::Csa2RoleSwaOnly,
                Role::Full => Csa2Role::Csa2RoleFull,
                Role::Reindex => Csa2Role::Csa2RoleReindex,
                Role::Reuse => Csa2Role::Csa2RoleReuse,
            },
            ratio: l.ratio as u32,
            kv_source: id(l.kv_source),
            index_source: id(l.index_source),
            encoder: u8::from(l.encoder),
        };
        Ok(())
    })
}

/// Writes the global (compressed) KV bytes per original token in `layout` (a `Csa2KvLayout`)
/// to `*out`: 890 for the released config in NVFP4 (docs/SPEC.md §0).
///
/// # Safety
/// `g` must be a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_global_kv_bytes_per_token(
    g: *const Csa2Geometry,
    layout_id: i32,
    out: *mut f64,
) -> Csa2Status {
    guarded("csa2_geometry_global_kv_bytes_per_token", || {
        // SAFETY: pointer validity is the caller's contract; null is checked.
        let (g, out) = (geometry(g)?, unsafe { arg_out(out, "out") }?);
        *out =
            g.g.global_kv_bytes_per_token(KvScheme::from_abi_id(layout_id)?);
        Ok(())
    })
}

/// Writes the fixed SWA bytes of one live request in `layout` (all layers × window × record) to
/// `*out`.
///
/// # Safety
/// `g` must be a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_geometry_swa_bytes_per_request(
    g: *const Csa2Geometry,
    layout_id: i32,
    out: *mut u64,
) -> Csa2Status {
    guarded("csa2_geometry_swa_bytes_per_request", || {
        // SAFETY: pointer validity is the caller's contract; null is checked.
        let (g, out) = (geometry(g)?, unsafe { arg_out(out, "out") }?);
        *out = g.g.swa_bytes_per_request(KvScheme::from_abi_id(layout_id)?) as u64;
        Ok(())
    })
}

/// A checked geometry handle and one of its layers.
pub(super) struct GeoLayer {
    g: std::sync::Arc<Csa2Geometry>,
    layer: usize,
}

impl GeoLayer {
    /// The layer's plan.
    pub(super) fn plan(&self) -> &LayerPlan {
        &self.g.g.layers[self.layer]
    }
    /// The model's RMSNorm epsilon.
    pub(super) fn eps(&self) -> f64 {
        self.g.g.rms_norm_eps
    }
}

pub(super) fn layer_plan(g: *const Csa2Geometry, layer: u32) -> Result<GeoLayer> {
    let g = geometry(g)?;
    let n = g.g.layers.len();
    if layer as usize >= n {
        return Err(Error::invalid(
            "layer",
            format!("{layer} is past the {n} backbone layers"),
        ));
    }
    Ok(GeoLayer {
        g,
        layer: layer as usize,
    })
}
