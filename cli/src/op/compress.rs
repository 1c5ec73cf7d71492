//! `csa2 op compress`: in `kv` f32 [T,512], `score` f32 [T,512] (ratio 2 only), `norm` f32 [512],
//! `wk` f32 [128,512], `k_norm` f32 [128]; params `ratio`, `start_pos` (0), `eps` (1e-20).
//! Out `latent` f32 [G,512], `main_kv` f32 [G,512], `main_kv_nvfp4` u8 [G,288], `index_k` f32
//! [G,128], `index_k_mxfp4` u8 [G,68]. Rotary: the compressed layers' (θ 160000 + YaRN).

use super::{save, Params};
use csa2::ops::compressor::signature::{KV, K_NORM, NORM, SCORE, WK};
use csa2::ops::compressor::{reference, Compressor, CompressorState, PooledWeights};
use csa2::ops::rope::Rope;
use csa2::Result;
use csa2_harness::npy::{read_arg, read_arg_optional, Dims};
use std::path::Path;

pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> Result<()> {
    let p = Params::load(in_dir)?;
    let ratio = p.usize_req("ratio")?;
    let start = p.usize_or("start_pos", 0)?;
    let eps = p.f64_or("eps", 1e-20)?;
    let mut dims = Dims::default();
    let kv = read_arg::<f32>(in_dir, &KV, &mut dims)?;
    let score = read_arg_optional::<f32>(in_dir, &SCORE, &mut dims)?;
    let norm = read_arg::<f32>(in_dir, &NORM, &mut dims)?;
    let wk = read_arg::<f32>(in_dir, &WK, &mut dims)?;
    let k_norm = read_arg::<f32>(in_dir, &K_NORM, &mut dims)?;
    let g = csa2::Geometry::embedded();
    let layer = g
        .layers
        .iter()
        .find(|l| l.ratio > 0)
        .expect("the geometry has compressed layers");
    let rope = Rope::for_layer(layer);
    let w = PooledWeights {
        norm: &norm.data,
        wk: &wk.data,
        k_norm: &k_norm.data,
    };
    let c = Compressor::new(ratio, eps, rope.clone(), w)?;
    // The fast path validates everything (ratio / score / boundary / finiteness) even for --reference.
    let mut st = CompressorState::new(start as u64);
    let sc = score.as_ref().map(|s| &s.data[..]);
    let mut out = c.compress(&mut st, &kv.data, sc)?;
    if reference {
        out = reference::compress(ratio, eps, &rope, &w, &kv.data, sc, start).f32;
    }
    let n = out.count;
    save(out_dir, "latent", &[n, 512], &out.latent)?;
    save(out_dir, "main_kv", &[n, 512], &out.main_kv)?;
    save(out_dir, "main_kv_nvfp4", &[n, 288], &out.main_kv_nvfp4)?;
    save(out_dir, "index_k", &[n, 128], &out.index_k)?;
    save(out_dir, "index_k_mxfp4", &[n, 68], &out.index_k_mxfp4)
}
