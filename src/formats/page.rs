//! Block-planar cache pages (SPEC §1): a page of `slots` records stores every slot's data bytes first,
//! then every slot's scale bytes, so a kernel streams one contiguous data region and one small scale
//! region (the FlashMLA / vLLM `kv_formats` layout).

use super::RecordFormat;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// A view of one block-planar page layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLayout {
    /// Record format of every slot.
    pub format: RecordFormat,
    /// Slots (records) per page.
    pub slots: usize,
}

impl PageLayout {
    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.slots * self.format.record_bytes()
    }
    /// Byte ranges (data, scale) of `slot` inside a page.
    pub fn slot_ranges(&self, slot: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (db, sb) = (self.format.data_bytes(), self.format.scale_bytes());
        let s0 = self.slots * db + slot * sb;
        (slot * db..(slot + 1) * db, s0..s0 + sb)
    }
    fn check(&self, page: usize, slot: usize, values: usize) -> Result<()> {
        if page != self.page_bytes() {
            return Err(Error::shape("page bytes", self.page_bytes(), page));
        }
        if slot >= self.slots {
            return Err(Error::invalid(
                "slot",
                format!("{slot} is out of range 0..{}", self.slots),
            ));
        }
        if values != self.format.dim() {
            return Err(Error::shape("row values", self.format.dim(), values));
        }
        Ok(())
    }
    /// Encodes one row into `slot` of `page`.
    pub fn write(&self, page: &mut [u8], slot: usize, row: &[f32]) -> Result<()> {
        self.check(page.len(), slot, row.len())?;
        let (d, s) = self.slot_ranges(slot);
        let (data, scales) = page.split_at_mut(self.slots * self.format.data_bytes());
        let s = s.start - data.len()..s.end - data.len();
        self.format.encode_row(row, &mut data[d], &mut scales[s]);
        Ok(())
    }
    /// Decodes `slot` of `page` into `out`.
    pub fn read(&self, page: &[u8], slot: usize, out: &mut [f32]) -> Result<()> {
        self.check(page.len(), slot, out.len())?;
        let (d, s) = self.slot_ranges(slot);
        self.format.decode_row(&page[d], &page[s], out);
        Ok(())
    }
    /// Copies `slot` out as a standalone record (data then scales).
    pub fn record(&self, page: &[u8], slot: usize) -> Result<Vec<u8>> {
        self.check(page.len(), slot, self.format.dim())?;
        let (d, s) = self.slot_ranges(slot);
        let mut r = page[d].to_vec();
        r.extend_from_slice(&page[s]);
        Ok(r)
    }

    /// Pages held by a pool buffer of `pool_len` bytes. Errors: [`Error::Shape`] when the pool is not
    /// a whole number of pages.
    pub fn pages_in(&self, pool_len: usize) -> Result<usize> {
        let pb = self.page_bytes();
        if pb == 0 || pool_len % pb != 0 {
            return Err(Error::shape(
                "page pool bytes",
                format!("a multiple of the page size {pb} ({} slots × {} B)", self.slots, self.format.record_bytes()),
                pool_len,
            ));
        }
        Ok(pool_len / pb)
    }

    /// Checks a slot mapping against a pool of `pages` pages and returns its `(slot, row)` pairs
    /// sorted by slot, −1 entries left out.
    fn mapped_slots(&self, slot_mapping: &[i64], pages: usize, what: &str) -> Result<Vec<(usize, usize)>> {
        let total = pages * self.slots;
        let mut pairs = Vec::with_capacity(slot_mapping.len());
        for (row, &s) in slot_mapping.iter().enumerate() {
            if s == -1 {
                continue;
            }
            if s < 0 || s as u64 >= total as u64 {
                return Err(Error::invalid(
                    what,
                    format!("entry {row} = {s} is outside −1 or 0..{total} ({pages} pages × {} slots)", self.slots),
                ));
            }
            pairs.push((s as usize, row));
        }
        pairs.sort_unstable();
        Ok(pairs)
    }

    /// Encodes `x` (rows × `format.dim()` f32) straight into a pool of block-planar pages: row `i`
    /// goes to slot `slot_mapping[i]` = page · `slots` + offset, and −1 skips the row (vLLM's
    /// `slot_mapping` convention, `reshape_and_cache`). Slots not named are left untouched. Rows run
    /// in parallel over pages for large inputs, with the SIMD row codec of [`super::fast::Isa::best`].
    ///
    /// Errors: [`Error::Shape`] when `x` is not `slot_mapping.len()` rows or the pool is not whole
    /// pages; [`Error::Invalid`] naming `slot_mapping` for an entry outside −1 or `0..pages·slots`, or
    /// a slot named twice (the result would depend on the write order). Nothing is written on error.
    pub fn encode_into_pages(&self, x: &[f32], slot_mapping: &[i64], pool: &mut [u8]) -> Result<()> {
        let dim = self.format.dim();
        if x.len() != slot_mapping.len() * dim {
            return Err(Error::shape(
                "rows to encode (values)",
                format!("{} ({} slot_mapping entries × {dim})", slot_mapping.len() * dim, slot_mapping.len()),
                x.len(),
            ));
        }
        let pages = self.pages_in(pool.len())?;
        let pairs = self.mapped_slots(slot_mapping, pages, "slot_mapping")?;
        if let Some(w) = pairs.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::invalid(
                "slot_mapping",
                format!("slot {} is named by rows {} and {}", w[0].0, w[0].1, w[1].1),
            ));
        }
        // Cut the pool into the touched pages, each with its run of (slot, row) pairs.
        let pb = self.page_bytes();
        let mut work: Vec<(&mut [u8], &[(usize, usize)])> = Vec::new();
        let mut rest = pool;
        let mut next_page = 0;
        let mut i = 0;
        while i < pairs.len() {
            let page = pairs[i].0 / self.slots;
            let j = i + pairs[i..].partition_point(|p| p.0 / self.slots == page);
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((page - next_page) * pb);
            let (this, tail) = tail.split_at_mut(pb);
            rest = tail;
            next_page = page + 1;
            work.push((this, &pairs[i..j]));
            i = j;
        }
        let isa = super::fast::Isa::best();
        let (db, slots) = (self.format.data_bytes(), self.slots);
        let sb = self.format.scale_bytes();
        let fmt = self.format;
        let write_page = |(page, run): (&mut [u8], &[(usize, usize)])| {
            let (data, scales) = page.split_at_mut(slots * db);
            for &(slot, row) in run {
                let off = slot % slots;
                super::fast::encode_row(
                    isa,
                    fmt,
                    &x[row * dim..(row + 1) * dim],
                    &mut data[off * db..(off + 1) * db],
                    &mut scales[off * sb..(off + 1) * sb],
                );
            }
        };
        if pairs.len() < 2 * super::ROWS_PER_TASK || work.len() < 2 {
            work.into_iter().for_each(write_page);
        } else {
            work.into_par_iter().for_each(write_page);
        }
        Ok(())
    }

    /// Decodes the records at `slots` (page · `slots` + offset; −1 gives a row of zeros) from a pool
    /// of pages into `out` (slots.len() × `format.dim()` f32), in parallel for large inputs.
    ///
    /// Errors: [`Error::Shape`] for a wrong `out` length or a pool that is not whole pages;
    /// [`Error::Invalid`] naming `slots` for an entry outside −1 or `0..pages·slots`.
    pub fn decode_from_pages(&self, pool: &[u8], slots: &[i64], out: &mut [f32]) -> Result<()> {
        let dim = self.format.dim();
        if out.len() != slots.len() * dim {
            return Err(Error::shape(
                "decoded rows (values)",
                format!("{} ({} slots × {dim})", slots.len() * dim, slots.len()),
                out.len(),
            ));
        }
        let pages = self.pages_in(pool.len())?;
        self.mapped_slots(slots, pages, "slots")?;
        let isa = super::fast::Isa::best();
        let read = |(o, &s): (&mut [f32], &i64)| {
            if s < 0 {
                o.fill(0.0);
                return;
            }
            let (page, off) = (s as usize / self.slots, s as usize % self.slots);
            let p = &pool[page * self.page_bytes()..(page + 1) * self.page_bytes()];
            let (d, sc) = self.slot_ranges(off);
            super::fast::decode_row(isa, self.format, &p[d], &p[sc], o);
        };
        if slots.len() < 2 * super::ROWS_PER_TASK {
            out.chunks_exact_mut(dim).zip(slots).for_each(read);
        } else {
            out.par_chunks_exact_mut(dim)
                .zip(slots.par_iter())
                .with_min_len(super::ROWS_PER_TASK)
                .for_each(read);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_matches_standalone_record() {
        for fmt in RecordFormat::ALL {
            let lay = PageLayout {
                format: fmt,
                slots: 4,
            };
            let mut page = vec![0u8; lay.page_bytes()];
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|r| {
                    (0..fmt.dim())
                        .map(|i| ((i * 7 + r * 13) % 23) as f32 * 0.1 - 1.1)
                        .collect()
                })
                .collect();
            for (s, row) in rows.iter().enumerate() {
                lay.write(&mut page, s, row).unwrap();
            }
            for (s, row) in rows.iter().enumerate() {
                let mut rec = vec![0u8; fmt.record_bytes()];
                crate::formats::encode_rows(fmt, row, &mut rec).unwrap();
                assert_eq!(lay.record(&page, s).unwrap(), rec, "{fmt:?} slot {s}");
            }
            assert!(lay.write(&mut page, 4, &rows[0]).is_err());
        }
    }
}
