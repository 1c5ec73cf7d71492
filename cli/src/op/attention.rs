//! `csa2 op attention`: in `q` f32 [T,64,512], one of `main_kv` f32 [N,512] or `main_kv_nvfp4` u8
//! [N,288], `topk` i32 [T,K], optional `topk_len` i32 [T], one of `swa` f32 [S,512] or `swa_mxfp8`
//! u8 [S,528] (row s = token s), `sink` f32 [64], `positions` i64 [T]; params `replay_start` (int or
//! list per token, 0), `window` (128), optional `ratio` (guards visibility of the top-k entries).
//! Out `out` f32 [T,64,512] (before inverse RoPE), `lse` f32 [T,64] (natural log, without the sink;
//! −inf for a row with nothing attended).

use super::{f32s, one_of, save, Params};
use csa2::formats::RecordFormat;
use csa2::ops::attention::signature::{
    MAIN_KV, MAIN_KV_RECORDS, POSITIONS, Q, SINK, SWA, SWA_RECORDS, TOPK, TOPK_LEN,
};
use csa2::ops::attention::{self, reference, AttentionInputs, AttentionParams, KvRows, HEADS};
use csa2::Result;
use csa2_harness::npy::{read_arg, read_arg_optional, read_file_optional, Dims};
use std::path::Path;

pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> Result<()> {
    let p = Params::load(in_dir)?;
    let ap = AttentionParams {
        window: p.usize_or("window", 128)?,
        ratio: p.usize_opt("ratio")?,
        ..Default::default()
    };
    let rs = p.i64_list("replay_start")?;
    // The runner computes V4.1's 64 heads over NVFP4-DS main-KV and MXFP8 SWA records: those
    // sizes are fixed before the files are checked.
    let mut dims = Dims::default();
    dims.bind("H", HEADS);
    dims.bind("main_record_bytes", RecordFormat::Nvfp4Ds.record_bytes());
    dims.bind("swa_record_bytes", RecordFormat::Mxfp8.record_bytes());
    let q = read_arg::<f32>(in_dir, &Q, &mut dims)?;
    let topk = read_arg::<i32>(in_dir, &TOPK, &mut dims)?;
    let topk_len = read_arg_optional::<i32>(in_dir, &TOPK_LEN, &mut dims)?;
    let sink = read_arg::<f32>(in_dir, &SINK, &mut dims)?;
    let pos = read_arg::<i64>(in_dir, &POSITIONS, &mut dims)?;
    let mf = read_arg_optional::<f32>(in_dir, &MAIN_KV, &mut dims)?;
    let mq = read_file_optional::<u8>(in_dir, "main_kv_nvfp4", &MAIN_KV_RECORDS, &mut dims)?;
    let sf = read_arg_optional::<f32>(in_dir, &SWA, &mut dims)?;
    let sq = read_file_optional::<u8>(in_dir, "swa_mxfp8", &SWA_RECORDS, &mut dims)?;
    let main = match one_of(
        in_dir,
        ("main_kv", mf.as_ref()),
        ("main_kv_nvfp4", mq.as_ref()),
    )? {
        Ok(t) => KvRows::F32(&t.data),
        Err(t) => KvRows::Records(RecordFormat::Nvfp4Ds, &t.data),
    };
    let swa = match one_of(in_dir, ("swa", sf.as_ref()), ("swa_mxfp8", sq.as_ref()))? {
        Ok(t) => KvRows::F32(&t.data),
        Err(t) => KvRows::Records(RecordFormat::Mxfp8, &t.data),
    };
    let t = pos.data.len();
    let inp = AttentionInputs {
        q: &q.data,
        topk: &topk.data,
        topk_len: topk_len.as_ref().map(|l| &l.data[..]),
        positions: &pos.data,
        replay_start: &rs,
        sink: &sink.data,
    };
    let mut out = vec![0f32; t * HEADS * 512];
    let mut lse = vec![0f32; t * HEADS];
    if reference {
        let rows = attention::plan(&ap, &inp, &main, &swa)?;
        let (o, l) = reference::attention(&ap, &inp, &rows, main, swa);
        out = f32s(&o);
        lse = f32s(&l);
    } else {
        attention::attention(&ap, &inp, main, swa, &mut out, &mut lse)?;
    }
    save(out_dir, "out", &[t, HEADS, 512], &out)?;
    save(out_dir, "lse", &[t, HEADS], &lse)
}
