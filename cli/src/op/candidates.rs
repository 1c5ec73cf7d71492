//! `csa2 op candidates`: in `logits` f32 [T,N], `positions` i64 [T]; params `ratio`, `block_size`
//! (8), `num_blocks` (2048). Out `blocks` i32 [T,num_blocks] sorted by (block score desc, id asc),
//! −1 padded.

use super::{save, Params};
use csa2::ops::candidates::signature::{LOGITS, POSITIONS};
use csa2::ops::candidates::{self, reference, CandidateParams};
use csa2::ops::indexer::visible;
use csa2::{Error, Result};
use csa2_harness::npy::{read_arg, Dims};
use std::path::Path;

pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> Result<()> {
    let p = Params::load(in_dir)?;
    let ratio = p.usize_req("ratio")?;
    if ratio == 0 {
        return Err(Error::invalid("ratio", "must be ≥ 1"));
    }
    let cp = CandidateParams {
        block_size: p.usize_or("block_size", 8)?,
        num_blocks: p.usize_or("num_blocks", 2048)?,
    };
    cp.validate()?;
    let mut dims = Dims::default();
    let logits = read_arg::<f32>(in_dir, &LOGITS, &mut dims)?;
    let pos = read_arg::<i64>(in_dir, &POSITIONS, &mut dims)?;
    csa2::ops::rope::check_positions(&pos.data)?;
    let (t, n) = (logits.shape[0], logits.shape[1]);
    let vis: Vec<usize> = pos.data.iter().map(|&x| visible(x, ratio)).collect();
    if let Some((i, &v)) = vis.iter().enumerate().find(|(_, &v)| v > n) {
        return Err(Error::shape(
            "logits",
            format!(
                "at least {v} columns (token {i} at position {})",
                pos.data[i]
            ),
            format!("{n} columns"),
        ));
    }
    let mut out = vec![-1i32; t * cp.num_blocks];
    if reference {
        for (i, row) in out.chunks_mut(cp.num_blocks).enumerate() {
            row.copy_from_slice(&reference::select_blocks(
                &cp,
                &logits.data[i * n..(i + 1) * n],
                vis[i],
            ));
        }
    } else {
        candidates::select_blocks_rows(&cp, &logits.data, n, &vis, &mut out)?;
    }
    save(out_dir, "blocks", &[t, cp.num_blocks], &out)
}
