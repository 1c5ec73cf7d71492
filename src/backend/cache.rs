//! How the backend reaches the KV cache: the [`KvCache`] trait, and [`ContiguousCache`], a simple
//! per-request implementation used by tests, the CLI and the A/B harness.
//!
//! The backend never computes an address itself. It asks the cache to encode rows into the slots of
//! a request's compressed entries (the cache owns the slot mapping, docs/SPEC.md §1 block-planar pages), to
//! hand back the stored records of a range of entries (standalone records, the layout the indexer
//! and attention kernels take; a paged manager gathers them from its block-planar pages), to keep each layer's SWA window and to carry the compressor's half-finished pair between steps.
//!
//! What lives where (docs/SPEC.md §0):
//! - global KV (main-KV and index-K records) only for KV-source (Full) layers, one entry per `ratio`
//!   tokens; persistent (SSD tier) in a serving deployment;
//! - an SWA window of `window` tokens for every layer, in the SWA record format; encoder windows may
//!   be snapshotted to the DRAM tier ([`KvCache::swa_snapshot`]), decoder windows never are;
//! - per Full layer of ratio > 1 the pending token of an unfinished group (kv and score, f32).

use crate::cache::{RecordKind, RequestId};
use crate::error::{Error, Result};
use crate::formats::{decode_rows, encode_rows, KvScheme};
use crate::geometry::{Geometry, Role};
use crate::ops::compressor::CompressorState;
use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

/// A saved SWA window of several layers (the DRAM-tier snapshot payload).
#[derive(Debug, Clone, PartialEq)]
pub struct SwaSnapshot {
    /// Position one past the newest token held (the prefix length it belongs to).
    pub end: usize,
    /// Per layer: (layer, first position held, raw records oldest first).
    pub layers: Vec<(usize, usize, Vec<u8>)>,
}

impl SwaSnapshot {
    /// Payload bytes (records only).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.2.len()).sum()
    }
}

/// Bytes held by a cache, measured from its allocations (not computed from a formula).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CacheUsage {
    /// Main-KV record bytes in use (all requests, all KV-source layers).
    pub main_bytes: usize,
    /// Index-K record bytes in use.
    pub index_bytes: usize,
    /// Bytes allocated for global KV (≥ in use: page or growth padding).
    pub global_allocated: usize,
    /// SWA window record bytes allocated (all requests, all layers).
    pub swa_bytes: usize,
    /// Compressor carry bytes (pending-pair f32 rows).
    pub carry_bytes: usize,
    /// Live requests.
    pub requests: usize,
}

impl CacheUsage {
    /// Global KV bytes in use (main + index): what the SSD tier persists.
    pub fn global_bytes(&self) -> usize {
        self.main_bytes + self.index_bytes
    }
}

/// The cache interface the layer modes use. Implementations: [`ContiguousCache`] here, and
/// [`super::paged::PagedCache`], which runs it over the paged block manager of `crate::cache`
/// (block tables, slot mapping, block-planar pages, per-request SWA rings). Both return the same
/// records for the same writes, so the stack's outputs are bit-identical over either.
///
/// Thread safety: writers take `&mut self`; readers take `&self` and may run from many rayon tasks
/// at once, so implementations must be `Sync`.
pub trait KvCache: Send + Sync {
    /// Record formats of this cache.
    fn formats(&self) -> KvScheme;
    /// Registers a request. Errors if it already exists.
    fn open(&mut self, req: RequestId) -> Result<()>;
    /// Whether a request is registered.
    fn contains(&self, req: RequestId) -> bool;
    /// Frees everything a request holds (global KV, SWA windows, carries).
    fn close(&mut self, req: RequestId) -> Result<()>;
    /// Compressed entries stored for `req` in KV-source `layer`.
    fn entries(&self, req: RequestId, layer: usize) -> Result<usize>;
    /// Encodes `rows` (n × dim of the region's format) into entries `first .. first + n`. Entries must
    /// be written in order: `first` ≤ the current count (rewriting the tail is allowed).
    ///
    /// Errors: unknown request or a layer without global KV; a gap; [`Error::OutOfBlocks`] from a
    /// bounded implementation.
    fn write_entries(
        &mut self,
        req: RequestId,
        layer: usize,
        region: RecordKind,
        first: usize,
        rows: &[f32],
    ) -> Result<()>;
    /// The stored records of entries `range`, standalone (each record's data bytes then its scale
    /// bytes) and in entry order: borrowed when the storage is contiguous, gathered otherwise.
    fn records(
        &self,
        req: RequestId,
        layer: usize,
        region: RecordKind,
        range: Range<usize>,
    ) -> Result<Cow<'_, [u8]>>;
    /// Stores SWA rows (n × 512, already RoPE'd) of `layer` for positions `first .. first + n`. A
    /// write that does not continue the window (`first` ≠ the end held) restarts it at `first`.
    /// Only the last `window` positions are kept.
    fn swa_write(&mut self, req: RequestId, layer: usize, first: usize, rows: &[f32])
        -> Result<()>;
    /// Positions whose SWA rows `layer` holds for `req` (empty range when none).
    fn swa_held(&self, req: RequestId, layer: usize) -> Result<Range<usize>>;
    /// Decodes the SWA rows of positions `range` (must be held) into `out` (len × 512).
    fn swa_read(
        &self,
        req: RequestId,
        layer: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()>;
    /// Copies the SWA windows of `layers` (the DRAM snapshot of docs/SPEC.md §0).
    fn swa_snapshot(&self, req: RequestId, layers: &[usize]) -> Result<SwaSnapshot>;
    /// Restores windows from a snapshot (replacing what those layers hold).
    fn swa_restore(&mut self, req: RequestId, snap: &SwaSnapshot) -> Result<()>;
    /// Drops the SWA windows of `layers` (a snapshot miss / a finished turn's decoder state).
    fn swa_drop(&mut self, req: RequestId, layers: &[usize]) -> Result<()>;
    /// The compressor state of a KV-source layer (the half-finished group carried between steps),
    /// `None` until first set. A copy: at most one token's kv and score rows at ratio 2.
    fn carry(&self, req: RequestId, layer: usize) -> Result<Option<CompressorState>>;
    /// Sets (Some) or clears (None) the compressor state of a KV-source layer.
    fn set_carry(
        &mut self,
        req: RequestId,
        layer: usize,
        state: Option<CompressorState>,
    ) -> Result<()>;
    /// Drops every compressor carry of a request (a snapshot miss: the carry is not persisted).
    fn carry_drop(&mut self, req: RequestId) -> Result<()>;
    /// Measured bytes.
    fn usage(&self) -> CacheUsage;
}

/// The layers a [`KvCache`] implementation serves: every layer has an SWA window, only the
/// KV-source layers (the geometry's `Full` layers) hold global KV. The two checks every trait
/// method starts with, shared by [`ContiguousCache`] and `PagedCache`.
#[derive(Debug, Clone)]
pub(crate) struct LayerSet {
    pub(crate) num_layers: usize,
    /// KV-source layers, in layer order.
    pub(crate) kv_layers: Vec<usize>,
}

impl LayerSet {
    /// Errors: [`Error::Invalid`] (`layer`) naming the KV-source layers when `layer` holds none.
    pub(crate) fn check_kv(&self, layer: usize) -> Result<()> {
        if self.kv_layers.contains(&layer) {
            return Ok(());
        }
        Err(Error::invalid(
            "layer",
            format!(
                "layer {layer} owns no global KV (KV-source layers: {:?})",
                self.kv_layers
            ),
        ))
    }
    /// Errors: [`Error::Invalid`] (`layer`) when `layer` is past the last layer.
    pub(crate) fn check(&self, layer: usize) -> Result<()> {
        if layer < self.num_layers {
            return Ok(());
        }
        Err(Error::invalid(
            "layer",
            format!("{layer} is out of range 0..{}", self.num_layers),
        ))
    }
}

#[derive(Debug, Default)]
struct Records {
    count: usize,
    bytes: Vec<u8>,
}

#[derive(Debug)]
struct Ring {
    /// Records, `window` slots; position p lives in slot p % window.
    data: Vec<u8>,
    held: Range<usize>,
}

#[derive(Debug)]
struct ReqState {
    global: HashMap<(usize, RecordKind), Records>,
    swa: Vec<Option<Ring>>,
    carry: HashMap<usize, Option<CompressorState>>,
}

/// A per-request contiguous cache: each KV-source layer's records of a request in one growing buffer
/// of standalone records (what the indexer and attention kernels read without a gather), and one ring of `window` SWA records per layer. Unbounded (limited by host memory); no sharing of
/// prefixes between requests. Enough for tests, the CLI sessions and the A/B harness; serving uses
/// the paged manager.
#[derive(Debug)]
pub struct ContiguousCache {
    formats: KvScheme,
    window: usize,
    layers: LayerSet,
    reqs: HashMap<RequestId, ReqState>,
}

impl ContiguousCache {
    /// An empty cache for a geometry's KV-source layers and windows.
    pub fn new(g: &Geometry, formats: KvScheme) -> ContiguousCache {
        ContiguousCache {
            formats,
            window: g.window,
            layers: LayerSet {
                num_layers: g.num_layers,
                kv_layers: g.layers_with(Role::Full).map(|l| l.id).collect(),
            },
            reqs: HashMap::new(),
        }
    }

    fn req(&self, req: RequestId) -> Result<&ReqState> {
        self.reqs
            .get(&req)
            .ok_or_else(|| Error::NotFound(format!("request {req} is not in the KV cache")))
    }
    fn req_mut(&mut self, req: RequestId) -> Result<&mut ReqState> {
        self.reqs
            .get_mut(&req)
            .ok_or_else(|| Error::NotFound(format!("request {req} is not in the KV cache")))
    }
    fn check_kv_layer(&self, layer: usize) -> Result<()> {
        self.layers.check_kv(layer)
    }
    fn check_layer(&self, layer: usize) -> Result<()> {
        self.layers.check(layer)
    }

    /// Appends `n` entries of synthetic records directly (bypassing the encoder), for building long
    /// contexts in benchmarks without prefilling them: `make(i, row)` fills entry i's f32 row.
    pub fn synthesize_entries(
        &mut self,
        req: RequestId,
        layer: usize,
        region: RecordKind,
        n: usize,
        make: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Result<()> {
        use rayon::prelude::*;
        self.check_kv_layer(layer)?;
        let fmt = region.format(&self.formats);
        let st = self.req_mut(req)?;
        let p = st.global.entry((layer, region)).or_default();
        let rb = fmt.record_bytes();
        let base = p.count;
        p.bytes.reserve_exact(n * rb);
        p.bytes.resize((base + n) * rb, 0);
        const CH: usize = 256;
        p.bytes[base * rb..]
            .par_chunks_mut(CH * rb)
            .enumerate()
            .for_each(|(c, chunk)| {
                let rows_here = chunk.len() / rb;
                let mut x = vec![0f32; rows_here * fmt.dim()];
                for (k, row) in x.chunks_exact_mut(fmt.dim()).enumerate() {
                    make(base + c * CH + k, row);
                }
                encode_rows(fmt, &x, chunk).expect("whole rows by construction");
            });
        p.count = base + n;
        Ok(())
    }
}

/// Argument checks every [`KvCache`] implementation applies, so the contiguous and the paged cache
/// refuse the same inputs with the same errors.
pub(crate) mod checks {
    use crate::cache::RecordKind;
    use crate::error::{Error, Result};
    use crate::formats::RecordFormat;
    use std::ops::Range;

    /// Rows in `rows` (flat f32, `fmt.dim()` per row); `what` names them in the error.
    pub(crate) fn row_count(what: &str, fmt: RecordFormat, rows: &[f32]) -> Result<usize> {
        if !rows.len().is_multiple_of(fmt.dim()) {
            return Err(Error::shape(
                what.to_string(),
                format!("a multiple of {}", fmt.dim()),
                rows.len(),
            ));
        }
        Ok(rows.len() / fmt.dim())
    }

    /// Entries are written in order: `first` may rewrite the tail but not leave a gap.
    pub(crate) fn no_gap(
        layer: usize,
        region: RecordKind,
        first: usize,
        count: usize,
    ) -> Result<()> {
        if first > count {
            return Err(Error::invalid(
                "first",
                format!(
                    "layer {layer} {region:?}: entry {first} would leave a gap after {count} stored entries"
                ),
            ));
        }
        Ok(())
    }

    /// `range` lies within the `count` stored entries.
    pub(crate) fn stored(
        layer: usize,
        region: RecordKind,
        range: &Range<usize>,
        count: usize,
    ) -> Result<()> {
        if range.end > count || range.start > range.end {
            return Err(Error::invalid(
                "range",
                format!("layer {layer} {region:?}: entries {range:?} requested, {count} stored"),
            ));
        }
        Ok(())
    }

    /// An SWA read of `range` into `out_len` floats, against the positions `held`.
    pub(crate) fn swa_read(
        layer: usize,
        range: &Range<usize>,
        held: &Range<usize>,
        fmt: RecordFormat,
        out_len: usize,
    ) -> Result<()> {
        if range.start < held.start || range.end > held.end {
            return Err(Error::invalid(
                "range",
                format!("layer {layer} SWA positions {range:?} requested, {held:?} held"),
            ));
        }
        if out_len != range.len() * fmt.dim() {
            return Err(Error::shape(
                "SWA read output",
                range.len() * fmt.dim(),
                out_len,
            ));
        }
        Ok(())
    }
}

impl KvCache for ContiguousCache {
    fn formats(&self) -> KvScheme {
        self.formats
    }

    fn open(&mut self, req: RequestId) -> Result<()> {
        if self.reqs.contains_key(&req) {
            return Err(Error::invalid(
                "request",
                format!("request {req} is already open"),
            ));
        }
        self.reqs.insert(
            req,
            ReqState {
                global: HashMap::new(),
                swa: (0..self.layers.num_layers).map(|_| None).collect(),
                carry: HashMap::new(),
            },
        );
        Ok(())
    }

    fn contains(&self, req: RequestId) -> bool {
        self.reqs.contains_key(&req)
    }

    fn close(&mut self, req: RequestId) -> Result<()> {
        self.reqs
            .remove(&req)
            .map(|_| ())
            .ok_or_else(|| Error::NotFound(format!("request {req} is not in the KV cache")))
    }

    fn entries(&self, req: RequestId, layer: usize) -> Result<usize> {
        self.check_kv_layer(layer)?;
        let st = self.req(req)?;
        Ok(st
            .global
            .get(&(layer, RecordKind::Main))
            .map_or(0, |p| p.count))
    }

    fn write_entries(
        &mut self,
        req: RequestId,
        layer: usize,
        region: RecordKind,
        first: usize,
        rows: &[f32],
    ) -> Result<()> {
        self.check_kv_layer(layer)?;
        let fmt = region.format(&self.formats);
        let n = checks::row_count(&format!("layer {layer} {region:?} rows"), fmt, rows)?;
        let st = self.req_mut(req)?;
        let p = st.global.entry((layer, region)).or_default();
        checks::no_gap(layer, region, first, p.count)?;
        let rb = fmt.record_bytes();
        let end = (first + n).max(p.count);
        p.bytes.resize(end * rb, 0);
        encode_rows(fmt, rows, &mut p.bytes[first * rb..(first + n) * rb])?;
        p.count = end;
        Ok(())
    }

    fn records(
        &self,
        req: RequestId,
        layer: usize,
        region: RecordKind,
        range: Range<usize>,
    ) -> Result<Cow<'_, [u8]>> {
        self.check_kv_layer(layer)?;
        let rb = region.format(&self.formats).record_bytes();
        let st = self.req(req)?;
        let count = st.global.get(&(layer, region)).map_or(0, |p| p.count);
        checks::stored(layer, region, &range, count)?;
        if range.is_empty() {
            return Ok(Cow::Borrowed(&[]));
        }
        let p = &st.global[&(layer, region)];
        Ok(Cow::Borrowed(&p.bytes[range.start * rb..range.end * rb]))
    }

    fn swa_write(
        &mut self,
        req: RequestId,
        layer: usize,
        first: usize,
        rows: &[f32],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let fmt = self.formats.swa;
        let n = checks::row_count(&format!("layer {layer} SWA rows"), fmt, rows)?;
        let w = self.window;
        let rb = fmt.record_bytes();
        let st = self.req_mut(req)?;
        let ring = st.swa[layer].get_or_insert_with(|| Ring {
            data: vec![0; w * rb],
            held: first..first,
        });
        if ring.held.end != first {
            ring.held = first..first;
        }
        let skip = n.saturating_sub(w);
        let mut recs = vec![0u8; (n - skip) * rb];
        encode_rows(fmt, &rows[skip * fmt.dim()..], &mut recs)?;
        for (i, rec) in recs.chunks_exact(rb).enumerate() {
            let pos = first + skip + i;
            ring.data[(pos % w) * rb..(pos % w + 1) * rb].copy_from_slice(rec);
        }
        let end = first + n;
        ring.held = ring.held.start.max(end.saturating_sub(w))..end;
        Ok(())
    }

    fn swa_held(&self, req: RequestId, layer: usize) -> Result<Range<usize>> {
        self.check_layer(layer)?;
        Ok(self.req(req)?.swa[layer]
            .as_ref()
            .map_or(0..0, |r| r.held.clone()))
    }

    fn swa_read(
        &self,
        req: RequestId,
        layer: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let held = self.swa_held(req, layer)?;
        let fmt = self.formats.swa;
        if range.is_empty() {
            return Ok(());
        }
        checks::swa_read(layer, &range, &held, fmt, out.len())?;
        let ring = self.req(req)?.swa[layer].as_ref().expect("held");
        let (w, rb) = (self.window, fmt.record_bytes());
        let mut recs = Vec::with_capacity(range.len() * rb);
        for pos in range {
            recs.extend_from_slice(&ring.data[(pos % w) * rb..(pos % w + 1) * rb]);
        }
        decode_rows(fmt, &recs, out)
    }

    fn swa_snapshot(&self, req: RequestId, layers: &[usize]) -> Result<SwaSnapshot> {
        let st = self.req(req)?;
        let rb = self.formats.swa.record_bytes();
        let mut out = SwaSnapshot {
            end: 0,
            layers: vec![],
        };
        for &l in layers {
            self.check_layer(l)?;
            let Some(ring) = &st.swa[l] else { continue };
            let mut recs = Vec::with_capacity(ring.held.len() * rb);
            for pos in ring.held.clone() {
                let s = pos % self.window;
                recs.extend_from_slice(&ring.data[s * rb..(s + 1) * rb]);
            }
            out.end = out.end.max(ring.held.end);
            out.layers.push((l, ring.held.start, recs));
        }
        Ok(out)
    }

    fn swa_restore(&mut self, req: RequestId, snap: &SwaSnapshot) -> Result<()> {
        let (w, rb) = (self.window, self.formats.swa.record_bytes());
        for (l, _, recs) in &snap.layers {
            self.check_layer(*l)?;
            if recs.len() % rb != 0 || recs.len() / rb > w {
                return Err(Error::shape(
                    format!("snapshot of layer {l}"),
                    format!("at most {w} records of {rb} B"),
                    format!("{} B", recs.len()),
                ));
            }
        }
        let st = self.req_mut(req)?;
        for (l, start, recs) in &snap.layers {
            let n = recs.len() / rb;
            let mut data = vec![0u8; w * rb];
            for i in 0..n {
                let s = (start + i) % w;
                data[s * rb..(s + 1) * rb].copy_from_slice(&recs[i * rb..(i + 1) * rb]);
            }
            st.swa[*l] = Some(Ring {
                data,
                held: *start..start + n,
            });
        }
        Ok(())
    }

    fn swa_drop(&mut self, req: RequestId, layers: &[usize]) -> Result<()> {
        for &l in layers {
            self.check_layer(l)?;
        }
        let st = self.req_mut(req)?;
        for &l in layers {
            st.swa[l] = None;
        }
        Ok(())
    }

    fn carry(&self, req: RequestId, layer: usize) -> Result<Option<CompressorState>> {
        self.check_kv_layer(layer)?;
        Ok(self.req(req)?.carry.get(&layer).cloned().flatten())
    }

    fn set_carry(
        &mut self,
        req: RequestId,
        layer: usize,
        state: Option<CompressorState>,
    ) -> Result<()> {
        self.check_kv_layer(layer)?;
        self.req_mut(req)?.carry.insert(layer, state);
        Ok(())
    }

    fn carry_drop(&mut self, req: RequestId) -> Result<()> {
        self.req_mut(req)?.carry.clear();
        Ok(())
    }

    fn usage(&self) -> CacheUsage {
        let mut u = CacheUsage {
            requests: self.reqs.len(),
            ..Default::default()
        };
        for st in self.reqs.values() {
            for ((_, region), p) in &st.global {
                let used = p.bytes.len();
                match region {
                    RecordKind::Main => u.main_bytes += used,
                    RecordKind::Index => u.index_bytes += used,
                }
                u.global_allocated += p.bytes.capacity();
            }
            u.swa_bytes += st
                .swa
                .iter()
                .flatten()
                .map(|r| r.data.capacity())
                .sum::<usize>();
            u.carry_bytes += st
                .carry
                .values()
                .flatten()
                .map(|c| c.pending_tokens() * 2 * crate::formats::KV_DIM * 4)
                .sum::<usize>();
        }
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::RecordFormat;
    use crate::formats::{decode_rows, encode_rows};

    fn rows(n: usize, dim: usize, seed: f32) -> Vec<f32> {
        (0..n * dim)
            .map(|i| ((i as f32 * 0.37 + seed).sin()) * 1.5)
            .collect()
    }

    #[test]
    fn entries_round_trip_like_the_standalone_codec() {
        let g = Geometry::embedded();
        for f in [KvScheme::CSA2, KvScheme::LAUNCH_DAY] {
            let mut c = ContiguousCache::new(&g, f);
            c.open(1).unwrap();
            let x = rows(5, 512, 0.3);
            c.write_entries(1, 2, RecordKind::Main, 0, &x[..3 * 512])
                .unwrap();
            c.write_entries(1, 2, RecordKind::Main, 3, &x[3 * 512..])
                .unwrap();
            assert_eq!(c.entries(1, 2).unwrap(), 5);
            let mut rec = vec![0u8; 5 * f.main.record_bytes()];
            encode_rows(f.main, &x, &mut rec).unwrap();
            let mut want = vec![0f32; 5 * 512];
            decode_rows(f.main, &rec, &mut want).unwrap();
            let recs = c.records(1, 2, RecordKind::Main, 1..5).unwrap();
            assert_eq!(&recs[..], &rec[f.main.record_bytes()..]);
            let mut got = vec![0f32; 4 * 512];
            decode_rows(f.main, &recs, &mut got).unwrap();
            assert_eq!(got, want[512..]);
        }
    }

    #[test]
    fn bad_calls_are_typed_errors() {
        let g = Geometry::embedded();
        let mut c = ContiguousCache::new(&g, KvScheme::CSA2);
        assert!(matches!(c.entries(9, 2), Err(Error::NotFound(_))));
        c.open(9).unwrap();
        assert!(c.open(9).is_err());
        let e = c
            .write_entries(9, 3, RecordKind::Main, 0, &[0.0; 512])
            .unwrap_err();
        assert!(e.to_string().contains("layer 3 owns no global KV"), "{e}");
        let e = c
            .write_entries(9, 2, RecordKind::Main, 1, &[0.0; 512])
            .unwrap_err();
        assert!(e.to_string().contains("gap"), "{e}");
        let e = c
            .write_entries(9, 2, RecordKind::Index, 0, &[0.0; 100])
            .unwrap_err();
        assert!(e.to_string().contains("multiple of 128"), "{e}");
        assert!(c.records(9, 2, RecordKind::Main, 0..1).is_err());
        let mut out = vec![0f32; 512];
        assert!(c.swa_read(9, 0, 0..1, &mut out).is_err());
    }

    #[test]
    fn swa_ring_keeps_the_last_window_and_restarts_on_a_jump() {
        let g = Geometry::embedded();
        let w = g.window;
        let mut c = ContiguousCache::new(&g, KvScheme::CSA2);
        c.open(1).unwrap();
        let x = rows(300, 512, 1.0);
        // 127, then 2 more (crosses the window), then 171 more.
        c.swa_write(1, 5, 0, &x[..127 * 512]).unwrap();
        assert_eq!(c.swa_held(1, 5).unwrap(), 0..127);
        c.swa_write(1, 5, 127, &x[127 * 512..129 * 512]).unwrap();
        assert_eq!(c.swa_held(1, 5).unwrap(), 1..129);
        c.swa_write(1, 5, 129, &x[129 * 512..]).unwrap();
        assert_eq!(c.swa_held(1, 5).unwrap(), 300 - w..300);
        let mut got = vec![0f32; 3 * 512];
        c.swa_read(1, 5, 297..300, &mut got).unwrap();
        let mut rec = vec![0u8; 3 * 528];
        encode_rows(RecordFormat::Mxfp8, &x[297 * 512..], &mut rec).unwrap();
        let mut want = vec![0f32; 3 * 512];
        decode_rows(RecordFormat::Mxfp8, &rec, &mut want).unwrap();
        assert_eq!(got, want);
        assert!(c.swa_read(1, 5, 171..173, &mut got[..1024]).is_err());
        // A non-contiguous write restarts the window (decoder replay, replay after a miss).
        c.swa_write(1, 5, 1000, &x[..512]).unwrap();
        assert_eq!(c.swa_held(1, 5).unwrap(), 1000..1001);
        // Snapshot / drop / restore round trip.
        let snap = c.swa_snapshot(1, &[5]).unwrap();
        c.swa_drop(1, &[5]).unwrap();
        assert_eq!(c.swa_held(1, 5).unwrap(), 0..0);
        c.swa_restore(1, &snap).unwrap();
        assert_eq!(c.swa_held(1, 5).unwrap(), 1000..1001);
    }

    #[test]
    fn usage_is_measured_per_token() {
        let g = Geometry::embedded();
        let mut c = ContiguousCache::new(&g, KvScheme::CSA2);
        c.open(1).unwrap();
        let tokens = 4096;
        for l in g.layers_with(Role::Full) {
            let n = tokens / l.ratio;
            c.synthesize_entries(1, l.id, RecordKind::Main, n, |i, r| r.fill(i as f32 * 1e-3))
                .unwrap();
            c.synthesize_entries(1, l.id, RecordKind::Index, n, |i, r| {
                r.fill(i as f32 * 1e-3)
            })
            .unwrap();
        }
        let u = c.usage();
        assert_eq!(u.global_bytes() as f64 / tokens as f64, 890.0);
    }
}
