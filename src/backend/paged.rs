//! [`PagedCache`]: the [`KvCache`] trait over the paged [`CacheManager`] — block tables, slot
//! mapping, block-planar pages per KV-source layer and per-request SWA rings (docs/SPEC.md §1, `crate::cache`).
//!
//! The stack sees exactly what [`super::ContiguousCache`] gives it (same records, same window rules,
//! so the same hidden states bit for bit); only where the bytes live differs:
//! - compressed entries are encoded into standalone records and appended through the manager
//!   ([`CacheManager::append_entries`]: slot mapping, vLLM's `block_table[i // S]·S + i % S`, and
//!   the scatter into the block-planar pages); blocks are allocated as entries grow (one block
//!   covers `block_tokens` tokens of every KV-source layer), so a full pool surfaces as
//!   [`Error::OutOfBlocks`] before anything changes;
//! - [`KvCache::records`] gathers a range back into standalone records, one page lock per block
//!   ([`CacheManager::gather_entries`]);
//! - SWA rows go to the manager's per-request ring, which also keeps the held range; a write that
//!   does not continue the window restarts it there ([`CacheManager::swa_restart`]);
//! - the compressor carry (the stack's [`CompressorState`]: next position and open group) lives
//!   in the manager's carries ([`CacheManager::carry`], `crate::cache::carry`), the same slot the
//!   C ABI's `csa2_cache_{set,get}_compressor_state` read and write in their rows-only form; its
//!   bytes are reported as `carry_bytes`, not as SWA bytes, as in the contiguous cache.
//!
//! Every entry count, block, window and carry lives in the manager (the adapter keeps only the set
//! of requests it opened), so a request this adapter opened is, block for block, window for window
//! and carry for carry, what the C ABI (`csa2_cache_*`) sees through the same manager. Request ids are the manager's ids unchanged, so a manager shared with other users
//! must not reuse them. Prefix publishing and adoption stay with the manager's callers: this
//! adapter never seals a block.

use super::cache::{checks, CacheUsage, KvCache, LayerSet, SwaSnapshot};
use crate::cache::{CacheConfig, CacheManager, CacheSpec, RecordKind, RequestId};
use crate::error::{Error, Result};
use crate::formats::KvScheme;
use crate::formats::{decode_rows, encode_rows};
use crate::geometry::Geometry;
use crate::ops::compressor::CompressorState;
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

/// The [`KvCache`] trait over a shared paged [`CacheManager`] (see the module docs).
#[derive(Debug)]
pub struct PagedCache {
    manager: Arc<CacheManager>,
    formats: KvScheme,
    layers: LayerSet,
    window: usize,
    /// The requests this adapter opened (their state is all in the manager).
    reqs: BTreeSet<RequestId>,
}

impl PagedCache {
    /// The adapter over `manager`. Its spec must be one [`KvScheme`]'s (its `layout` names the
    /// scheme and every KV-source layer stores that scheme's main and index formats), as
    /// [`CacheSpec::from_geometry`] makes it.
    ///
    /// Errors: [`Error::Invalid`] for a spec without KV-source layers, of no named scheme (e.g.
    /// V4-Flash, whose HCA layers have no index K), or whose pools disagree with its scheme.
    pub fn new(manager: Arc<CacheManager>) -> Result<PagedCache> {
        let spec = manager.spec();
        if spec.pools.is_empty() {
            return Err(Error::invalid(
                "cache spec",
                format!("{} has no KV-source layer", spec.name),
            ));
        }
        let formats = KvScheme::from_name(&spec.layout).map_err(|_| {
            Error::invalid(
                "cache spec",
                format!(
                    "{} is in layout `{}`, not one of the KV schemes (nvfp4, mxfp8, v4)",
                    spec.name, spec.layout
                ),
            )
        })?;
        if spec.swa_format != formats.swa {
            return Err(Error::invalid(
                "cache spec",
                format!(
                    "SWA records are {:?}, scheme {} stores {:?}",
                    spec.swa_format, formats.name, formats.swa
                ),
            ));
        }
        if let Some(p) = spec
            .pools
            .iter()
            .find(|p| p.main != formats.main || p.index != Some(formats.index))
        {
            return Err(Error::invalid(
                "cache spec",
                format!(
                    "layer {} stores {:?}/{:?}, scheme {} stores {:?}/{:?}",
                    p.layer, p.main, p.index, formats.name, formats.main, formats.index
                ),
            ));
        }
        Ok(PagedCache {
            formats,
            layers: LayerSet {
                kv_layers: spec.pools.iter().map(|p| p.layer).collect(),
                num_layers: spec.num_layers,
            },
            window: spec.window,
            reqs: BTreeSet::new(),
            manager,
        })
    }

    /// A fresh host-memory manager of `num_blocks` blocks of 256 tokens for geometry `g` in
    /// `scheme` (the cache spec is the scheme's: [`CacheSpec::from_geometry`]), and the adapter
    /// over it.
    ///
    /// Errors: from [`CacheManager::new`].
    pub fn host(g: &Geometry, scheme: KvScheme, num_blocks: usize) -> Result<PagedCache> {
        let spec = CacheSpec::from_geometry(g, scheme);
        let m = CacheManager::new(spec, CacheConfig::host(num_blocks), b"csa2 backend paged")?;
        PagedCache::new(Arc::new(m))
    }

    /// The manager (block tables, slot mapping, measured stats).
    pub fn manager(&self) -> &Arc<CacheManager> {
        &self.manager
    }

    fn check_kv_layer(&self, layer: usize) -> Result<()> {
        self.layers.check_kv(layer)
    }
    fn check_layer(&self, layer: usize) -> Result<()> {
        self.layers.check(layer)
    }
    fn req(&self, req: RequestId) -> Result<()> {
        if self.reqs.contains(&req) {
            Ok(())
        } else {
            Err(Error::NotFound(format!(
                "request {req} is not in the KV cache"
            )))
        }
    }
}

impl KvCache for PagedCache {
    fn formats(&self) -> KvScheme {
        self.formats
    }

    fn open(&mut self, req: RequestId) -> Result<()> {
        if self.reqs.contains(&req) {
            return Err(Error::invalid(
                "request",
                format!("request {req} is already open"),
            ));
        }
        self.manager.add_request(req)?;
        self.reqs.insert(req);
        Ok(())
    }

    fn contains(&self, req: RequestId) -> bool {
        self.reqs.contains(&req)
    }

    fn close(&mut self, req: RequestId) -> Result<()> {
        self.req(req)?;
        self.manager.free_request(req)?;
        self.reqs.remove(&req);
        Ok(())
    }

    fn entries(&self, req: RequestId, layer: usize) -> Result<usize> {
        self.check_kv_layer(layer)?;
        self.req(req)?;
        self.manager.stored_entries(req, layer, RecordKind::Main)
    }

    fn write_entries(
        &mut self,
        req: RequestId,
        layer: usize,
        kind: RecordKind,
        first: usize,
        rows: &[f32],
    ) -> Result<()> {
        self.check_kv_layer(layer)?;
        let fmt = kind.format(&self.formats);
        let n = checks::row_count(&format!("layer {layer} {kind:?} rows"), fmt, rows)?;
        self.req(req)?;
        let count = self.manager.stored_entries(req, layer, kind)?;
        checks::no_gap(layer, kind, first, count)?;
        if n == 0 {
            return Ok(());
        }
        let mut recs = vec![0u8; n * fmt.record_bytes()];
        encode_rows(fmt, rows, &mut recs)?;
        self.manager.append_entries(req, layer, kind, first, &recs)
    }

    fn records(
        &self,
        req: RequestId,
        layer: usize,
        kind: RecordKind,
        range: Range<usize>,
    ) -> Result<Cow<'_, [u8]>> {
        self.check_kv_layer(layer)?;
        self.req(req)?;
        let count = self.manager.stored_entries(req, layer, kind)?;
        checks::stored(layer, kind, &range, count)?;
        if range.is_empty() {
            return Ok(Cow::Borrowed(&[]));
        }
        Ok(Cow::Owned(
            self.manager.gather_entries(req, layer, kind, range)?,
        ))
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
        self.req(req)?;
        // Only the newest `window` rows can survive: encode just those.
        let skip = n.saturating_sub(self.window);
        let mut recs = vec![0u8; (n - skip) * fmt.record_bytes()];
        encode_rows(fmt, &rows[skip * fmt.dim()..], &mut recs)?;
        let held = self.manager.swa_window(req, layer)?;
        if held.is_none_or(|h| h.end != first) {
            // A write that does not continue the window restarts it (replay, decoder jump).
            self.manager.swa_restart(req, layer, first)?;
        }
        self.manager.swa_write_rows(req, layer, first + skip, &recs)
    }

    fn swa_held(&self, req: RequestId, layer: usize) -> Result<Range<usize>> {
        self.check_layer(layer)?;
        self.req(req)?;
        Ok(self.manager.swa_window(req, layer)?.unwrap_or(0..0))
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
        let mut recs = vec![0u8; range.len() * fmt.record_bytes()];
        self.manager
            .swa_read_rows(req, layer, range.start, &mut recs)?;
        decode_rows(fmt, &recs, out)
    }

    fn swa_snapshot(&self, req: RequestId, layers: &[usize]) -> Result<SwaSnapshot> {
        self.req(req)?;
        let rb = self.formats.swa.record_bytes();
        let mut out = SwaSnapshot {
            end: 0,
            layers: vec![],
        };
        for &l in layers {
            self.check_layer(l)?;
            let Some(held) = self.manager.swa_window(req, l)? else {
                continue;
            };
            let mut recs = vec![0u8; held.len() * rb];
            if !held.is_empty() {
                self.manager.swa_read_rows(req, l, held.start, &mut recs)?;
            }
            out.end = out.end.max(held.end);
            out.layers.push((l, held.start, recs));
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
        self.req(req)?;
        for (l, start, recs) in &snap.layers {
            // The window restarts at the snapshot's first position with its records.
            self.manager.swa_restart(req, *l, *start)?;
            self.manager.swa_write_rows(req, *l, *start, recs)?;
        }
        Ok(())
    }

    fn swa_drop(&mut self, req: RequestId, layers: &[usize]) -> Result<()> {
        for &l in layers {
            self.check_layer(l)?;
        }
        self.req(req)?;
        for &l in layers {
            self.manager.swa_clear(req, l)?;
        }
        Ok(())
    }

    fn carry(&self, req: RequestId, layer: usize) -> Result<Option<CompressorState>> {
        self.check_kv_layer(layer)?;
        self.req(req)?;
        self.manager.carry(req, layer)
    }

    fn set_carry(
        &mut self,
        req: RequestId,
        layer: usize,
        state: Option<CompressorState>,
    ) -> Result<()> {
        self.check_kv_layer(layer)?;
        self.req(req)?;
        self.manager.set_carry(req, layer, state)
    }

    fn carry_drop(&mut self, req: RequestId) -> Result<()> {
        self.req(req)?;
        self.manager.clear_carries(req)
    }

    /// Global bytes: `main_bytes`/`index_bytes` are the records stored, `global_allocated` the
    /// slab bytes of the blocks in use, read from the manager's allocator ([`CacheManager::stats`]);
    /// `swa_bytes` the manager's live rings (allocated for every layer when a request opens) and
    /// `carry_bytes` the carried compressor rows of this adapter's requests. (The manager's
    /// `session_bytes` counts both for every request; a manager shared with other users would
    /// count theirs too.)
    fn usage(&self) -> CacheUsage {
        let s = self.manager.stats();
        let carry_bytes: usize = self
            .reqs
            .iter()
            .map(|&r| self.manager.carry_bytes(r).unwrap_or(0))
            .sum();
        let mut u = CacheUsage {
            requests: self.reqs.len(),
            global_allocated: s.in_use_bytes,
            swa_bytes: s.session_bytes.saturating_sub(carry_bytes),
            carry_bytes,
            ..Default::default()
        };
        let (mb, ib) = (
            self.formats.main.record_bytes(),
            self.formats.index.record_bytes(),
        );
        for &req in &self.reqs {
            for &l in &self.layers.kv_layers {
                let n = |k| self.manager.stored_entries(req, l, k).unwrap_or(0);
                u.main_bytes += n(RecordKind::Main) * mb;
                u.index_bytes += n(RecordKind::Index) * ib;
            }
        }
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ContiguousCache;

    fn rows(n: usize, dim: usize, seed: f32) -> Vec<f32> {
        (0..n * dim)
            .map(|i| ((i as f32 * 0.37 + seed).sin()) * 1.5)
            .collect()
    }

    /// Every window the two caches hold agrees, range and rows, and the manager (what the C ABI
    /// reads) holds the adapter's window: the adapter keeps no window state of its own.
    fn same_windows(c: &ContiguousCache, p: &PagedCache, req: RequestId, layers: &[usize]) {
        for &l in layers {
            let h = c.swa_held(req, l).unwrap();
            assert_eq!(p.swa_held(req, l).unwrap(), h, "layer {l}");
            let m = p.manager().swa_window(req, l).unwrap();
            assert_eq!(m.unwrap_or(0..0), h, "layer {l} in the manager");
            if let Some(&pos) = h.clone().collect::<Vec<_>>().last() {
                assert_eq!(p.manager().swa_newest(req, l).unwrap(), Some(pos + 1));
            }
            let mut x = vec![0f32; h.len() * 512];
            let mut y = vec![1f32; h.len() * 512];
            c.swa_read(req, l, h.clone(), &mut x).unwrap();
            p.swa_read(req, l, h, &mut y).unwrap();
            assert!(x == y, "layer {l} rows");
        }
        assert_eq!(
            c.swa_snapshot(req, layers).unwrap(),
            p.swa_snapshot(req, layers).unwrap()
        );
    }

    #[test]
    fn swa_windows_follow_the_contiguous_rules_step_by_step() {
        let g = Geometry::embedded();
        let w = g.window;
        let mut c = ContiguousCache::new(&g, KvScheme::CSA2);
        let mut p = PagedCache::host(&g, KvScheme::CSA2, 4).unwrap();
        let x = rows(400, 512, 1.0);
        let r = |a: usize, b: usize| &x[a * 512..b * 512];
        // (first, rows): within the window, across it, more than a window at once, an empty
        // write, a jump forward, a jump back older than the ring (restarts), then continuing.
        let writes: [(usize, &[f32]); 8] = [
            (0, r(0, 127)),
            (127, r(127, 129)),
            (129, r(129, 300)),
            (300, &[]),
            (1000, r(0, 1)),
            (5, r(5, 5 + w + 9)),
            (5 + w + 9, r(200, 203)),
            (7, r(0, 0)),
        ];
        for cache in [&mut c as &mut dyn KvCache, &mut p] {
            cache.open(1).unwrap();
        }
        for (i, (first, rs)) in writes.iter().enumerate() {
            for cache in [&mut c as &mut dyn KvCache, &mut p] {
                cache.swa_write(1, 5, *first, rs).unwrap();
            }
            same_windows(&c, &p, 1, &[5]);
            if i == 2 {
                assert_eq!(p.swa_held(1, 5).unwrap(), 300 - w..300);
            }
        }
        assert_eq!(p.swa_held(1, 5).unwrap(), 7..7);
        // Drop / restore of an arbitrary layer set, including never-written layers.
        for cache in [&mut c as &mut dyn KvCache, &mut p] {
            cache.swa_write(1, 6, 40, r(0, 50)).unwrap();
        }
        let snap = c.swa_snapshot(1, &[5, 6, 7]).unwrap();
        assert_eq!(snap.layers.len(), 2, "layer 7 never wrote");
        for cache in [&mut c as &mut dyn KvCache, &mut p] {
            cache.swa_drop(1, &[5, 6]).unwrap();
            assert_eq!(cache.swa_held(1, 6).unwrap(), 0..0);
            cache.swa_restore(1, &snap).unwrap();
        }
        same_windows(&c, &p, 1, &[5, 6, 7]);
        assert_eq!(p.swa_held(1, 6).unwrap(), 40..90);
        // Out-of-window reads and bad snapshots are typed errors.
        let mut out = vec![0f32; 512];
        assert!(p.swa_read(1, 6, 39..40, &mut out).is_err());
        assert!(p.swa_read(1, 40, 0..1, &mut out).is_err());
        let bad = SwaSnapshot {
            end: 0,
            layers: vec![(6, 0, vec![0u8; 100])],
        };
        assert!(matches!(p.swa_restore(1, &bad), Err(Error::Shape { .. })));
        assert_eq!(
            p.swa_held(1, 6).unwrap(),
            40..90,
            "a refused restore changes nothing"
        );
    }

    #[test]
    fn entries_round_trip_and_the_tail_can_be_rewritten() {
        let g = Geometry::embedded();
        for f in [KvScheme::CSA2, KvScheme::LAUNCH_DAY] {
            let mut c = ContiguousCache::new(&g, f);
            let mut p = PagedCache::host(&g, f, 4).unwrap();
            let x = rows(300, 512, 0.3);
            let y = rows(2, 512, 2.0);
            for cache in [&mut c as &mut dyn KvCache, &mut p] {
                cache.open(1).unwrap();
                // Layer 2 (ratio 2): 128 entries per 256-token block; 300 entries span 3 blocks.
                cache
                    .write_entries(1, 2, RecordKind::Main, 0, &x[..127 * 512])
                    .unwrap();
                cache
                    .write_entries(1, 2, RecordKind::Main, 127, &x[127 * 512..])
                    .unwrap();
                // Rewrite entries 255 and 256 (across a block boundary).
                cache
                    .write_entries(1, 2, RecordKind::Main, 255, &y)
                    .unwrap();
                assert_eq!(cache.entries(1, 2).unwrap(), 300);
            }
            for range in [0..300, 1..2, 127..129, 250..300, 5..5] {
                let a = c.records(1, 2, RecordKind::Main, range.clone()).unwrap();
                let b = p.records(1, 2, RecordKind::Main, range.clone()).unwrap();
                assert!(a[..] == b[..], "{f:?} {range:?}");
            }
            assert_eq!(p.manager().block_table(1).unwrap().len(), 3);
            assert_eq!(p.usage().main_bytes, c.usage().main_bytes);
            // The manager counts the entries, and the C ABI's slot mapping reads them back.
            let m = p.manager();
            assert_eq!(m.stored_entries(1, 2, RecordKind::Main).unwrap(), 300);
            assert_eq!(m.stored_entries(1, 2, RecordKind::Index).unwrap(), 0);
            let slots = m.slot_mapping(1, 2, 255..257).unwrap();
            let rb = f.main.record_bytes();
            let mut rec = vec![0u8; rb];
            m.read_record(2, RecordKind::Main, slots[1], &mut rec)
                .unwrap();
            let want = c.records(1, 2, RecordKind::Main, 256..257).unwrap();
            assert_eq!(&rec[..], &want[..]);
            // A gap is refused by the manager as by the adapter, and changes nothing.
            let e = m
                .append_entries(1, 2, RecordKind::Main, 301, &vec![0u8; rb])
                .unwrap_err();
            assert!(e.to_string().contains("gap"), "{e}");
            assert_eq!(m.stored_entries(1, 2, RecordKind::Main).unwrap(), 300);
        }
    }
}
