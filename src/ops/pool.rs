//! vLLM's page pools, addressed in place: the descriptor both the attention and the indexer read.
//!
//! vLLM 0.33 keeps every layer's pages of one block id in one per-block slab. A layer's cache is
//! a `[num_blocks, states_per_page, record_bytes]` uint8 view into that slab: its first byte is
//! offset into the slab and its `stride(0)` is the slab size (139,392 B for the layer set checked
//! in docs/VLLM.md), never `states_per_page · record_bytes`. Inside a page the records sit in one
//! of two ways (the writer kernels in vLLM's `fused_compress_quant_cache.py`, `cache_utils.py`
//! and `indexer_k_store.py` are the source of the rule):
//!
//! - [`PoolLayout::Interleaved`]: a state's scale bytes follow its own data bytes, so a record is
//!   one row of the page (V4.1 NVFP4 288 B, V4.1 MXFP8 528 B);
//! - [`PoolLayout::BlockPlanar`]: the data bytes of every state of the page, then the scale bytes
//!   of every state (V4 584 B, index K MXFP4 68 B and FP8 132 B).
//!
//! [`PoolDesc`] names that addressing; [`PoolView`] pairs it with the borrowed bytes. The
//! attention over pools (`ops::attention::attention_pools`) and the pool indexer
//! (`ops::indexer::logits_in_pool`) resolve each listed slot to its bytes at use, so nothing is
//! gathered or compacted; their CUDA kernels take the same descriptor.

use crate::error::{Error, Result};
use crate::formats::RecordFormat;

/// Where a state's scale bytes sit relative to its data bytes inside a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PoolLayout {
    /// Record `i` of a page is bytes `[i·W, (i+1)·W)`: data, then its own scales.
    Interleaved = crate::formats::abi::POOL_INTERLEAVED as u8,
    /// Data of state `i` at `i·D`, its scales at `states·D + i·S` (all data first).
    BlockPlanar = crate::formats::abi::POOL_BLOCK_PLANAR as u8,
}

impl PoolLayout {
    /// The layout vLLM 0.33's writer kernels use for `format`: interleaved for the V4.1 records
    /// (NVFP4 288 B, MXFP8 528 B), block-planar for the V4 584-B record and the index-K pages.
    pub fn vllm(format: RecordFormat) -> PoolLayout {
        match format {
            RecordFormat::Nvfp4Ds | RecordFormat::Mxfp8 => PoolLayout::Interleaved,
            RecordFormat::V4Record | RecordFormat::Mxfp4Index | RecordFormat::Fp8Index => {
                PoolLayout::BlockPlanar
            }
        }
    }
    /// Parses the C ABI value (0 interleaved, 1 block-planar).
    pub fn from_abi(v: i32) -> Result<PoolLayout> {
        [PoolLayout::Interleaved, PoolLayout::BlockPlanar]
            .into_iter()
            .find(|l| l.abi_id() == v)
            .ok_or_else(|| {
                Error::invalid(
                    "pool layout",
                    format!(
                        "{v} is neither {} (interleaved) nor {} (block-planar)",
                        PoolLayout::Interleaved.abi_id(),
                        PoolLayout::BlockPlanar.abi_id()
                    ),
                )
            })
    }
    /// The `Csa2PoolLayout` value of this layout (`formats::abi`, which the kernels share).
    pub const fn abi_id(self) -> i32 {
        self as i32
    }
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            PoolLayout::Interleaved => "interleaved",
            PoolLayout::BlockPlanar => "block-planar",
        }
    }
}

/// The addressing of one strided page pool. Byte offsets are relative to the pool's first byte
/// (the view's data pointer, already offset into the slab).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolDesc {
    /// Record format of every state.
    pub format: RecordFormat,
    /// How data and scale bytes sit inside a page.
    pub layout: PoolLayout,
    /// Blocks (pages) in the pool (`shape[0]`).
    pub blocks: usize,
    /// States (records) per page (`shape[1]`): tokens for the SWA cache, compressed entries for
    /// the compressed cache.
    pub states_per_page: usize,
    /// Bytes from one page to the next (`stride(0)` of the uint8 view, read, never derived).
    pub block_stride: usize,
}

impl PoolDesc {
    /// Bytes one page's records occupy (`states_per_page · record_bytes`; saturates for a
    /// descriptor [`Self::check`] refuses).
    pub fn page_bytes(&self) -> usize {
        self.states_per_page
            .saturating_mul(self.format.record_bytes())
    }
    /// Global slots (`blocks · states_per_page`; saturates for a descriptor [`Self::check`]
    /// refuses); slot `s` is state `s % states_per_page` of page `s / states_per_page`.
    pub fn slots(&self) -> usize {
        self.blocks.saturating_mul(self.states_per_page)
    }
    /// Bytes from the pool's first byte to the end of its last page (0 for an empty pool).
    pub fn extent(&self) -> usize {
        if self.blocks == 0 {
            0
        } else {
            (self.blocks - 1) * self.block_stride + self.page_bytes()
        }
    }
    /// Validates the descriptor: `states_per_page ≥ 1`, a block stride that keeps pages apart
    /// (≥ the page's bytes when there is more than one page), and an extent that fits `isize`.
    ///
    /// Errors: [`Error::Invalid`] naming `what`.
    pub fn check(&self, what: &str) -> Result<()> {
        if self.states_per_page == 0 {
            return Err(Error::invalid(
                format!("{what} states_per_page"),
                "must be at least 1",
            ));
        }
        // Slot ids are i64 in the kernels and the C ABI; a page's bytes must be a number.
        let page = self.states_per_page.checked_mul(self.format.record_bytes());
        let slots = self
            .blocks
            .checked_mul(self.states_per_page)
            .filter(|&n| n <= i64::MAX as usize);
        if page.is_none() || slots.is_none() {
            return Err(Error::invalid(
                format!("{what} shape"),
                format!(
                    "{} blocks × {} states of {} B overflow the address space",
                    self.blocks,
                    self.states_per_page,
                    self.format.record_bytes()
                ),
            ));
        }
        if self.blocks > 1 && self.block_stride < self.page_bytes() {
            return Err(Error::invalid(
                format!("{what} block stride"),
                format!(
                    "{} B is shorter than one page ({} states × {} B, {}): pages would overlap",
                    self.block_stride,
                    self.states_per_page,
                    self.format.record_bytes(),
                    self.format.name()
                ),
            ));
        }
        let fits = (self.blocks.max(1) - 1)
            .checked_mul(self.block_stride)
            .and_then(|b| b.checked_add(self.page_bytes()))
            .is_some_and(|b| b <= isize::MAX as usize);
        if !fits {
            return Err(Error::invalid(
                format!("{what} extent"),
                format!(
                    "{} blocks × {} B stride overflows the address space",
                    self.blocks, self.block_stride
                ),
            ));
        }
        Ok(())
    }
    /// Byte offsets of `slot`'s data and scale bytes (slot < [`Self::slots`], unchecked).
    #[inline]
    pub fn offsets(&self, slot: usize) -> (usize, usize) {
        let (d, s, w) = (
            self.format.data_bytes(),
            self.format.scale_bytes(),
            self.format.record_bytes(),
        );
        let (page, state) = (slot / self.states_per_page, slot % self.states_per_page);
        let base = page * self.block_stride;
        match self.layout {
            PoolLayout::Interleaved => (base + state * w, base + state * w + d),
            PoolLayout::BlockPlanar => (
                base + state * d,
                base + self.states_per_page * d + state * s,
            ),
        }
    }
}

/// A borrowed strided pool: `bytes[0]` is the pool's first byte and `bytes` covers at least
/// [`PoolDesc::extent`] bytes (the bytes between pages belong to other layers and are not read).
#[derive(Debug, Clone, Copy)]
pub struct PoolView<'a> {
    desc: PoolDesc,
    bytes: &'a [u8],
}

impl<'a> PoolView<'a> {
    /// Checks the descriptor against the bytes.
    ///
    /// Errors: those of [`PoolDesc::check`]; [`Error::Shape`] when `bytes` is shorter than the
    /// extent.
    pub fn new(desc: PoolDesc, bytes: &'a [u8], what: &str) -> Result<PoolView<'a>> {
        desc.check(what)?;
        if bytes.len() < desc.extent() {
            return Err(Error::shape(
                format!("{what} bytes"),
                format!(
                    "at least {} ({} blocks, {} B stride, {}-B {} pages)",
                    desc.extent(),
                    desc.blocks,
                    desc.block_stride,
                    desc.page_bytes(),
                    desc.layout.name()
                ),
                bytes.len(),
            ));
        }
        Ok(PoolView { desc, bytes })
    }
    /// The descriptor.
    pub fn desc(&self) -> &PoolDesc {
        &self.desc
    }
    /// Data and scale bytes of `slot` (panics past [`PoolDesc::slots`]; callers check first).
    #[inline]
    pub fn parts(&self, slot: usize) -> (&'a [u8], &'a [u8]) {
        let (d, s) = self.desc.offsets(slot);
        let f = self.desc.format;
        (
            &self.bytes[d..d + f.data_bytes()],
            &self.bytes[s..s + f.scale_bytes()],
        )
    }
    /// Decodes `slot` (exact, [`RecordFormat::decode_row`]) into `out` (`format.dim()` values).
    pub fn read(&self, slot: usize, out: &mut [f32]) -> Result<()> {
        if slot >= self.desc.slots() {
            return Err(Error::invalid(
                "slot",
                format!("{slot} is outside the pool (0..{})", self.desc.slots()),
            ));
        }
        if out.len() != self.desc.format.dim() {
            return Err(Error::shape(
                "row values",
                self.desc.format.dim(),
                out.len(),
            ));
        }
        let (d, s) = self.parts(slot);
        self.desc.format.decode_row(d, s, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes whose byte or slot counts wrap are refused by `check` (they used to wrap to a small
    /// extent, pass, and panic or misaddress later); `page_bytes` / `slots` saturate instead of
    /// overflowing for such a descriptor.
    #[test]
    fn wrapping_shapes_are_refused() {
        let d = |blocks: usize, states: usize| PoolDesc {
            format: RecordFormat::Nvfp4Ds,
            layout: PoolLayout::Interleaved,
            blocks,
            states_per_page: states,
            block_stride: 288,
        };
        for (b, s) in [(1, (1usize << 59) + 1), (usize::MAX / 2, 4), (1 << 62, 4)] {
            let e = d(b, s).check("pool").unwrap_err();
            assert!(e.to_string().contains("overflow"), "{b} × {s}: {e}");
            let _ = (d(b, s).page_bytes(), d(b, s).slots());
        }
        d(1, 64).check("pool").unwrap();
    }
}
