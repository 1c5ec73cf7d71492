//! Block-planar cache pages (SPEC §1): a page of `slots` records stores every slot's data bytes first,
//! then every slot's scale bytes, so a kernel streams one contiguous data region and one small scale
//! region (the FlashMLA / vLLM `kv_formats` layout).

use super::RecordFormat;
use crate::error::{Error, Result};

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
