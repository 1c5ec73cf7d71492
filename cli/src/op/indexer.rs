//! `csa2 op indexer`: in `q` f32 [T,32,128] (RoPE'd), `w` f32 [T,32] (scaled), one of `k` f32
//! [N,128] or `k_mxfp4` u8 [N,68], `positions` i64 [T], optional `blocks` i32 [T,B] (candidate
//! pool); params `ratio`, `topk` (512), `q_quant` (none | mxfp4 | fp8), `block_size` (8).
//! Out `logits` f32 [T,N] (−inf where not visible or outside the pool), `topk` i32 [T,k] sorted by
//! (logit desc, index asc), −1 padded.

use super::{f32s, one_of, save, Params};
use csa2::ops::candidates::CandidateParams;
use csa2::ops::indexer::signature::{BLOCKS, KEYS, KEYS_MXFP4, POSITIONS, Q, W};
use csa2::ops::indexer::{self, IndexKeys, IndexerParams, IndexerQueries, QueryQuant, INDEX_HEADS};
use csa2::ops::topk;
use csa2::Result;
use csa2_harness::npy::{read_arg, read_arg_optional, read_file_optional, Dims};
use std::path::Path;

pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> Result<()> {
    let p = Params::load(in_dir)?;
    let ip = IndexerParams {
        ratio: p.usize_req("ratio")?,
        heads: INDEX_HEADS,
        query_quant: QueryQuant::from_name(p.str_or("q_quant", "none")?)?,
    };
    let k = p.usize_or("topk", topk::INDEX_TOPK)?;
    let cp = CandidateParams {
        block_size: p.usize_or("block_size", 8)?,
        num_blocks: 1,
    };
    // The runner scores V4.1's 32 heads: H is fixed before the files are checked.
    let mut dims = Dims::default();
    dims.bind("H", INDEX_HEADS);
    let q = read_arg::<f32>(in_dir, &Q, &mut dims)?;
    let w = read_arg::<f32>(in_dir, &W, &mut dims)?;
    let pos = read_arg::<i64>(in_dir, &POSITIONS, &mut dims)?;
    let kf = read_file_optional::<f32>(in_dir, "k", &KEYS, &mut dims)?;
    let km = read_file_optional::<u8>(in_dir, "k_mxfp4", &KEYS_MXFP4, &mut dims)?;
    let blocks = read_arg_optional::<i32>(in_dir, &BLOCKS, &mut dims)?;
    let keys = match one_of(in_dir, ("k", kf.as_ref()), ("k_mxfp4", km.as_ref()))? {
        Ok(t) => IndexKeys::F32(&t.data),
        Err(t) => IndexKeys::Mxfp4(&t.data),
    };
    let (t, n) = (pos.data.len(), keys.len());
    let qs = IndexerQueries {
        q: &q.data,
        w: &w.data,
        positions: &pos.data,
    };
    let mut logits = vec![0f32; t * n];
    match &blocks {
        None => indexer::logits(&ip, &qs, keys, &mut logits)?,
        Some(b) => indexer::logits_in_blocks(&ip, &qs, keys, &b.data, &cp, &mut logits)?,
    }
    if reference {
        let vis: Vec<usize> = pos
            .data
            .iter()
            .map(|&x| indexer::visible(x, ip.ratio))
            .collect();
        let pools = match &blocks {
            Some(b) => Some(indexer::pools_of(t, n, &b.data, &cp, &vis)?),
            None => None,
        };
        logits = f32s(&indexer::reference::logits(
            &ip,
            &qs,
            keys,
            pools.as_deref(),
        ));
    }
    let vis: Vec<usize> = pos
        .data
        .iter()
        .map(|&x| indexer::visible(x, ip.ratio))
        .collect();
    let mut sel = vec![-1i32; t * k];
    if reference {
        for (i, row) in sel.chunks_mut(k.max(1)).enumerate().take(t) {
            if k > 0 {
                row.copy_from_slice(&topk::reference::select(
                    &logits[i * n..(i + 1) * n],
                    vis[i],
                    k,
                ));
            }
        }
    } else {
        topk::select_rows(&logits, n, &vis, &mut sel)?;
    }
    if k > 0 {
        for (i, row) in sel.chunks_mut(k).enumerate() {
            topk::sort_selection(&logits[i * n..(i + 1) * n], row);
        }
    }
    save(out_dir, "logits", &[t, n], &logits)?;
    save(out_dir, "topk", &[t, k], &sel)
}
