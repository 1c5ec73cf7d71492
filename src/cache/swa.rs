//! Per-request SWA rings: `window` records per layer (ring slot = position mod window) and, per
//! layer, the positions the ring holds.
//!
//! The held range is what a read may return: at most the newest `window` positions, and never a
//! position the ring did not receive since the window (re)started. A write that continues or
//! overlaps the held positions extends them; a write past them (a gap) restarts the window at its
//! first position, so the skipped positions are not readable (their slots hold older tokens);
//! [`CacheManager::swa_restart`] restarts it explicitly (a replay, a decoder window rebuilt from
//! scratch) and [`CacheManager::swa_clear`] forgets it.

use super::{check_position, CacheManager, RequestId, MAX_POSITION};
use crate::error::{try_vec, Error, Result};
use std::ops::Range;

/// One request's rings (behind the request's session lock).
pub(super) struct SwaRing {
    /// `num_layers × window` SWA records (Host backing; empty with Accounting).
    data: Vec<u8>,
    /// Per layer, the positions held (None: nothing since open or clear).
    held: Vec<Option<Range<usize>>>,
}

impl SwaRing {
    /// Rings for `num_layers` layers of `bytes` in all (0: accounting only, nothing allocated).
    pub(super) fn new(num_layers: usize, bytes: usize) -> Result<SwaRing> {
        Ok(SwaRing {
            data: if bytes > 0 {
                try_vec(bytes, 0u8, "SWA ring")?
            } else {
                Vec::new()
            },
            held: vec![None; num_layers],
        })
    }

    /// Ring bytes allocated.
    pub(super) fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Whether `layer` holds every position of `range` (non-empty).
    fn holds(&self, layer: usize, range: &Range<usize>) -> bool {
        matches!(&self.held[layer], Some(h) if h.start <= range.start && range.end <= h.end)
    }

    /// The held range after writing `pos_start .. end`, with `window` positions at most.
    fn extend(&mut self, layer: usize, pos_start: usize, end: usize, window: usize) {
        let (lo, hi) = match &self.held[layer] {
            // Continues or overlaps what is held: one window.
            Some(h) if pos_start <= h.end => (h.start.min(pos_start), h.end.max(end)),
            // Nothing held, or a gap after it: the window restarts here.
            _ => (pos_start, end),
        };
        self.held[layer] = Some(lo.max(hi.saturating_sub(window))..hi);
    }
}

impl CacheManager {
    fn swa_offset(&self, layer: usize, pos: usize) -> Result<Range<usize>> {
        if layer >= self.spec.num_layers {
            return Err(Error::invalid(
                "layer",
                format!("{layer} is out of range 0..{}", self.spec.num_layers),
            ));
        }
        let rec = self.spec.swa_format.record_bytes();
        let o = (layer * self.spec.window + pos % self.spec.window) * rec;
        Ok(o..o + rec)
    }

    /// Errors with [`Error::Invalid`] when a write at `pos` is older than `layer`'s window.
    fn check_not_older(ring: &SwaRing, layer: usize, pos: usize, window: usize) -> Result<()> {
        let hi = ring.held[layer].as_ref().map_or(0, |h| h.end);
        if pos.saturating_add(window) < hi {
            return Err(Error::invalid(
                "pos",
                format!(
                    "{pos} is older than layer {layer}'s window (newest {})",
                    hi - 1
                ),
            ));
        }
        Ok(())
    }

    /// Writes the SWA record of token `pos` for `layer` into request `id`'s ring (slot `pos mod
    /// window`). Positions must not go backwards by more than the window.
    ///
    /// Errors: [`Error::NotFound`], [`Error::Invalid`] (layer, `pos` older than the ring keeps or
    /// not below [`MAX_POSITION`]), [`Error::Shape`] (record length), [`Error::Unsupported`]
    /// (accounting backing).
    pub fn swa_write(&self, id: RequestId, layer: usize, pos: usize, record: &[u8]) -> Result<()> {
        self.host_only()?;
        check_position("pos", pos)?;
        let rec = self.spec.swa_format.record_bytes();
        if record.len() != rec {
            return Err(Error::shape("SWA record", rec, record.len()));
        }
        let r = self.swa_offset(layer, pos)?;
        let s = self.session(id)?;
        let mut st = s.lock();
        let ring = &mut st.swa;
        Self::check_not_older(ring, layer, pos, self.spec.window)?;
        ring.data[r].copy_from_slice(record);
        ring.extend(layer, pos, pos + 1, self.spec.window);
        Ok(())
    }

    /// Reads the SWA record of token `pos` for `layer` from request `id`'s ring.
    ///
    /// Errors: [`Error::NotFound`] when `pos` is not held (outside the newest `window`
    /// positions, skipped by a gap, or nothing written); otherwise as [`CacheManager::swa_write`].
    pub fn swa_read(&self, id: RequestId, layer: usize, pos: usize, out: &mut [u8]) -> Result<()> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        if out.len() != rec {
            return Err(Error::shape("SWA record", rec, out.len()));
        }
        let r = self.swa_offset(layer, pos)?;
        let s = self.session(id)?;
        let st = s.lock();
        if st.swa.holds(layer, &(pos..pos.saturating_add(1))) {
            out.copy_from_slice(&st.swa.data[r]);
            return Ok(());
        }
        Err(Error::NotFound(format!(
            "SWA position {pos} of layer {layer} (window ends at {:?})",
            st.swa.held[layer].as_ref().map(|h| h.end)
        )))
    }

    /// Writes the SWA records of tokens `pos_start ..` (`records.len() / record_bytes` of them, in
    /// position order) for `layer` into request `id`'s ring, all or nothing: every check runs before
    /// the first byte is copied. With more tokens than the window, only the newest `window` survive,
    /// as with one [`CacheManager::swa_write`] per token.
    ///
    /// Errors: as [`CacheManager::swa_write`]; [`Error::Shape`] when `records` is not whole records.
    pub fn swa_write_rows(
        &self,
        id: RequestId,
        layer: usize,
        pos_start: usize,
        records: &[u8],
    ) -> Result<()> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        if !records.len().is_multiple_of(rec) {
            return Err(Error::shape(
                "SWA records",
                format!("a multiple of {rec} bytes"),
                records.len(),
            ));
        }
        let n = records.len() / rec;
        let end = pos_start
            .checked_add(n)
            .filter(|&e| e <= MAX_POSITION)
            .ok_or_else(|| {
                Error::invalid(
                    "pos",
                    format!(
                        "tokens {pos_start} + {n} reach past the maximum position 2^62 ({MAX_POSITION})"
                    ),
                )
            })?;
        self.swa_offset(layer, pos_start)?;
        let s = self.session(id)?;
        let mut st = s.lock();
        let w = self.spec.window;
        Self::check_not_older(&st.swa, layer, pos_start, w)?;
        // Only the newest `window` tokens of the batch can survive in the ring.
        let skip = n.saturating_sub(w);
        for (i, r) in records.chunks_exact(rec).enumerate().skip(skip) {
            let o = self.swa_offset(layer, pos_start + i)?;
            st.swa.data[o].copy_from_slice(r);
        }
        if n > 0 {
            st.swa.extend(layer, pos_start, end, w);
        }
        Ok(())
    }

    /// Reads the SWA records of tokens `pos_start ..` (`out.len() / record_bytes` of them) of
    /// `layer` from request `id`'s ring. Every position must be held; `out` is written only when
    /// all are.
    ///
    /// Errors: as [`CacheManager::swa_read`]; [`Error::Shape`] when `out` is not whole records.
    pub fn swa_read_rows(
        &self,
        id: RequestId,
        layer: usize,
        pos_start: usize,
        out: &mut [u8],
    ) -> Result<()> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        if !out.len().is_multiple_of(rec) {
            return Err(Error::shape(
                "SWA records",
                format!("a multiple of {rec} bytes"),
                out.len(),
            ));
        }
        let n = out.len() / rec;
        self.swa_offset(layer, pos_start)?;
        let s = self.session(id)?;
        let st = s.lock();
        if n > 0
            && !st
                .swa
                .holds(layer, &(pos_start..pos_start.saturating_add(n)))
        {
            return Err(Error::NotFound(format!(
                "SWA positions {pos_start}..{} of layer {layer} (window ends at {:?})",
                pos_start.saturating_add(n),
                st.swa.held[layer].as_ref().map(|h| h.end)
            )));
        }
        for (i, o) in out.chunks_exact_mut(rec).enumerate() {
            let r = self.swa_offset(layer, pos_start + i)?;
            o.copy_from_slice(&st.swa.data[r]);
        }
        Ok(())
    }

    /// The newest SWA position written + 1 for `layer` of request `id` (`None` before any write):
    /// positions [`CacheManager::swa_held`] are readable.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (layer).
    pub fn swa_newest(&self, id: RequestId, layer: usize) -> Result<Option<usize>> {
        Ok(self.swa_window(id, layer)?.map(|h| h.end))
    }

    /// The positions `layer`'s ring holds for request `id` (`None` before any write, after a
    /// clear; an empty range right after [`CacheManager::swa_restart`]).
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (layer).
    pub fn swa_window(&self, id: RequestId, layer: usize) -> Result<Option<Range<usize>>> {
        self.swa_offset(layer, 0)?;
        let s = self.session(id)?;
        let st = s.lock();
        Ok(st.swa.held[layer].clone())
    }

    /// Forgets `layer`'s SWA window of request `id` (the ring bytes stay allocated): the next
    /// write may start at any position, e.g. a window restart on a replay or a dropped decoder
    /// window.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (layer).
    pub fn swa_clear(&self, id: RequestId, layer: usize) -> Result<()> {
        self.swa_offset(layer, 0)?;
        let s = self.session(id)?;
        s.lock().swa.held[layer] = None;
        Ok(())
    }

    /// Restarts `layer`'s SWA window of request `id` at `pos`, holding nothing yet: the window of
    /// a replay or of a rebuilt decoder layer starts there, and later writes continue from it.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (layer, `pos` not below
    /// [`MAX_POSITION`]).
    pub fn swa_restart(&self, id: RequestId, layer: usize, pos: usize) -> Result<()> {
        check_position("pos", pos)?;
        self.swa_offset(layer, 0)?;
        let s = self.session(id)?;
        s.lock().swa.held[layer] = Some(pos..pos);
        Ok(())
    }

    /// Copies the SWA windows of the snapshotted layers (`spec.snapshot_layers`) of request `id`,
    /// in layer order, each window in ring order rotated so the oldest token comes first. This is
    /// the DRAM-tier snapshot (V4.1: the encoder layers only).
    pub fn swa_snapshot(&self, id: RequestId) -> Result<Vec<u8>> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        let w = self.spec.window;
        let s = self.session(id)?;
        let st = s.lock();
        let mut out = Vec::with_capacity(self.spec.snapshot_bytes());
        for &l in &self.spec.snapshot_layers {
            let hi = st.swa.held[l].as_ref().map_or(0, |h| h.end);
            let base = l * w * rec;
            for i in 0..w {
                let slot = (hi + i) % w;
                out.extend_from_slice(&st.swa.data[base + slot * rec..base + (slot + 1) * rec]);
            }
        }
        Ok(out)
    }
}
