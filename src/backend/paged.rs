//! [`PagedCache`]: the [`KvCache`] trait over the paged [`CacheManager`] — block tables, slot
//! mapping, block-planar pages per KV-source layer and per-request SWA rings (docs/SPEC.md §1, `crate::cache`).
//!
//! The stack sees exactly what [`super::ContiguousCache`] gives it (same records, same window rules,
//! so the same hidden states bit for bit); only where the bytes live differs:
//! - compressed entries are encoded into standalone records, mapped to slots by the manager's slot
//!   mapping (vLLM's `block_table[i // S]·S + i % S`) and scattered into the block-planar pages;
//!   blocks are allocated as entries grow (one block covers `block_tokens` tokens of every
//!   KV-source layer), so a full pool surfaces as [`Error::OutOfBlocks`] before anything changes;
//! - [`KvCache::records`] gathers a range back into standalone records, one page lock per block;
//! - SWA rows go to the manager's per-request ring; the held range (window start and restarts on a
//!   non-continuing write) is tracked here, since the ring itself only knows its newest position;
//! - the compressor carry is the stack's own [`CompressorState`] and is kept here per request (the
//!   trait hands out `&mut` to it); its bytes are counted as in the contiguous cache.
//!
//! Request ids are the manager's ids unchanged, so a manager shared with other users (the C ABI)
//! must not reuse them. Prefix publishing and adoption stay with the manager's callers: this
//! adapter never seals a block.

use super::cache::{checks, CacheUsage, KvCache, Region, ReqId, SwaSnapshot};
use crate::cache::{CacheConfig, CacheManager, CacheSpec, RecordKind};
use crate::error::{Error, Result};
use crate::formats::KvScheme;
use crate::formats::{decode_rows, encode_rows, KV_DIM};
use crate::geometry::Geometry;
use crate::ops::compressor::CompressorState;
use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// One KV-source layer as the adapter sees it.
#[derive(Debug, Clone, Copy)]
struct Pool {
    layer: usize,
    ratio: usize,
}

#[derive(Debug)]
struct ReqState {
    /// Stored entries per pool (index into `PagedCache::pools`): [main, index].
    entries: Vec<[usize; 2]>,
    /// Per layer: the SWA positions held (None: no window since open or drop).
    swa: Vec<Option<Range<usize>>>,
    carry: HashMap<usize, Option<CompressorState>>,
}

/// The [`KvCache`] trait over a shared paged [`CacheManager`] (see the module docs).
#[derive(Debug)]
pub struct PagedCache {
    manager: Arc<CacheManager>,
    formats: KvScheme,
    pools: Vec<Pool>,
    num_layers: usize,
    window: usize,
    reqs: HashMap<ReqId, ReqState>,
}

fn kind(region: Region) -> RecordKind {
    match region {
        Region::Main => RecordKind::Main,
        Region::Index => RecordKind::Index,
    }
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
            pools: spec
                .pools
                .iter()
                .map(|p| Pool {
                    layer: p.layer,
                    ratio: p.ratio,
                })
                .collect(),
            num_layers: spec.num_layers,
            window: spec.window,
            reqs: HashMap::new(),
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

    fn pool(&self, layer: usize) -> Result<usize> {
        self.pools
            .iter()
            .position(|p| p.layer == layer)
            .ok_or_else(|| {
                Error::invalid(
                    "layer",
                    format!(
                        "layer {layer} owns no global KV (KV-source layers: {:?})",
                        self.pools.iter().map(|p| p.layer).collect::<Vec<_>>()
                    ),
                )
            })
    }
    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.num_layers {
            Ok(())
        } else {
            Err(Error::invalid(
                "layer",
                format!("{layer} is out of range 0..{}", self.num_layers),
            ))
        }
    }
    fn req(&self, req: ReqId) -> Result<&ReqState> {
        self.reqs
            .get(&req)
            .ok_or_else(|| Error::NotFound(format!("request {req} is not in the KV cache")))
    }
    fn req_mut(&mut self, req: ReqId) -> Result<&mut ReqState> {
        self.reqs
            .get_mut(&req)
            .ok_or_else(|| Error::NotFound(format!("request {req} is not in the KV cache")))
    }

    /// Points `layer`'s ring at `start` with `records` (oldest first), replacing what it held.
    fn swa_reset(&mut self, req: ReqId, layer: usize, start: usize, records: &[u8]) -> Result<()> {
        self.manager.swa_clear(req, layer)?;
        self.manager.swa_write_rows(req, layer, start, records)?;
        let n = records.len() / self.formats.swa.record_bytes();
        self.req_mut(req)?.swa[layer] = Some(start..start + n);
        Ok(())
    }
}

impl KvCache for PagedCache {
    fn formats(&self) -> KvScheme {
        self.formats
    }

    fn open(&mut self, req: ReqId) -> Result<()> {
        if self.reqs.contains_key(&req) {
            return Err(Error::invalid(
                "request",
                format!("request {req} is already open"),
            ));
        }
        self.manager.add_request(req)?;
        self.reqs.insert(
            req,
            ReqState {
                entries: vec![[0; 2]; self.pools.len()],
                swa: vec![None; self.num_layers],
                carry: HashMap::new(),
            },
        );
        Ok(())
    }

    fn contains(&self, req: ReqId) -> bool {
        self.reqs.contains_key(&req)
    }

    fn close(&mut self, req: ReqId) -> Result<()> {
        self.req(req)?;
        self.manager.free_request(req)?;
        self.reqs.remove(&req);
        Ok(())
    }

    fn entries(&self, req: ReqId, layer: usize) -> Result<usize> {
        let p = self.pool(layer)?;
        Ok(self.req(req)?.entries[p][0])
    }

    fn write_entries(
        &mut self,
        req: ReqId,
        layer: usize,
        region: Region,
        first: usize,
        rows: &[f32],
    ) -> Result<()> {
        let p = self.pool(layer)?;
        let fmt = region.format(&self.formats);
        let n = checks::row_count(&format!("layer {layer} {region:?} rows"), fmt, rows)?;
        let r = region as usize;
        let count = self.req(req)?.entries[p][r];
        checks::no_gap(layer, region, first, count)?;
        if n == 0 {
            return Ok(());
        }
        let rb = fmt.record_bytes();
        let mut recs = vec![0u8; n * rb];
        encode_rows(fmt, rows, &mut recs)?;
        // Entry j of a ratio-m layer covers tokens [j·m, j·m + m): grow the block table first, so
        // an exhausted pool fails before any slot is touched.
        self.manager
            .allocate(req, (first + n) * self.pools[p].ratio)?;
        let slots = self.manager.slot_mapping(req, layer, first..first + n)?;
        let k = kind(region);
        self.manager.check_writable(layer, k, &slots)?;
        for (slot, rec) in slots.iter().zip(recs.chunks_exact(rb)) {
            self.manager.write_record(layer, k, *slot, rec)?;
        }
        let c = &mut self.req_mut(req)?.entries[p][r];
        *c = (*c).max(first + n);
        Ok(())
    }

    fn records(
        &self,
        req: ReqId,
        layer: usize,
        region: Region,
        range: Range<usize>,
    ) -> Result<Cow<'_, [u8]>> {
        let p = self.pool(layer)?;
        let count = self.req(req)?.entries[p][region as usize];
        checks::stored(layer, region, &range, count)?;
        if range.is_empty() {
            return Ok(Cow::Borrowed(&[]));
        }
        let k = kind(region);
        let place = *self
            .manager
            .block_layout()
            .place(layer, k)
            .ok_or_else(|| Error::Internal(format!("layer {layer} has no {k:?} page")))?;
        let (page, slots_per_block) = (place.page, place.page.slots as u64);
        let fmt = page.format;
        let (rb, db) = (fmt.record_bytes(), fmt.data_bytes());
        let slots = self.manager.slot_mapping(req, layer, range)?;
        let mut out = vec![0u8; slots.len() * rb];
        // Consecutive entries share a block until the page is full: one page lock per block run.
        let mut i = 0;
        while i < slots.len() {
            let block = slots[i] / slots_per_block;
            let run = slots[i..]
                .iter()
                .take_while(|&&s| s / slots_per_block == block)
                .count();
            let dst = &mut out[i * rb..(i + run) * rb];
            self.manager.with_page(layer, k, block as u32, |pg| {
                for (s, o) in slots[i..i + run].iter().zip(dst.chunks_exact_mut(rb)) {
                    let (d, sc) = page.slot_ranges((s % slots_per_block) as usize);
                    o[..db].copy_from_slice(&pg[d]);
                    o[db..].copy_from_slice(&pg[sc]);
                }
            })?;
            i += run;
        }
        Ok(Cow::Owned(out))
    }

    fn swa_write(&mut self, req: ReqId, layer: usize, first: usize, rows: &[f32]) -> Result<()> {
        self.check_layer(layer)?;
        let fmt = self.formats.swa;
        let n = checks::row_count(&format!("layer {layer} SWA rows"), fmt, rows)?;
        let w = self.window;
        let held = self.req(req)?.swa[layer].clone();
        // Only the newest `window` rows can survive: encode just those.
        let skip = n.saturating_sub(w);
        let mut recs = vec![0u8; (n - skip) * fmt.record_bytes()];
        encode_rows(fmt, &rows[skip * fmt.dim()..], &mut recs)?;
        let start = match held {
            Some(h) if h.end == first => h.start,
            // A write that does not continue the window restarts it (replay, decoder jump).
            _ => {
                self.manager.swa_clear(req, layer)?;
                first
            }
        };
        self.manager
            .swa_write_rows(req, layer, first + skip, &recs)?;
        let end = first + n;
        self.req_mut(req)?.swa[layer] = Some(start.max(end.saturating_sub(w))..end);
        Ok(())
    }

    fn swa_held(&self, req: ReqId, layer: usize) -> Result<Range<usize>> {
        self.check_layer(layer)?;
        Ok(self.req(req)?.swa[layer].clone().unwrap_or(0..0))
    }

    fn swa_read(
        &self,
        req: ReqId,
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

    fn swa_snapshot(&self, req: ReqId, layers: &[usize]) -> Result<SwaSnapshot> {
        let st = self.req(req)?;
        let rb = self.formats.swa.record_bytes();
        let mut out = SwaSnapshot {
            end: 0,
            layers: vec![],
        };
        for &l in layers {
            self.check_layer(l)?;
            let Some(held) = st.swa[l].clone() else {
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

    fn swa_restore(&mut self, req: ReqId, snap: &SwaSnapshot) -> Result<()> {
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
            self.swa_reset(req, *l, *start, recs)?;
        }
        Ok(())
    }

    fn swa_drop(&mut self, req: ReqId, layers: &[usize]) -> Result<()> {
        for &l in layers {
            self.check_layer(l)?;
        }
        self.req(req)?;
        for &l in layers {
            self.manager.swa_clear(req, l)?;
            self.req_mut(req)?.swa[l] = None;
        }
        Ok(())
    }

    fn carry(&mut self, req: ReqId, layer: usize) -> Result<&mut Option<CompressorState>> {
        self.pool(layer)?;
        Ok(self.req_mut(req)?.carry.entry(layer).or_default())
    }

    fn carry_drop(&mut self, req: ReqId) -> Result<()> {
        self.req_mut(req)?.carry.clear();
        Ok(())
    }

    /// Global bytes: `main_bytes`/`index_bytes` are the records stored, `global_allocated` the
    /// slab bytes of the blocks in use, read from the manager's allocator ([`CacheManager::stats`]);
    /// `swa_bytes` the manager's live rings (allocated for every layer when a request opens).
    fn usage(&self) -> CacheUsage {
        let s = self.manager.stats();
        let mut u = CacheUsage {
            requests: self.reqs.len(),
            global_allocated: s.in_use_bytes,
            swa_bytes: s.session_bytes,
            ..Default::default()
        };
        let (mb, ib) = (
            self.formats.main.record_bytes(),
            self.formats.index.record_bytes(),
        );
        for st in self.reqs.values() {
            for e in &st.entries {
                u.main_bytes += e[0] * mb;
                u.index_bytes += e[1] * ib;
            }
            u.carry_bytes += st
                .carry
                .values()
                .flatten()
                .map(|c| c.pending_tokens() * 2 * KV_DIM * 4)
                .sum::<usize>();
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

    /// Every window the two caches hold agrees, range and rows.
    fn same_windows(c: &ContiguousCache, p: &PagedCache, req: ReqId, layers: &[usize]) {
        for &l in layers {
            let h = c.swa_held(req, l).unwrap();
            assert_eq!(p.swa_held(req, l).unwrap(), h, "layer {l}");
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
                    .write_entries(1, 2, Region::Main, 0, &x[..127 * 512])
                    .unwrap();
                cache
                    .write_entries(1, 2, Region::Main, 127, &x[127 * 512..])
                    .unwrap();
                // Rewrite entries 255 and 256 (across a block boundary).
                cache.write_entries(1, 2, Region::Main, 255, &y).unwrap();
                assert_eq!(cache.entries(1, 2).unwrap(), 300);
            }
            for range in [0..300, 1..2, 127..129, 250..300, 5..5] {
                let a = c.records(1, 2, Region::Main, range.clone()).unwrap();
                let b = p.records(1, 2, Region::Main, range.clone()).unwrap();
                assert!(a[..] == b[..], "{f:?} {range:?}");
            }
            assert_eq!(p.manager().block_table(1).unwrap().len(), 3);
            assert_eq!(p.usage().main_bytes, c.usage().main_bytes);
        }
    }
}
