//! A performance model of sparse decode attention on the split kernels (modeled, not measured):
//! per batch shape, the blocks the launch creates, the SMs they cover, how many fit an SM at once
//! (from ptxas' register and shared-memory figures of the build), the bytes and FLOPs the batch
//! must move and compute, and the roofline floor from a device's copy bandwidth and bf16 matmul
//! rate. `examples/gpu_validate.rs` prints it beside the measurement; docs/PERF.md keeps the table.

use super::split_plan::{split_plan, SplitPlan};
use crate::formats::{KV_DIM, MXFP8_BYTES, NVFP4_DS_BYTES};

/// Per-SM limits of the occupancy calculation (Hopper: H100 / H200).
#[derive(Debug, Clone, Copy)]
pub struct SmLimits {
    /// 32-bit registers per SM.
    pub registers: u32,
    /// Shared memory per SM usable by blocks, bytes.
    pub shared_bytes: u32,
    /// Shared memory the driver reserves per resident block, bytes.
    pub reserved_per_block: u32,
    /// Resident threads per SM.
    pub threads: u32,
    /// Resident blocks per SM.
    pub blocks: u32,
}

/// sm_90 (CUDA occupancy tables): 64 Ki registers, 228 KiB shared memory (1 KiB reserved per
/// block), 2048 threads, 32 blocks; registers are allocated per warp in units of 256.
pub const HOPPER: SmLimits = SmLimits {
    registers: 65_536,
    shared_bytes: 228 * 1024,
    reserved_per_block: 1024,
    threads: 2048,
    blocks: 32,
};

/// Blocks of `threads` threads using `registers` per thread and `shared` static shared bytes that
/// one SM holds at once (0 when one block does not fit).
pub fn blocks_per_sm(registers: u32, shared: u32, threads: u32, sm: &SmLimits) -> u32 {
    let warps = threads.div_ceil(32);
    // Registers: per warp, registers × 32 rounded up to the 256-register allocation unit.
    let per_warp = (registers.max(1) * 32).div_ceil(256) * 256;
    let by_regs = (sm.registers / per_warp) / warps.max(1);
    let by_shared = sm.shared_bytes / (shared + sm.reserved_per_block);
    let by_threads = sm.threads / threads.max(1);
    by_regs.min(by_shared).min(by_threads).min(sm.blocks)
}

/// One row of the model: a decode batch of `tokens` tokens at `context` tokens of context.
#[derive(Debug, Clone, Copy)]
pub struct ModelRow {
    /// Tokens of the batch.
    pub tokens: usize,
    /// Context length of the row (no effect on the work; see [`model_row`]).
    pub context: usize,
    /// The split plan the launch would use.
    pub plan: SplitPlan,
    /// Blocks of the split kernel (the combine's blocks not included).
    pub blocks: usize,
    /// SMs with at least one block in the first wave.
    pub sms_covered: usize,
    /// Resident blocks per SM (ptxas figures × [`SmLimits`]).
    pub blocks_per_sm: u32,
    /// Waves of the split kernel.
    pub waves: usize,
    /// Bytes the batch must move, whatever the kernel: records, q, out, lists, lse.
    pub bytes: f64,
    /// Bytes the split plan adds: its f32 partials written and read by the combine pass (0
    /// unsplit), counted as DRAM traffic.
    pub partial_bytes: f64,
    /// Tensor FLOPs: 2 × heads × keys × (512 + 512) per token.
    pub flops: f64,
    /// Roofline floor, µs: max(bytes / bandwidth, FLOPs / matmul rate) — the same for every
    /// kernel, and the one the GPU check measures a kernel against.
    pub roofline_us: f64,
    /// The plan's own floor: its partials moved too, and only the covered SMs computing:
    /// max((bytes + partial_bytes) / bandwidth, FLOPs / (rate × covered / SMs)).
    pub coverage_floor_us: f64,
}

/// The modeled row for `tokens` tokens with lists of `km` compressed (NVFP4-DS) and `ks` SWA
/// (MXFP8) keys, `heads` live of `padded_heads`, on `sm_count` SMs holding `blocks_per_sm` split
/// blocks of `heads_per_block` heads each, with `bandwidth_gbs` GB/s and `tflops` bf16 TFLOP/s.
/// The work per token is fixed by the top-k and the window: `context` changes nothing here but is
/// carried for the table. A token's records count once, also when several head blocks read them
/// (the blocks of one token run close together, so the other reads are taken as L2 hits): the
/// bytes stay the least the batch must move, and the roofline a floor for every kernel.
#[allow(clippy::too_many_arguments)]
pub fn model_row(
    tokens: usize,
    context: usize,
    (padded_heads, heads): (usize, usize),
    (km, ks): (usize, usize),
    sm_count: usize,
    (heads_per_block, blocks_per_sm): (usize, u32),
    bandwidth_gbs: f64,
    tflops: f64,
) -> ModelRow {
    let head_blocks = padded_heads.div_ceil(heads_per_block.max(1));
    let plan = split_plan(
        tokens,
        head_blocks,
        km + ks,
        sm_count,
        blocks_per_sm.max(1) as usize,
    );
    let blocks = tokens * head_blocks * plan.splits;
    let slots = sm_count * blocks_per_sm.max(1) as usize;
    let t = tokens as f64;
    let records = (km * NVFP4_DS_BYTES + ks * MXFP8_BYTES) as f64;
    let qo = 2.0 * (padded_heads * KV_DIM * 2) as f64;
    let lists = ((km + ks) * 4 + 8 + heads * 4) as f64;
    let partials = 2.0 * 4.0 * plan.workspace_floats(1, padded_heads, KV_DIM) as f64;
    let bytes = t * (records + qo + lists);
    let partial_bytes = t * partials;
    let flops = t * 2.0 * heads as f64 * (km + ks) as f64 * (2 * KV_DIM) as f64;
    let mem_us = bytes / (bandwidth_gbs * 1e3);
    let cmp_us = flops / (tflops * 1e6);
    let covered = blocks.min(sm_count);
    ModelRow {
        tokens,
        context,
        plan,
        blocks,
        sms_covered: covered,
        blocks_per_sm,
        waves: blocks.div_ceil(slots),
        bytes,
        partial_bytes,
        flops,
        roofline_us: mem_us.max(cmp_us),
        coverage_floor_us: ((bytes + partial_bytes) / (bandwidth_gbs * 1e3))
            .max(cmp_us * sm_count as f64 / covered.max(1) as f64),
    }
}

/// The table's rows for a split kernel of `heads_per_block` heads per block and `blocks_per_sm`
/// resident blocks: batch 1, 32, 128 at 64K and 1M context, the model's lists (512 + 128 keys,
/// 64 heads).
pub fn decode_table(
    sm_count: usize,
    (heads_per_block, blocks_per_sm): (usize, u32),
    bandwidth_gbs: f64,
    tflops: f64,
) -> Vec<ModelRow> {
    let mut v = Vec::new();
    for context in [65_536, 1 << 20] {
        for tokens in [1, 32, 128] {
            v.push(model_row(
                tokens,
                context,
                (64, 64),
                (512, 128),
                sm_count,
                (heads_per_block, blocks_per_sm),
                bandwidth_gbs,
                tflops,
            ));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The occupancy arithmetic on known cases: 255 or 217 registers × 256 threads allow one
    /// block, 128 registers two, 64 registers four; at 32 registers 44 KB of shared memory bounds it
    /// to five.
    #[test]
    fn blocks_per_sm_follow_registers_and_shared_memory() {
        assert_eq!(blocks_per_sm(255, 44_160, 256, &HOPPER), 1);
        assert_eq!(blocks_per_sm(217, 16_000, 256, &HOPPER), 1);
        assert_eq!(blocks_per_sm(128, 44_160, 256, &HOPPER), 2);
        assert_eq!(blocks_per_sm(64, 44_160, 256, &HOPPER), 4);
        assert_eq!(blocks_per_sm(32, 44_160, 256, &HOPPER), 5);
        assert_eq!(blocks_per_sm(32, 0, 1024, &HOPPER), 2);
    }

    /// The decode rows on 132 SMs, one block each: batch 1 covers 20 SMs, batch 32 128 SMs in
    /// one wave, batch 128 128 SMs unsplit; bytes and FLOPs per token as the model's lists give.
    #[test]
    fn decode_rows_cover_the_sms() {
        let rows = decode_table(132, (64, 1), 4800.0, 989.0);
        assert_eq!(rows.len(), 6);
        let r = |i: usize| rows[i];
        assert_eq!((r(0).blocks, r(0).sms_covered), (20, 20));
        assert_eq!((r(1).blocks, r(1).sms_covered, r(1).waves), (128, 128, 1));
        assert_eq!((r(2).blocks, r(2).plan.splits), (128, 1));
        assert_eq!(r(2).flops, 128.0 * 2.0 * 64.0 * 640.0 * 1024.0);
        // Unsplit: 215,040 record bytes + 131,072 q/out + lists per token.
        assert_eq!(
            r(2).bytes,
            128.0 * (215_040.0 + 131_072.0 + (640 * 4 + 8 + 256) as f64)
        );
        assert!(r(1).coverage_floor_us >= r(1).roofline_us);
        // Split in four: the same least bytes per token as unsplit, the partials apart (four
        // chunks of 64 heads × 514 f32, written and read).
        assert_eq!(r(1).bytes / 32.0, r(2).bytes / 128.0);
        assert_eq!(r(1).partial_bytes, 32.0 * 4.0 * 64.0 * 514.0 * 4.0 * 2.0);
        assert_eq!(r(2).partial_bytes, 0.0);
        for i in 0..3 {
            assert_eq!(rows[i].bytes, rows[i + 3].bytes, "context changes no work");
        }
    }

    /// The 32-head split kernel at two blocks per SM: batch 32 fills all 132 SMs twice over
    /// (two head blocks × 4 chunks per token: 256 blocks, one wave), with the same least bytes
    /// and FLOPs as the 64-head kernel.
    #[test]
    fn h32_rows_put_two_blocks_on_every_sm() {
        let rows = decode_table(132, (32, 2), 4800.0, 989.0);
        let r = rows[1];
        assert_eq!((r.tokens, r.plan.splits, r.blocks), (32, 4, 256));
        assert_eq!((r.sms_covered, r.waves, r.blocks_per_sm), (132, 1, 2));
        let one = decode_table(132, (64, 1), 4800.0, 989.0)[2];
        let two = rows[2];
        assert_eq!(two.flops, one.flops, "the same tensor work");
        assert_eq!(two.bytes, one.bytes, "records counted once per token");
    }
}
