//! How the split-over-keys attention kernel (`attn_pools_bf16_split`, `kernels/attention.cu`) cuts
//! a decode batch: a pure function of the batch shape and the device, so the launch needs no
//! look at device memory (the per-token lengths stay on the device) and a CUDA graph can capture
//! it.
//!
//! The kernel gives each (token, head group, chunk of keys) one block of 256 threads (64 heads a
//! group for `attn_pools_bf16_split`, 32 for `attn_pools_bf16_split_h32`); a block
//! walks its chunk in tiles of [`TILE_KEYS`] keys. The plan picks the chunk (a whole number of
//! tiles) so that the batch's blocks fill the SMs in as few, as short waves as possible: for each
//! split count `s` it models the time as `waves(s) × (tiles per chunk + per-block overhead)` plus
//! the combine pass when `s > 1`, and keeps the cheapest (the fewer splits on a tie). A token's
//! output bits depend on its own inputs and on the chunk only (the merge rule in the kernel's
//! comment), never on the other tokens' values; the chunk depends on the batch size, so a token
//! keeps its bits across batch sizes only under a pinned chunk ([`SplitPlan::with_chunk`]).

/// Keys per tile of the split kernel (one `mma` n-pair of keys).
pub const TILE_KEYS: usize = 16;
/// The fewest tiles a chunk holds when the keys are split: below two, a block spends more on its
/// Q fragments and its partial output than on its keys.
pub const MIN_CHUNK_TILES: usize = 2;
/// A block's fixed cost in tiles' worth of work: the prologue (two tiles' copies in flight, Q
/// fragments) and, when split, writing the partial (m, l, o).
pub const BLOCK_OVERHEAD_TILES: usize = 2;
/// The combine pass's cost in tiles' worth (one more short launch reading the partials).
pub const COMBINE_TILES: usize = 1;
/// `gridDim.z`'s limit, which bounds the split count.
pub const MAX_SPLITS: usize = 65_535;
/// The most waves a split plan launches: a plan with more than one chunk per token keeps its
/// blocks within `MAX_SPLIT_WAVES × SMs × blocks per SM`, so the partials of every such plan fit
/// one workspace reserved per device when its kernels load ([`split_workspace_floats`]) and no
/// launch ever allocates — also while its stream is being captured in a CUDA graph. Four waves
/// cost at most 16 % of the modeled time over an unbounded plan (lists of 640 keys, batches
/// 1–2,048, 132 SMs; the worst is batch 265, which runs unsplit instead of in four chunks).
pub const MAX_SPLIT_WAVES: usize = 4;

/// One launch's cut of every token's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    /// Keys per chunk, a multiple of [`TILE_KEYS`] (block `s` takes keys `s·chunk ..`).
    pub chunk_keys: usize,
    /// Chunks per token (`gridDim.z`); 1 = no combine pass.
    pub splits: usize,
}

impl SplitPlan {
    /// The plan with chunks of `chunk_keys` keys for lists of at most `max_keys` keys (for a
    /// caller that pins the chunk, e.g. to keep one token's bits across every batch size).
    /// `chunk_keys` is rounded up to whole tiles.
    pub fn with_chunk(chunk_keys: usize, max_keys: usize) -> SplitPlan {
        let chunk = chunk_keys.max(1).div_ceil(TILE_KEYS) * TILE_KEYS;
        SplitPlan {
            chunk_keys: chunk,
            splits: max_keys.div_ceil(chunk).clamp(1, MAX_SPLITS),
        }
    }

    /// f32 of workspace the launch needs: partial outputs and (m, l) of every (token, chunk,
    /// padded head); none without a split.
    pub fn workspace_floats(&self, tokens: usize, padded_heads: usize, dim: usize) -> usize {
        if self.splits <= 1 {
            0
        } else {
            tokens * self.splits * padded_heads * (dim + 2)
        }
    }
}

/// f32 of workspace that holds the partials of every split plan on a device of `sm_count` SMs,
/// for a kernel of `heads_per_block` heads per block with `blocks_per_sm` resident blocks and
/// rows of `dim` values: `MAX_SPLIT_WAVES` waves of blocks, each its heads' `(dim + 2)` f32.
pub fn split_workspace_floats(
    sm_count: usize,
    heads_per_block: usize,
    blocks_per_sm: usize,
    dim: usize,
) -> usize {
    MAX_SPLIT_WAVES * sm_count.max(1) * blocks_per_sm.max(1) * heads_per_block * (dim + 2)
}

/// The modeled cost of one candidate (tiles' worth of one block's work, per wave, summed).
fn cost(tokens_blocks: usize, slots: usize, tiles: usize, splits: usize) -> (usize, usize) {
    let chunk_tiles = tiles.div_ceil(splits);
    let waves = (tokens_blocks * splits).div_ceil(slots);
    let c =
        waves * (chunk_tiles + BLOCK_OVERHEAD_TILES) + if splits > 1 { COMBINE_TILES } else { 0 };
    (c, chunk_tiles)
}

/// The plan for `tokens` tokens of `head_blocks` head groups each, lists of at most `max_keys`
/// keys (the columns of the compressed plus the SWA list), on a device with `sm_count` SMs that
/// hold `blocks_per_sm` of the kernel's blocks at a time. A split plan launches at most
/// [`MAX_SPLIT_WAVES`] waves.
pub fn split_plan(
    tokens: usize,
    head_blocks: usize,
    max_keys: usize,
    sm_count: usize,
    blocks_per_sm: usize,
) -> SplitPlan {
    let tiles = max_keys.div_ceil(TILE_KEYS).max(1);
    let base = (tokens * head_blocks).max(1);
    let slots = (sm_count * blocks_per_sm).max(1);
    let most = (tiles / MIN_CHUNK_TILES).clamp(1, MAX_SPLITS);
    let mut best = (usize::MAX, tiles, 1);
    for s in 1..=most {
        if s > 1 && base * s > MAX_SPLIT_WAVES * slots {
            break;
        }
        // Equal chunks of whole tiles; a split count that leaves a trailing chunk empty for the
        // longest list is the same cut as a smaller one.
        let chunk_tiles = tiles.div_ceil(s);
        if tiles.div_ceil(chunk_tiles) != s {
            continue;
        }
        let (c, _) = cost(base, slots, tiles, s);
        if c < best.0 {
            best = (c, chunk_tiles, s);
        }
    }
    SplitPlan {
        chunk_keys: best.1 * TILE_KEYS,
        splits: best.2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model's batch shapes (512 compressed + 128 SWA keys, 64 padded heads, 132 SMs, one
    /// block per SM): batch 1 cut into the most chunks, batch 32 into four (128 blocks, one
    /// wave), batch 128 not at all.
    #[test]
    fn plans_for_the_decode_batches() {
        let p = |t, hb| split_plan(t, hb, 640, 132, 1);
        assert_eq!(
            p(1, 1),
            SplitPlan {
                chunk_keys: 32,
                splits: 20
            }
        );
        assert_eq!(
            p(32, 1),
            SplitPlan {
                chunk_keys: 160,
                splits: 4
            }
        );
        assert_eq!(
            p(64, 1),
            SplitPlan {
                chunk_keys: 320,
                splits: 2
            }
        );
        assert_eq!(
            p(128, 1),
            SplitPlan {
                chunk_keys: 640,
                splits: 1
            }
        );
        assert_eq!(
            p(128, 2),
            SplitPlan {
                chunk_keys: 640,
                splits: 1
            }
        );
        // Two blocks per SM double the slots: batch 128 then splits in two.
        assert_eq!(split_plan(128, 1, 640, 132, 2).splits, 2);
    }

    /// Every plan covers the longest list with whole tiles, no chunk past it, at least
    /// MIN_CHUNK_TILES per chunk when split, and a split plan under one wave could not cut finer
    /// within one wave.
    #[test]
    fn plans_cover_the_keys_with_whole_tiles() {
        for keys in [0, 1, 15, 16, 17, 31, 33, 100, 640, 2048 + 128, 70_000] {
            for t in [1, 2, 3, 7, 32, 100, 128, 1000] {
                for sms in [1, 78, 132, 148] {
                    let p = split_plan(t, 1, keys, sms, 1);
                    assert_eq!(p.chunk_keys % TILE_KEYS, 0, "{keys} {t} {sms}");
                    assert!(p.chunk_keys * p.splits >= keys, "{keys} {t} {sms}: {p:?}");
                    assert!(
                        p.splits == 1 || p.chunk_keys * (p.splits - 1) < keys,
                        "{keys} {t} {sms}: an empty chunk {p:?}"
                    );
                    assert!(p.splits == 1 || p.chunk_keys >= MIN_CHUNK_TILES * TILE_KEYS);
                    // Split yet under one wave: the next finer cut would not fit one wave.
                    let (tiles, ct) = (keys.div_ceil(TILE_KEYS).max(1), p.chunk_keys / TILE_KEYS);
                    if t * p.splits < sms && p.splits > 1 && ct > MIN_CHUNK_TILES {
                        let finer = tiles.div_ceil(ct - 1);
                        assert!(
                            t * finer > sms || finer > tiles / MIN_CHUNK_TILES,
                            "{keys} {t} {sms}: {p:?} leaves SMs idle with keys to spare"
                        );
                    }
                }
            }
        }
    }

    /// Every split plan's partials fit the workspace a device reserves for its kernel, for every
    /// batch up to 4,096 tokens (the bound that lets a launch never allocate), and the bound costs
    /// at most 16 % of the modeled time of the best unbounded plan.
    #[test]
    fn every_split_plan_fits_the_reserved_workspace() {
        let unbounded = |t: usize, hb: usize, keys: usize, sms: usize, bps: usize| {
            let tiles = keys.div_ceil(TILE_KEYS).max(1);
            (1..=(tiles / MIN_CHUNK_TILES).max(1))
                .filter(|&s| tiles.div_ceil(tiles.div_ceil(s)) == s)
                .map(|s| cost(t * hb, sms * bps, tiles, s).0)
                .min()
                .unwrap()
        };
        for (hpb, bps) in [(64usize, 1usize), (32, 2)] {
            for hp in [64usize, 128] {
                let hb = hp / hpb;
                for sms in [1usize, 78, 132, 148] {
                    let room = split_workspace_floats(sms, hpb, bps, 512);
                    for keys in [16usize, 100, 640, 2048 + 128] {
                        for t in 1..=4096 {
                            let p = split_plan(t, hb, keys, sms, bps);
                            let need = p.workspace_floats(t, hp, 512);
                            assert!(need <= room, "{t} {hp} {sms} {keys}: {p:?} needs {need}");
                            if sms == 132 && keys == 640 {
                                let tiles = keys.div_ceil(TILE_KEYS);
                                let c = cost(t * hb, sms * bps, tiles, p.splits).0;
                                let best = unbounded(t, hb, keys, sms, bps);
                                assert!(c * 100 <= best * 116, "{t} {hp}: {c} vs {best}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_pinned_chunk_rounds_to_tiles_and_the_workspace_counts_every_partial() {
        assert_eq!(
            SplitPlan::with_chunk(20, 640),
            SplitPlan {
                chunk_keys: 32,
                splits: 20
            }
        );
        assert_eq!(SplitPlan::with_chunk(640, 640).splits, 1);
        assert_eq!(SplitPlan::with_chunk(16, 0).splits, 1);
        let p = SplitPlan::with_chunk(64, 640);
        assert_eq!(p.workspace_floats(3, 128, 512), 3 * 10 * 128 * 514);
        assert_eq!(
            SplitPlan::with_chunk(640, 640).workspace_floats(3, 128, 512),
            0
        );
    }
}
