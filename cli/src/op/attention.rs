//! `csa2 op attention`: in `q` f32 [T,64,512], one of `main_kv` f32 [N,512] or `main_kv_nvfp4` u8
//! [N,288], `topk` i32 [T,K], optional `topk_len` i32 [T], one of `swa` f32 [S,512] or `swa_mxfp8`
//! u8 [S,528] (row s = token s), `sink` f32 [64], `positions` i64 [T]; params `replay_start` (int or
//! list per token, 0), `window` (128), optional `ratio` (guards visibility of the top-k entries).
//! Out `out` f32 [T,64,512] (before inverse RoPE), `lse` f32 [T,64] (natural log, without the sink;
//! −inf for a row with nothing attended).

use super::{f32s, one_of, save, Params};
use csa2::formats::RecordFormat;
use csa2::ops::attention::{self, reference, AttentionInputs, AttentionParams, KvRows, HEADS};
use csa2::Result;
use csa2_harness::npy::{read_checked, read_optional, Dim, Dims};
use std::path::Path;

pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> Result<()> {
    let p = Params::load(in_dir)?;
    let ap = AttentionParams {
        window: p.usize_or("window", 128)?,
        ratio: p.usize_opt("ratio")?,
        ..Default::default()
    };
    let rs = p.i64_list("replay_start")?;
    let mut dims = Dims::default();
    let q = read_checked::<f32>(
        in_dir,
        "q",
        &[Dim::Any("T"), Dim::Fixed(HEADS), Dim::Fixed(512)],
        &mut dims,
    )?;
    let topk = read_checked::<i32>(in_dir, "topk", &[Dim::Any("T"), Dim::Any("K")], &mut dims)?;
    let topk_len = read_optional::<i32>(in_dir, "topk_len", &[Dim::Any("T")], &mut dims)?;
    let sink = read_checked::<f32>(in_dir, "sink", &[Dim::Fixed(HEADS)], &mut dims)?;
    let pos = read_checked::<i64>(in_dir, "positions", &[Dim::Any("T")], &mut dims)?;
    let mf = read_optional::<f32>(
        in_dir,
        "main_kv",
        &[Dim::Any("N"), Dim::Fixed(512)],
        &mut dims,
    )?;
    let mq = read_optional::<u8>(
        in_dir,
        "main_kv_nvfp4",
        &[Dim::Any("N"), Dim::Fixed(288)],
        &mut dims,
    )?;
    let sf = read_optional::<f32>(in_dir, "swa", &[Dim::Any("S"), Dim::Fixed(512)], &mut dims)?;
    let sq = read_optional::<u8>(
        in_dir,
        "swa_mxfp8",
        &[Dim::Any("S"), Dim::Fixed(528)],
        &mut dims,
    )?;
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
