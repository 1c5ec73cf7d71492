//! Synthetic checkpoints in the released naming, dtypes and layout (several shards + index json),
//! so the real loading path is exercised without the 511 GB release (`csa2 make-checkpoint`).
//!
//! Values are random but scaled so activations stay O(1) through 40 layers: linears
//! N(0, 1/fan_in), norms 1 + N(0, 0.05²), sinks N(0, 0.5²), mHC `hc_fn` N(0, 0.25/(4d)) (mixes
//! ≈ N(0, 0.25)), `hc_base` N(0, 0.5²) with +2 on the comb diagonal (near-identity stream mixing, as
//! trained models are) and `hc_scale` U(0.5, 1.5). Each tensor's values depend only on (seed, name),
//! so a test can regenerate the source of any tensor.

use super::{layer_specs, scale_name, Scale, Stored, TensorSpec, FP8_BLOCK, INDEX_FILE};
use crate::error::{Error, Result};
use crate::formats::scalar::{e4m3_encode, e8m0_decode, e8m0_encode_ceil, E4M3_MAX};
use crate::ops::mhc::HC;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};
use safetensors::{Dtype, View};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// The f32 values `make-checkpoint` quantizes and writes for `spec` (before any bf16/FP8 rounding).
pub fn source_values(spec: &TensorSpec, hidden: usize, seed: u64) -> Vec<f32> {
    let digest = Sha256::new()
        .chain_update(seed.to_le_bytes())
        .chain_update(spec.name.as_bytes())
        .finalize();
    let mut rng = StdRng::from_seed(digest.into());
    let n: usize = spec.shape.iter().product();
    let normal = |rng: &mut StdRng, sd: f32, n: usize| -> Vec<f32> {
        let dist = Normal::new(0.0f32, sd).expect("sd > 0");
        (0..n).map(|_| dist.sample(rng)).collect()
    };
    let leaf = spec
        .name
        .rsplit_once("layers.")
        .map_or(&spec.name[..], |(_, r)| r);
    let leaf = leaf.split_once('.').map_or(leaf, |(_, r)| r);
    if leaf.ends_with("_fn") {
        normal(&mut rng, 0.5 / ((HC * hidden) as f32).sqrt(), n)
    } else if leaf.ends_with("_base") {
        let mut b = normal(&mut rng, 0.5, n);
        for i in 0..HC {
            b[2 * HC + i * HC + i] += 2.0;
        }
        b
    } else if leaf.ends_with("_scale") {
        (0..n).map(|_| rng.random_range(0.5..1.5)).collect()
    } else if leaf == "attn.attn_sink" {
        normal(&mut rng, 0.5, n)
    } else if spec.shape.len() == 1 {
        normal(&mut rng, 0.05, n)
            .into_iter()
            .map(|v| 1.0 + v)
            .collect()
    } else {
        normal(&mut rng, 1.0 / (spec.shape[1] as f32).sqrt(), n)
    }
}

/// Quantizes a `[rows, cols]` matrix to E4M3 with one UE8M0 scale per 32×32 block:
/// `scale = 2^ceil(log2(amax/448))` (amax floored at 2^-126 so all-zero blocks stay finite),
/// `q = E4M3(w / scale)`. Returns (codes `[rows·cols]`, scale bytes `[⌈rows/32⌉·⌈cols/32⌉]`).
pub fn quantize_fp8_block(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    use rayon::prelude::*;
    let (br, bc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    let mut scales = vec![0u8; br * bc];
    let mut q = vec![0u8; rows * cols];
    // One task per 32-row block: its scales, then its codes (blocks are independent).
    scales
        .par_chunks_mut(bc.max(1))
        .zip(q.par_chunks_mut((FP8_BLOCK * cols).max(1)))
        .enumerate()
        .for_each(|(bi, (srow, qblk))| {
            let r0 = bi * FP8_BLOCK;
            let r1 = (r0 + FP8_BLOCK).min(rows);
            for (bj, sc) in srow.iter_mut().enumerate() {
                let mut amax = 0.0f32;
                for r in r0..r1 {
                    for c in bj * FP8_BLOCK..((bj + 1) * FP8_BLOCK).min(cols) {
                        amax = amax.max(w[r * cols + c].abs());
                    }
                }
                *sc = e8m0_encode_ceil(amax.max(f32::MIN_POSITIVE) / E4M3_MAX);
            }
            for r in r0..r1 {
                for c in 0..cols {
                    let s = e8m0_decode(srow[c / FP8_BLOCK]);
                    qblk[(r - r0) * cols + c] = e4m3_encode(w[r * cols + c] / s);
                }
            }
        });
    (q, scales)
}

struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Owned {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn encode(spec: &TensorSpec, v: &[f32]) -> Vec<(String, Owned)> {
    match spec.stored {
        Stored::F32 => vec![(
            spec.name.clone(),
            Owned {
                dtype: Dtype::F32,
                shape: spec.shape.clone(),
                data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        )],
        Stored::Bf16 => vec![(
            spec.name.clone(),
            Owned {
                dtype: Dtype::BF16,
                shape: spec.shape.clone(),
                data: v
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            },
        )],
        Stored::Fp8Block => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let (q, s) = quantize_fp8_block(v, rows, cols);
            vec![
                (
                    spec.name.clone(),
                    Owned {
                        dtype: Dtype::F8_E4M3,
                        shape: spec.shape.clone(),
                        data: q,
                    },
                ),
                (
                    scale_name(&spec.name),
                    Owned {
                        dtype: Dtype::F8_E8M0,
                        shape: vec![rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
                        data: s,
                    },
                ),
            ]
        }
    }
}

/// What [`write_checkpoint`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Shard files, in order.
    pub shards: Vec<String>,
    /// Tensors written (scales included).
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
}

/// Layers per shard file: several shards for any multi-layer range, like the release.
const LAYERS_PER_SHARD: usize = 10;

/// Writes a synthetic checkpoint of `scale` for `layers` into `dir` (created if absent):
/// `config.json`, `model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json`.
///
/// Errors: [`Error::Invalid`] for an empty or out-of-range layer range, [`Error::Io`] on write.
pub fn write_checkpoint(
    dir: &Path,
    scale: Scale,
    seed: u64,
    layers: Range<usize>,
) -> Result<Written> {
    let g = scale.geometry();
    if layers.is_empty() || layers.end > g.num_layers {
        return Err(Error::invalid(
            "layers",
            format!(
                "{layers:?} must be a non-empty range inside 0..{}",
                g.num_layers
            ),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, scale.config_json()).map_err(|e| Error::io(&cfg, e))?;
    let ids: Vec<usize> = layers.collect();
    let groups: Vec<&[usize]> = ids.chunks(LAYERS_PER_SHARD).collect();
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut out = Written {
        shards: Vec::new(),
        tensors: 0,
        bytes: 0,
    };
    for (i, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let mut tensors: Vec<(String, Owned)> = Vec::new();
        for &l in group.iter() {
            for spec in layer_specs(&g, l)? {
                let v = source_values(&spec, g.hidden_size, seed);
                tensors.extend(encode(&spec, &v));
            }
        }
        for (name, t) in &tensors {
            weight_map.insert(name.clone(), file.clone());
            out.bytes += t.data.len() as u64;
        }
        out.tensors += tensors.len();
        let path = dir.join(&file);
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(
            tensors.iter().map(|(n, t)| (n.as_str(), t)),
            Some(meta),
            &path,
        )
        .map_err(|e| Error::io(&path, std::io::Error::other(e.to_string())))?;
        out.shards.push(file);
    }
    let index = serde_json::json!({
        "metadata": { "total_size": out.bytes },
        "weight_map": weight_map,
    });
    let ipath = dir.join(INDEX_FILE);
    std::fs::write(&ipath, serde_json::to_string_pretty(&index).expect("json"))
        .map_err(|e| Error::io(&ipath, e))?;
    Ok(out)
}
