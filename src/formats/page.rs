//! Block-planar cache pages (docs/SPEC.md §1): a page of `slots` records stores every slot's data bytes first,
//! then every slot's scale bytes, so a kernel streams one contiguous data region and one small scale
//! region (the FlashMLA / vLLM `kv_formats` layout).

use super::RecordFormat;
use crate::error::{Error, Result};
use crate::shape::Dims;
use crate::tensor::{DType, Device, TensorView, TensorViewMut};
use rayon::prelude::*;

/// One touched page of a pool and the `(slot, row)` pairs that go into it.
type PageRun<'a> = (&'a mut [u8], &'a [(usize, usize)]);

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
        if pb == 0 || !pool_len.is_multiple_of(pb) {
            return Err(Error::shape(
                "page pool bytes",
                format!(
                    "a multiple of the page size {pb} ({} slots × {} B)",
                    self.slots,
                    self.format.record_bytes()
                ),
                pool_len,
            ));
        }
        Ok(pool_len / pb)
    }

    /// [`PageLayout::encode_into_pages`] over tensor views, dispatched on their device: `x`
    /// `[N, dim]` float32, `slot_mapping` `[N]` int64, `pool` a dense uint8 tensor of whole pages,
    /// all on one device. Host memory runs the CPU codec; CUDA memory the kernel of
    /// `kernels/kv_cache.cu` (feature `cuda`; bit-identical), which — like vLLM's
    /// `reshape_and_cache` — does not check the device-resident slots: every slot must be −1 or in
    /// the pool and named once.
    ///
    /// Errors: [`Error::Shape`] for another signature; [`Error::Invalid`] for tensors on different
    /// devices; [`Error::NoCudaBuild`] for CUDA tensors in a build without the `cuda` feature; the
    /// errors of [`PageLayout::encode_into_pages`] on the host and [`Error::Cuda`] on a GPU.
    pub fn encode_into_pages_view(
        &self,
        x: &TensorView<'_>,
        slot_mapping: &TensorView<'_>,
        pool: &mut TensorViewMut<'_>,
    ) -> Result<()> {
        let mut dims = Dims::default();
        dims.bind("dim", self.format.dim());
        x.expect(&signature::X, &mut dims)?;
        slot_mapping.expect(&signature::SLOT_MAPPING, &mut dims)?;
        if pool.dtype() != DType::U8 || !pool.is_contiguous() {
            return Err(Error::shape(
                "pool",
                "a dense uint8 tensor of whole pages",
                format!("{} with strides {:?}", pool.dtype().name(), pool.strides()),
            ));
        }
        let place = crate::tensor::one_device(&[
            ("x", x.device()),
            ("slot_mapping", slot_mapping.device()),
            ("pool", pool.device()),
        ])?;
        match place {
            Device::Cpu => self.encode_into_pages(
                x.as_slice("x")?,
                slot_mapping.as_slice("slot_mapping")?,
                pool.as_mut_slice("pool")?,
            ),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => super::cuda::encode_into_pages_view(self, x, slot_mapping, pool),
            #[cfg(not(feature = "cuda"))]
            d @ Device::Cuda(_) => Err(crate::tensor::no_cuda_build("x", d)),
        }
    }

    /// Checks a slot mapping against a pool of `pool_len` bytes: whole pages, every entry −1 or a
    /// slot of the pool. What a caller of the CUDA codecs (which do not check) runs first.
    ///
    /// Errors: [`Error::Shape`] for a pool that is not whole pages, [`Error::Invalid`] naming
    /// `slot_mapping` for an entry outside −1 or `0..pages·slots`.
    pub fn check_slot_mapping(&self, slot_mapping: &[i64], pool_len: usize) -> Result<()> {
        let pages = self.pages_in(pool_len)?;
        self.mapped_slots(slot_mapping, pages, "slot_mapping")
            .map(|_| ())
    }

    /// Checks a slot mapping against a pool of `pages` pages and returns its `(slot, row)` pairs
    /// sorted by slot, −1 entries left out.
    fn mapped_slots(
        &self,
        slot_mapping: &[i64],
        pages: usize,
        what: &str,
    ) -> Result<Vec<(usize, usize)>> {
        let total = pages * self.slots;
        let mut pairs = Vec::with_capacity(slot_mapping.len());
        for (row, &s) in slot_mapping.iter().enumerate() {
            if s == -1 {
                continue;
            }
            if s < 0 || s as u64 >= total as u64 {
                return Err(Error::invalid(
                    what,
                    format!(
                        "entry {row} = {s} is outside −1 or 0..{total} ({pages} pages × {} slots)",
                        self.slots
                    ),
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
    pub fn encode_into_pages(
        &self,
        x: &[f32],
        slot_mapping: &[i64],
        pool: &mut [u8],
    ) -> Result<()> {
        let dim = self.format.dim();
        if x.len() != slot_mapping.len() * dim {
            return Err(Error::shape(
                "rows to encode (values)",
                format!(
                    "{} ({} slot_mapping entries × {dim})",
                    slot_mapping.len() * dim,
                    slot_mapping.len()
                ),
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
        let mut work: Vec<PageRun> = Vec::new();
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
        let write_page = |(page, run): PageRun| {
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

/// The global slot (page · `page_slots` + offset) of logical row `j` through one block-table row,
/// as every paged kernel addresses it (vLLM's block tables): `table_row[j / page_slots] ·
/// page_slots + j % page_slots`. `None` when `j < 0`, past the row, or in an unmapped block (−1).
pub fn block_table_slot(table_row: &[i32], j: i64, page_slots: usize) -> Option<usize> {
    if j < 0 || page_slots == 0 {
        return None;
    }
    let blk = *table_row.get(j as usize / page_slots)?;
    (blk >= 0).then(|| blk as usize * page_slots + j as usize % page_slots)
}

/// The tensor signature of [`PageLayout::encode_into_pages_view`] (`pool` is any dense uint8
/// tensor of whole pages, checked by the layout).
pub mod signature {
    use crate::shape::{Arg, Dim};
    use crate::tensor::DType;

    /// `[N, dim]` float32 rows to encode (dim = the format's values per record, bound first).
    pub const X: Arg = Arg::read("x", &[DType::F32], &[Dim::Any("N"), Dim::Any("dim")]);
    /// `[N]` int64 slot per row (−1 skips the row; vLLM's `slot_mapping`).
    pub const SLOT_MAPPING: Arg = Arg::read("slot_mapping", &[DType::I64], &[Dim::Any("N")]);
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
    fn rows(fmt: RecordFormat, n: usize, seed: usize) -> Vec<f32> {
        (0..n * fmt.dim())
            .map(|i| (((i + seed) * 2654435761) % 2001) as f32 * 0.003 - 3.0)
            .collect()
    }

    /// Every row lands in its slot exactly as `write` would put it; −1 rows and unnamed slots are
    /// untouched; small (serial) and large (parallel) inputs; slots on page boundaries.
    #[test]
    fn encode_into_pages_matches_slot_writes() {
        for fmt in RecordFormat::ALL {
            for (n_rows, slots, pages) in [(7, 4, 3), (1100, 64, 20), (300, 16, 40)] {
                let lay = PageLayout { format: fmt, slots };
                let x = rows(fmt, n_rows, slots);
                // A scattered, duplicate-free mapping hitting first and last slots of pages, with
                // every fifth row skipped.
                let total = slots * pages;
                let map: Vec<i64> = (0..n_rows)
                    .map(|i| {
                        if i % 5 == 3 {
                            -1
                        } else {
                            ((i * 7919 + slots - 1) % total) as i64
                        }
                    })
                    .collect();
                let mut uniq = map.iter().filter(|&&s| s >= 0).collect::<Vec<_>>();
                uniq.sort();
                uniq.dedup();
                // 7919 is prime and rows < total slots, so the stride never collides.
                assert_eq!(uniq.len(), map.iter().filter(|&&s| s >= 0).count());
                let mut pool = vec![0xA5u8; lay.page_bytes() * pages];
                lay.encode_into_pages(&x, &map, &mut pool).unwrap();
                let mut want = vec![0xA5u8; lay.page_bytes() * pages];
                for (i, &s) in map.iter().enumerate() {
                    if s >= 0 {
                        let (p, o) = (s as usize / slots, s as usize % slots);
                        let page = &mut want[p * lay.page_bytes()..(p + 1) * lay.page_bytes()];
                        lay.write(page, o, &x[i * fmt.dim()..(i + 1) * fmt.dim()])
                            .unwrap();
                    }
                }
                assert!(pool == want, "{fmt:?} rows {n_rows} slots {slots}");
                // And read back through the same mapping (−1 → zeros).
                let mut back = vec![1f32; x.len()];
                lay.decode_from_pages(&pool, &map, &mut back).unwrap();
                let mut one = vec![0f32; fmt.dim()];
                for (i, &s) in map.iter().enumerate() {
                    let got = &back[i * fmt.dim()..(i + 1) * fmt.dim()];
                    if s < 0 {
                        assert!(got.iter().all(|&v| v == 0.0));
                    } else {
                        let p = s as usize / slots;
                        let page = &pool[p * lay.page_bytes()..(p + 1) * lay.page_bytes()];
                        lay.read(page, s as usize % slots, &mut one).unwrap();
                        assert_eq!(got, &one[..]);
                    }
                }
            }
        }
    }

    #[test]
    fn bad_slot_mappings_are_errors_and_write_nothing() {
        let lay = PageLayout {
            format: RecordFormat::Mxfp4Index,
            slots: 4,
        };
        let x = rows(lay.format, 3, 0);
        let mut pool = vec![0u8; lay.page_bytes() * 2];
        let cases: [(&[i64], &str); 4] = [
            (&[0, 8, -1], "outside"),
            (&[0, -2, 1], "outside"),
            (&[5, 1, 5], "named by rows 0 and 2"),
            (&[0, 1], "slot_mapping entries"),
        ];
        for (map, needle) in cases {
            let e = lay
                .encode_into_pages(&x, map, &mut pool)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{map:?}: {e}");
            assert!(pool.iter().all(|&b| b == 0), "{map:?} wrote before failing");
        }
        let mut short = vec![0u8; lay.page_bytes() + 1];
        assert!(lay.encode_into_pages(&x, &[0, 1, 2], &mut short).is_err());
        let mut out = vec![0f32; 128];
        assert!(lay.decode_from_pages(&pool, &[8], &mut out).is_err());
        assert!(lay.decode_from_pages(&pool, &[0, 1], &mut out).is_err());
    }

    #[test]
    fn tensor_view_dispatch_runs_the_cpu_codec_on_host_memory_and_refuses_mixed_devices() {
        let layout = PageLayout {
            format: RecordFormat::Mxfp4Index,
            slots: 4,
        };
        let x: Vec<f32> = (0..3 * 128).map(|i| (i as f32 * 0.37).sin()).collect();
        let map = vec![5i64, -1, 2];
        let mut want = vec![7u8; 2 * layout.page_bytes()];
        layout.encode_into_pages(&x, &map, &mut want).unwrap();
        let mut got = vec![7u8; 2 * layout.page_bytes()];
        let xv = TensorView::from_host_slice(&x, &[3, 128]).unwrap();
        let mv = TensorView::from_host_slice(&map, &[3]).unwrap();
        let n = got.len();
        let mut pv = TensorViewMut::from_host_slice(&mut got, &[n]).unwrap();
        layout.encode_into_pages_view(&xv, &mv, &mut pv).unwrap();
        assert_eq!(got, want);
        // Wrong signature: x rows of 512 for a 128-wide format.
        let xw = TensorView::from_host_slice(&x[..256], &[2, 128]).unwrap();
        let mut pv = TensorViewMut::from_host_slice(&mut got, &[n]).unwrap();
        let e = layout
            .encode_into_pages_view(&xw, &mv, &mut pv)
            .unwrap_err();
        assert!(e.to_string().contains("slot_mapping"), "{e}");
        // A CUDA slot mapping with host rows: refused before anything is read.
        // SAFETY: never dereferenced (the device check comes first).
        let dm = unsafe {
            TensorView::from_raw_parts(0x1000 as *const u8, &[3], &[1], DType::I64, Device::Cuda(0))
        }
        .unwrap();
        let e = layout
            .encode_into_pages_view(&xv, &dm, &mut pv)
            .unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
        assert_eq!(got, want, "nothing written on error");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_views_in_a_build_without_cuda_are_no_cuda_build_errors() {
        let layout = PageLayout {
            format: RecordFormat::Mxfp4Index,
            slots: 4,
        };
        // SAFETY: never dereferenced: the build has no CUDA path.
        let (x, m, mut p) = unsafe {
            (
                TensorView::from_raw_parts(
                    0x1000 as *const u8,
                    &[3, 128],
                    &[128, 1],
                    DType::F32,
                    Device::Cuda(0),
                ),
                TensorView::from_raw_parts(
                    0x2000 as *const u8,
                    &[3],
                    &[1],
                    DType::I64,
                    Device::Cuda(0),
                ),
                TensorViewMut::from_raw_parts(
                    0x3000 as *mut u8,
                    &[272],
                    &[1],
                    DType::U8,
                    Device::Cuda(0),
                ),
            )
        };
        let e = layout
            .encode_into_pages_view(&x.unwrap(), &m.unwrap(), p.as_mut().unwrap())
            .unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
}
