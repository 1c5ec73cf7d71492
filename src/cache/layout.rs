//! Where each KV-source layer's pages live inside one block's slab.
//!
//! One block id names `block_tokens` consecutive tokens of a request. For that block every
//! KV-source layer owns a main-KV page and (when it has an indexer) an index-K page, each
//! block-planar ([`PageLayout`]: all slots' data, then all slots' scales) and each starting on a
//! [`PAGE_ALIGN`] boundary. A ratio-m layer's page holds `block_tokens / m` compressed entries, so a
//! ratio-2 page holds half as many entries as a ratio-1 page for the same tokens. All pages of one
//! block form one contiguous slab (vLLM's per-block slab, PRs #44577/#48993), so one block id and
//! one allocation serve every layer while no two layers share a byte.

use super::spec::{CacheSpec, PAGE_ALIGN};
use crate::formats::page::PageLayout;
use crate::formats::{KvScheme, RecordFormat};
use serde::Serialize;

/// Which of a KV-source layer's two caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// The compressed main KV (attended key = value).
    Main,
    /// The indexer's K.
    Index,
}

impl RecordKind {
    /// The record format this kind of cache stores under `scheme` (main KV or index K).
    pub fn format(self, scheme: &KvScheme) -> RecordFormat {
        match self {
            RecordKind::Main => scheme.main,
            RecordKind::Index => scheme.index,
        }
    }
}

/// One page inside a block slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagePlace {
    /// KV-source layer id.
    pub layer: usize,
    /// Main KV or index K.
    pub kind: RecordKind,
    /// Byte offset of the page inside the slab (a multiple of [`PAGE_ALIGN`]).
    pub offset: usize,
    /// Block-planar layout of the page (format, slots = entries per block).
    pub page: PageLayout,
    /// Compression ratio of the layer.
    pub ratio: usize,
}

impl PagePlace {
    /// Bytes of records in the page (without alignment padding).
    pub fn bytes(&self) -> usize {
        self.page.page_bytes()
    }
    /// Byte range of the page inside the slab.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.bytes()
    }
}

/// The slab of one block: every page of every KV-source layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Pages in layer order, main before index.
    pub pages: Vec<PagePlace>,
    /// Slab bytes (sum of aligned pages).
    pub slab_bytes: usize,
}

fn align(x: usize) -> usize {
    x.div_ceil(PAGE_ALIGN) * PAGE_ALIGN
}

impl BlockLayout {
    /// Lays out the pages of `spec` for blocks of `block_tokens` tokens (checked by
    /// [`CacheSpec::check_block_tokens`] beforehand).
    pub fn new(spec: &CacheSpec, block_tokens: usize) -> BlockLayout {
        let mut pages = Vec::new();
        let mut offset = 0;
        for p in &spec.pools {
            let slots = block_tokens / p.ratio;
            let mut push = |kind, format| {
                let page = PageLayout { format, slots };
                pages.push(PagePlace {
                    layer: p.layer,
                    kind,
                    offset,
                    page,
                    ratio: p.ratio,
                });
                offset += align(page.page_bytes());
            };
            push(RecordKind::Main, p.main);
            if let Some(ix) = p.index {
                push(RecordKind::Index, ix);
            }
        }
        BlockLayout {
            block_tokens,
            pages,
            slab_bytes: offset,
        }
    }

    /// The page of `(layer, kind)`, if that layer is a KV source with that cache.
    pub fn place(&self, layer: usize, kind: RecordKind) -> Option<&PagePlace> {
        self.pages
            .iter()
            .find(|p| p.layer == layer && p.kind == kind)
    }

    /// Record bytes of the first `tokens` tokens of a block (entries that exist: a ratio-m entry
    /// exists once its m tokens are present, docs/SPEC.md §2).
    pub fn record_bytes_for(&self, tokens: usize) -> usize {
        self.pages
            .iter()
            .map(|p| (tokens / p.ratio) * p.page.format.record_bytes())
            .sum()
    }
}
