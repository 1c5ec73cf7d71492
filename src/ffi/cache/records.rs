//! Record-level access to a [`Csa2Cache`]: main-KV and index-K entries through a request's slot
//! mapping, SWA ring rows, and the compressor's carried group, so an engine can drive the cache
//! manager end to end from C.
//!
//! # Ownership and lifetimes
//! Every `DLTensor*` is borrowed for the call only (nothing is retained). The cache keeps its own
//! copy of everything written; a read copies out.
//!
//! # Host/device
//! The cache lives in host memory in this build, so every tensor must be host-readable (`kDLCPU`,
//! `kDLCUDAHost`, `kDLCUDAManaged`); a `kDLCUDA` tensor is `CSA2_ERR_UNSUPPORTED`.
//!
//! # Element types
//! A row tensor is either `float` (float32, bfloat16 or float16; `(n, dim)` with `dim` the format's
//! values per row) and is encoded on write / decoded on read, or `uint8` `(n, record_bytes)`, copied
//! as standalone records (data then scales, the layout of `csa2_encode_rows`). Float rows must be
//! finite: a NaN or ±∞ is `CSA2_ERR_INVALID_ARGUMENT` and nothing is written. A float read of a
//! record that decodes to a non-finite value (raw bytes written with a NaN scale) is refused too.
//!
//! # All or nothing
//! Every check (request, layer, entries, positions, read-only blocks, shapes, values) runs before
//! the first byte moves: a refused write changes nothing and a refused read writes nothing.
//!
//! # Thread safety
//! Every function may run concurrently with any other `csa2_cache_*` call on the same handle
//! (after a racing `csa2_cache_free` it is refused with `CSA2_ERR_INVALID_HANDLE`). Records of different blocks are read and written in parallel; one
//! block's records are serialised by its lock. Two batches that write the same slots concurrently
//! may interleave per record (the engine must not do that, as with any paged cache). A write must
//! not race `csa2_cache_publish` of the same blocks (the read-only check precedes the copy) nor
//! `csa2_cache_free_request` of its request.

use super::{cache, Csa2Cache};
use crate::cache::signature as sig;
use crate::cache::{CacheManager, RecordKind};
use crate::error::{Error, Result};
use crate::ffi::dlpack::{check_disjoint, host, host_opt, DLTensor, DType, View};
use crate::ffi::{arg_out, guarded, Csa2Status};
use crate::formats::{decode_rows, encode_rows, RecordFormat};
use crate::shape::{Arg, Dims};

/// Which of a KV-source layer's two caches (pass as `int32_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2RecordKind {
    /// The compressed main KV (attended key = value).
    Csa2RecordMain = 0,
    /// The indexer's K.
    Csa2RecordIndex = 1,
}

/// What the cache stores for one layer, from [`csa2_cache_layer_info`]. Format ids are
/// `Csa2Format` values; −1 where the layer has no such cache.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2CacheLayerInfo {
    /// 1 when the layer is a KV source (owns main-KV and index-K pages), else 0.
    pub kv_source: u8,
    /// Compression ratio m of a KV source (one entry per m tokens); 0 otherwise.
    pub ratio: u32,
    /// Main-KV record format, or −1.
    pub main_format: i32,
    /// Bytes of one main-KV record (0 when none).
    pub main_record_bytes: u64,
    /// Index-K record format, or −1.
    pub index_format: i32,
    /// Bytes of one index-K record (0 when none).
    pub index_record_bytes: u64,
    /// Compressed entries per block (`block_tokens / ratio`; 0 when not a KV source).
    pub entries_per_block: u64,
    /// f32 values of the carried compressor group (`(ratio − 1) × 1024`; 0 when nothing is carried).
    pub compressor_state_floats: u64,
    /// SWA record format (every layer keeps an SWA ring).
    pub swa_format: i32,
    /// Bytes of one SWA record.
    pub swa_record_bytes: u64,
    /// SWA window in tokens.
    pub window: u64,
}

fn kind(v: i32) -> Result<RecordKind> {
    match v {
        0 => Ok(RecordKind::Main),
        1 => Ok(RecordKind::Index),
        _ => Err(Error::invalid(
            "kind",
            format!("{v} is not a Csa2RecordKind (0 main, 1 index)"),
        )),
    }
}

fn kv_format(m: &CacheManager, layer: usize, k: RecordKind) -> Result<RecordFormat> {
    m.block_layout()
        .place(layer, k)
        .map(|p| p.page.format)
        .ok_or_else(|| {
            Error::invalid(
                "layer",
                format!(
                    "layer {layer} has no {k:?} cache (KV-source layers: {:?})",
                    m.spec().pools.iter().map(|p| p.layer).collect::<Vec<_>>()
                ),
            )
        })
}

/// Checks a row tensor against `fmt` in one of its two forms (`[rows, records]`: float
/// `(n, dim)` or uint8 `(n, record_bytes)`), binding `n`.
fn expect_rows(
    v: &View,
    fmt: RecordFormat,
    [rows, records]: [&Arg; 2],
    dims: &mut Dims,
) -> Result<()> {
    dims.bind("dim", fmt.dim());
    dims.bind("record_bytes", fmt.record_bytes());
    v.expect(
        if v.dtype() == DType::U8 {
            records
        } else {
            rows
        },
        dims,
    )
}
const SRC: [&Arg; 2] = [&sig::SRC_ROWS, &sig::SRC_RECORDS];
const DST: [&Arg; 2] = [&sig::DST_ROWS, &sig::DST_RECORDS];

/// Standalone records from a checked row tensor (encoded when float, copied when uint8).
fn records_of(v: &View, fmt: RecordFormat) -> Result<Vec<u8>> {
    if v.dtype() == DType::U8 {
        return Ok(v.bytes()?.to_vec());
    }
    let x = v.f32s()?;
    if let Some(i) = x.iter().position(|x| !x.is_finite()) {
        return Err(Error::invalid(
            v.name(),
            format!(
                "non-finite value {} at row {}, column {}",
                x[i],
                i / fmt.dim(),
                i % fmt.dim()
            ),
        ));
    }
    let rows = x.len() / fmt.dim();
    let mut out = vec![0u8; rows * fmt.record_bytes()];
    encode_rows(fmt, &x, &mut out)?;
    Ok(out)
}

/// Writes standalone records into a checked row tensor (decoded when float, copied when uint8).
fn store_records(v: &mut View, fmt: RecordFormat, records: &[u8]) -> Result<()> {
    if v.dtype() == DType::U8 {
        v.bytes_mut()?.copy_from_slice(records);
        return Ok(());
    }
    let mut x = vec![0f32; records.len() / fmt.record_bytes() * fmt.dim()];
    decode_rows(fmt, records, &mut x)?;
    if let Some(i) = x.iter().position(|x| !x.is_finite()) {
        return Err(Error::invalid(
            v.name(),
            format!(
                "row {} decodes to a non-finite value at column {} (a raw record with a NaN scale?)",
                i / fmt.dim(),
                i % fmt.dim()
            ),
        ));
    }
    v.write_f32s(&x)
}

/// Entry ids from an `(n)` int tensor; −1 is allowed (a padded gather slot) only when `allow_pad`.
fn entry_ids(v: &View, allow_pad: bool) -> Result<Vec<Option<usize>>> {
    v.i64s()?
        .into_iter()
        .enumerate()
        .map(|(i, e)| match e {
            -1 if allow_pad => Ok(None),
            e if e >= 0 => usize::try_from(e).map(Some).map_err(|_| {
                Error::invalid("entries", format!("entry {e} at index {i} is too large"))
            }),
            e => Err(Error::invalid(
                "entries",
                format!(
                    "entry {e} at index {i} is negative{}",
                    if allow_pad {
                        " (only −1 pads a gather)"
                    } else {
                        ""
                    }
                ),
            )),
        })
        .collect()
}

fn layer_arg(layer: u32, m: &CacheManager) -> Result<usize> {
    let l = layer as usize;
    if l >= m.spec().num_layers {
        return Err(Error::invalid(
            "layer",
            format!(
                "{layer} is past the {} backbone layers",
                m.spec().num_layers
            ),
        ));
    }
    Ok(l)
}

/// Writes what the cache stores for `layer` to `*out` (sizes to allocate row tensors with).
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_ARGUMENT` (layer past the backbone).
///
/// # Safety
/// `c` must be a live cache handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_layer_info(
    c: *const Csa2Cache,
    layer: u32,
    out: *mut Csa2CacheLayerInfo,
) -> Csa2Status {
    guarded("csa2_cache_layer_info", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, out) = unsafe { (cache(c)?, arg_out(out, "out")?) };
        let l = layer_arg(layer, &m)?;
        let spec = m.spec();
        let swa = spec.swa_format;
        let mut info = Csa2CacheLayerInfo {
            main_format: -1,
            index_format: -1,
            swa_format: swa.abi_id(),
            swa_record_bytes: swa.record_bytes() as u64,
            window: spec.window as u64,
            ..Default::default()
        };
        if let Some(p) = spec.pools.iter().find(|p| p.layer == l) {
            info.kv_source = 1;
            info.ratio = p.ratio as u32;
            info.main_format = p.main.abi_id();
            info.main_record_bytes = p.main.record_bytes() as u64;
            if let Some(f) = p.index {
                info.index_format = f.abi_id();
                info.index_record_bytes = f.record_bytes() as u64;
            }
            info.entries_per_block = (m.config().block_tokens / p.ratio) as u64;
            info.compressor_state_floats = p.compressor_state_floats() as u64;
        }
        *out = info;
        Ok(())
    })
}

/// Writes rows into compressed entries `entries` of request `id`'s `kind` cache (a
/// `Csa2RecordKind`) of KV-source `layer`, each to the slot the request's block table maps it to
/// (vLLM's `block_table[j // S]·S + j mod S`).
///
/// `entries` `(n)` int (each ≥ 0, below the entries allocated to the request); `src` `(n, dim)`
/// float, encoded into the layer's record format (main KV: `dim` 512, RoPE'd; index K: 128), or
/// `(n, record_bytes)` uint8 standalone records copied as they are. A repeated entry takes its
/// last row.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request), `CSA2_ERR_INVALID_ARGUMENT` (not a KV-source
/// layer, unknown kind, negative entry or one past the allocation, an entry in a published prefix
/// block — read-only —, non-finite row values, `entries` overlapping `src`), `CSA2_ERR_SHAPE`,
/// `CSA2_ERR_UNSUPPORTED` (device memory). Nothing is written unless the call succeeds.
///
/// # Safety
/// `c` must be a live cache handle; each tensor pointer a readable `DLTensor` whose memory stays
/// valid for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_write_entries(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    kind_: i32,
    entries: *const DLTensor,
    src: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_cache_write_entries", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, ev, sv) = unsafe {
            (
                cache(c)?,
                host(entries, sig::ENTRIES.name)?,
                host(src, sig::SRC_ROWS.name)?,
            )
        };
        let (k, l) = (kind(kind_)?, layer_arg(layer, &m)?);
        let fmt = kv_format(&m, l, k)?;
        let mut dims = Dims::default();
        ev.expect(&sig::ENTRIES, &mut dims)?;
        expect_rows(&sv, fmt, SRC, &mut dims)?;
        check_disjoint(&[&ev, &sv], &[])?;
        let ids: Vec<usize> = entry_ids(&ev, false)?.into_iter().flatten().collect();
        let slots = m.slots_of(id, l, &ids)?;
        m.check_writable(l, k, &slots)?;
        let records = records_of(&sv, fmt)?;
        for (slot, r) in slots.iter().zip(records.chunks_exact(fmt.record_bytes())) {
            m.write_record(l, k, *slot, r)?;
        }
        Ok(())
    })
}

/// Gathers compressed entries `entries` of request `id`'s `kind` cache of KV-source `layer` into
/// `dst`: `(n, dim)` float rows decoded from the records, or `(n, record_bytes)` uint8 records.
/// `entries` `(n)` int; −1 (top-k padding) yields a zero row. Published (read-only) blocks are
/// readable.
///
/// Errors: as [`csa2_cache_write_entries`] (minus the read-only check), plus a record that decodes
/// to a non-finite value. `dst` is written only when the call succeeds; it may not overlap
/// `entries`.
///
/// # Safety
/// As [`csa2_cache_write_entries`]; `dst` writable and unused by other threads for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_read_entries(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    kind_: i32,
    entries: *const DLTensor,
    dst: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_cache_read_entries", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, ev, mut dv) = unsafe {
            (
                cache(c)?,
                host(entries, sig::ENTRIES.name)?,
                host(dst, sig::DST_ROWS.name)?,
            )
        };
        let (k, l) = (kind(kind_)?, layer_arg(layer, &m)?);
        let fmt = kv_format(&m, l, k)?;
        let mut dims = Dims::default();
        ev.expect(&sig::ENTRIES, &mut dims)?;
        expect_rows(&dv, fmt, DST, &mut dims)?;
        check_disjoint(&[&ev], &[&dv])?;
        let ids = entry_ids(&ev, true)?;
        let present: Vec<usize> = ids.iter().flatten().copied().collect();
        let slots = m.slots_of(id, l, &present)?;
        let rb = fmt.record_bytes();
        let mut records = vec![0u8; ids.len() * rb];
        let mut next = slots.iter();
        for (id_, r) in ids.iter().zip(records.chunks_exact_mut(rb)) {
            if id_.is_some() {
                let slot = next
                    .next()
                    .ok_or_else(|| Error::Internal("slot count".into()))?;
                m.read_record(l, k, *slot, r)?;
            }
        }
        // A padded entry must come out as a zero row, whatever the format's zero record is.
        if dv.dtype() != DType::U8 && ids.iter().any(Option::is_none) {
            let mut x = vec![0f32; ids.len() * fmt.dim()];
            decode_rows(fmt, &records, &mut x)?;
            for (i, row) in x.chunks_exact_mut(fmt.dim()).enumerate() {
                if ids[i].is_none() {
                    row.fill(0.0);
                } else if let Some(j) = row.iter().position(|v| !v.is_finite()) {
                    return Err(Error::invalid(
                        "dst",
                        format!("row {i} decodes to a non-finite value at column {j}"),
                    ));
                }
            }
            return dv.write_f32s(&x);
        }
        store_records(&mut dv, fmt, &records)
    })
}

/// Writes the SWA rows of tokens `pos_start .. pos_start + n` of `layer` into request `id`'s ring
/// (slot = position mod window). `src` `(n, 512)` float (encoded in the SWA format) or
/// `(n, swa_record_bytes)` uint8 records. With `n` > window only the newest `window` rows survive.
/// A write that starts past the newest position held (a gap) restarts the window there: the
/// skipped positions are not readable.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (request), `CSA2_ERR_INVALID_ARGUMENT` (layer past the backbone,
/// `pos_start` older than the ring keeps, non-finite values), `CSA2_ERR_SHAPE`,
/// `CSA2_ERR_UNSUPPORTED`. Nothing is written unless the call succeeds.
///
/// # Safety
/// As [`csa2_cache_write_entries`].
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_swa_write(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    pos_start: u64,
    src: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_cache_swa_write", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, sv) = unsafe { (cache(c)?, host(src, sig::SRC_ROWS.name)?) };
        let l = layer_arg(layer, &m)?;
        let fmt = m.spec().swa_format;
        expect_rows(&sv, fmt, SRC, &mut Dims::default())?;
        let pos = usize::try_from(pos_start)
            .map_err(|_| Error::invalid("pos_start", format!("{pos_start} is too large")))?;
        let records = records_of(&sv, fmt)?;
        m.swa_write_rows(id, l, pos, &records)
    })
}

/// Reads the SWA rows of tokens `pos_start .. pos_start + n` of `layer` from request `id`'s ring
/// into `dst` (`(n, 512)` float, decoded, or `(n, swa_record_bytes)` uint8). Every position must be
/// held: among the newest `window` positions and written since the window last (re)started.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (request, or a position outside the window / never written), plus
/// as [`csa2_cache_swa_write`]. `dst` is written only when the call succeeds.
///
/// # Safety
/// As [`csa2_cache_read_entries`].
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_swa_read(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    pos_start: u64,
    dst: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_cache_swa_read", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, mut dv) = unsafe { (cache(c)?, host(dst, sig::DST_ROWS.name)?) };
        let l = layer_arg(layer, &m)?;
        let fmt = m.spec().swa_format;
        expect_rows(&dv, fmt, DST, &mut Dims::default())?;
        let pos = usize::try_from(pos_start)
            .map_err(|_| Error::invalid("pos_start", format!("{pos_start} is too large")))?;
        let mut records = vec![0u8; dv.shape()[0] * fmt.record_bytes()];
        m.swa_read_rows(id, l, pos, &mut records)?;
        store_records(&mut dv, fmt, &records)
    })
}

/// Writes to `*out` one past the newest SWA position written for `layer` of request `id`, or −1
/// before any write (the window holds at most the `window` positions before it).
///
/// Errors: `CSA2_ERR_NOT_FOUND` (request), `CSA2_ERR_INVALID_ARGUMENT` (layer).
///
/// # Safety
/// `c` must be a live cache handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_swa_newest(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    out: *mut i64,
) -> Csa2Status {
    guarded("csa2_cache_swa_newest", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, out) = unsafe { (cache(c)?, arg_out(out, "out")?) };
        let l = layer_arg(layer, &m)?;
        *out = m.swa_newest(id, l)?.map_or(-1, |h| h as i64);
        Ok(())
    })
}

/// Sets request `id`'s carried compressor group of KV-source `layer` (ratio > 1): `state`
/// `(compressor_state_floats)` float32 — for ratio 2 the odd token's kv[512] then its score[512] —
/// or null to clear it (no group open). `csa2_compressor_state_save` fills it from a compressor
/// state handle.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (request), `CSA2_ERR_INVALID_ARGUMENT` (layer of ratio ≤ 1 or not a
/// KV source, non-finite values), `CSA2_ERR_SHAPE`.
///
/// # Safety
/// As [`csa2_cache_write_entries`]; `state` may be null.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_set_compressor_state(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    state: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_cache_set_compressor_state", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, sv) = unsafe { (cache(c)?, host_opt(state, sig::STATE.name)?) };
        let vals = match &sv {
            Some(v) => {
                v.expect(&sig::STATE, &mut Dims::default())?;
                let x = v.f32s()?;
                if let Some(i) = x.iter().position(|x| !x.is_finite()) {
                    return Err(Error::invalid(
                        "state",
                        format!("non-finite value {} at {i}", x[i]),
                    ));
                }
                Some(x)
            }
            None => None,
        };
        m.set_compressor_state(id, layer as usize, vals.as_deref())
    })
}

/// Copies request `id`'s carried compressor group of KV-source `layer` into `out`
/// (`(compressor_state_floats)` float32) and writes 1 to `*present`, or writes 0 (and leaves `out`
/// alone) when no group is open. `out` may be null only to ask whether one is open.
///
/// Errors: as [`csa2_cache_set_compressor_state`].
///
/// # Safety
/// As [`csa2_cache_read_entries`]; `present` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_get_compressor_state(
    c: *const Csa2Cache,
    id: u64,
    layer: u32,
    out: *const DLTensor,
    present: *mut i32,
) -> Csa2Status {
    guarded("csa2_cache_get_compressor_state", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, ov, present) = unsafe {
            (
                cache(c)?,
                host_opt(out, sig::STATE_OUT.name)?,
                arg_out(present, "present")?,
            )
        };
        let floats = m
            .spec()
            .pools
            .iter()
            .find(|p| p.layer == layer as usize)
            .map_or(0, |p| p.compressor_state_floats());
        let st = m.compressor_state(id, layer as usize)?;
        if let Some(mut v) = ov {
            let mut dims = Dims::default();
            dims.bind("floats", floats);
            v.expect(&sig::STATE_OUT, &mut dims)?;
            if let Some(s) = &st {
                v.f32s_mut()?.copy_from_slice(s);
            }
        }
        *present = st.is_some() as i32;
        Ok(())
    })
}
