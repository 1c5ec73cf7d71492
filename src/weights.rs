//! Attention-sublayer and mHC weights of a DeepSeek-V4.1 checkpoint in its released naming (bare
//! `layers.{L}.…` keys, docs/SPEC.md §6.1), read from memory-mapped safetensors shards.
//!
//! Dtypes on disk: dense linears are FP8 E4M3 `[out, in]` with a block scale `….scale`
//! `[⌈out/32⌉, ⌈in/32⌉]` (UE8M0 bytes, `F8_E8M0`; f32 scales are accepted too), dequantized to f32
//! on load (`w = E4M3(q) · scale[r/32][c/32]`, config `quantization_config.weight_block_size
//! [32, 32]`, `scale_fmt ue8m0`). Norms, `wk`, `weights_proj` and the compressor are bf16 or f32;
//! `attn_sink` and the `hc_*` mHC parameters are f32. Any tensor may be stored as F32 / BF16 / F16 /
//! FP8+scale: the loader converts by the dtype it finds and checks the shape against the geometry.
//!
//! Which layers own which tensors follows the role (docs/SPEC.md §0): every layer has the q/kv/o
//! projections, its norms, the sink and both mHC sites; Full layers add the compressor
//! (`wgate` only at ratio 2) and the indexer with its own K projection (`wk`, `k_norm`); Reindex
//! layers add only the indexer Q side (`wq_b`, `weights_proj`).

pub mod synth;

use crate::backend::gemm::WeightView;
use crate::error::{Error, Result};
use crate::formats::scalar::{e4m3_decode, e8m0_decode};
use crate::geometry::{Geometry, Role};
use crate::ops::mhc::{cpu::PackedHcFn, MixWeights, HC, MIX};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{tensor::Metadata, Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// FP8 weight block edge (config `weight_block_size = [32, 32]`).
pub const FP8_BLOCK: usize = 32;
/// Name of the shard index file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Checkpoint geometries: the released one, and a tiny one with the same 40-layer role plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// hidden 256, 4 query heads, q-LoRA 64, 2 output groups of LoRA 64, 4 indexer heads. Head dim
    /// (512 = 448 NoPE + 64 RoPE), index head dim (128) and the layer plan stay as released so KV
    /// records keep their real formats; every dim is a multiple of the 32×32 FP8 block.
    Tiny,
    /// The released DeepSeek-V4.1-Flash geometry (hidden 5120, 64 heads, …).
    Full,
}

impl Scale {
    /// Parses `tiny` / `full`.
    pub fn from_name(s: &str) -> Result<Scale> {
        match s {
            "tiny" => Ok(Scale::Tiny),
            "full" => Ok(Scale::Full),
            _ => Err(Error::invalid(
                "scale",
                format!("expected tiny or full, found {s:?}"),
            )),
        }
    }
    /// `tiny` / `full`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scale::Tiny => "tiny",
            Scale::Full => "full",
        }
    }
    /// The config.json text of this scale (the released config, with the tiny overrides applied).
    pub fn config_json(self) -> String {
        let mut v: serde_json::Value =
            serde_json::from_str(crate::geometry::EMBEDDED_CONFIG).expect("embedded config");
        if self == Scale::Tiny {
            let t = v
                .get_mut("text_config")
                .and_then(|t| t.as_object_mut())
                .expect("embedded config has text_config");
            for (k, val) in [
                ("hidden_size", 256),
                ("num_attention_heads", 4),
                ("q_lora_rank", 64),
                ("o_lora_rank", 64),
                ("o_groups", 2),
                ("index_n_heads", 4),
            ] {
                t.insert(k.into(), val.into());
            }
        }
        serde_json::to_string_pretty(&v).expect("json")
    }
    /// The geometry of this scale.
    pub fn geometry(self) -> Geometry {
        Geometry::from_json_str(&self.config_json()).expect("scale configs are valid")
    }
}

/// How the synthetic writer stores a tensor (the release's choice per tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// `F8_E4M3` data + `F8_E8M0` block scale `….scale` over 32×32 blocks.
    Fp8Block,
    /// `BF16`.
    Bf16,
    /// `F32`.
    F32,
}

/// One expected tensor: released name, logical shape, storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Key in the checkpoint, e.g. `layers.2.attn.wq_a.weight`.
    pub name: String,
    /// Logical shape (`[out, in]` for linears).
    pub shape: Vec<usize>,
    /// Storage used by the release (and by `make-checkpoint`).
    pub stored: Stored,
}

/// The scale tensor name of an FP8 weight: `X.weight` → `X.scale`.
pub fn scale_name(weight: &str) -> String {
    match weight.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.scale"),
        None => format!("{weight}.scale"),
    }
}

/// Tensors of layer `layer` of `g` (attention sublayer, its norms and both mHC sites), by role.
///
/// Errors: [`Error::Invalid`] when `layer` is not a backbone layer of `g`.
pub fn layer_specs(g: &Geometry, layer: usize) -> Result<Vec<TensorSpec>> {
    let plan = g.layers.get(layer).ok_or_else(|| {
        Error::invalid(
            "layer",
            format!("{layer} is out of range 0..{}", g.num_layers),
        )
    })?;
    let (d, h, hd, ql) = (g.hidden_size, g.num_heads, g.head_dim, g.q_lora_rank);
    let (og, ol) = (g.o_groups, g.o_lora_rank);
    let (ih, ihd) = (g.index_heads, g.index_head_dim);
    let p = format!("layers.{layer}");
    let mut v = Vec::new();
    let mut push = |n: &str, shape: &[usize], stored: Stored| {
        v.push(TensorSpec {
            name: format!("{p}.{n}"),
            shape: shape.to_vec(),
            stored,
        })
    };
    use Stored::*;
    push("attn.wq_a.weight", &[ql, d], Fp8Block);
    push("attn.q_norm.weight", &[ql], Bf16);
    push("attn.wq_b.weight", &[h * hd, ql], Fp8Block);
    push("attn.wkv.weight", &[hd, d], Fp8Block);
    push("attn.kv_norm.weight", &[hd], Bf16);
    push("attn.attn_sink", &[h], F32);
    push("attn.wo_a.weight", &[og * ol, h / og * hd], Fp8Block);
    push("attn.wo_b.weight", &[d, og * ol], Fp8Block);
    if plan.role == Role::Full {
        // Not block-quantized in the release; the ratio-2 compressor is kept in f32 there (the
        // score GEMM runs with an f32 output), the ratio-1 one in bf16.
        let cs = if plan.ratio >= 2 { F32 } else { Bf16 };
        push("attn.compressor.wkv.weight", &[hd, d], cs);
        if plan.ratio >= 2 {
            push("attn.compressor.wgate.weight", &[hd, d], cs);
        }
        push("attn.compressor.norm.weight", &[hd], Bf16);
    }
    if matches!(plan.role, Role::Full | Role::Reindex) {
        push("attn.indexer.wq_b.weight", &[ih * ihd, ql], Fp8Block);
        push("attn.indexer.weights_proj.weight", &[ih, d], Bf16);
    }
    if plan.role == Role::Full {
        push("attn.indexer.wk.weight", &[ihd, hd], Bf16);
        push("attn.indexer.k_norm.weight", &[ihd], Bf16);
    }
    for site in ["attn", "ffn"] {
        push(&format!("hc_{site}_fn"), &[MIX, HC * d], F32);
        push(&format!("hc_{site}_base"), &[MIX], F32);
        push(&format!("hc_{site}_scale"), &[3], F32);
    }
    push("attn_norm.weight", &[d], Bf16);
    push("ffn_norm.weight", &[d], Bf16);
    Ok(v)
}

/// A dense row-major matrix `[rows, cols]` (linears: `[out, in]`, y = W·x) in the dtype the
/// checkpoint stores it in; [`crate::backend::gemm::linear_w`] widens it to f32 inside the kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    /// `rows × cols` values, row-major, in their stored dtype.
    pub data: MatrixData,
}

/// The stored values of a [`Matrix`].
#[derive(Debug, Clone, PartialEq)]
pub enum MatrixData {
    /// f32 values (checkpoint `F32` or `F16`, or an FP8 matrix whose scales do not fold).
    F32(Vec<f32>),
    /// bf16 bit patterns (checkpoint `BF16`): 2 B per value.
    Bf16(Vec<u16>),
    /// FP8 E4M3 codes with one scale per 32 × 32 block (checkpoint `F8_E4M3` + `….scale`): 1 B
    /// per value. The value of `(r, c)` is `E4M3(codes[r·cols + c]) · scale[r/32][c/32]` in f32.
    Fp8Block {
        /// E4M3 codes, no NaN code.
        codes: Vec<u8>,
        /// Block scales `[⌈rows/32⌉, ⌈cols/32⌉]`, finite and below 2^8.
        scale: Vec<f32>,
        /// `scale · 2^120`, what the kernel multiplies the bit-moved code by
        /// ([`crate::backend::gemm::E4M3_FOLD`]).
        folded: Vec<f32>,
    },
}

impl Matrix {
    /// An f32 matrix.
    pub fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        Matrix {
            rows,
            cols,
            data: MatrixData::F32(data),
        }
    }
    /// A bf16 matrix: `values` rounded to nearest-even bf16.
    pub fn bf16_from_f32(rows: usize, cols: usize, values: &[f32]) -> Matrix {
        Matrix {
            rows,
            cols,
            data: MatrixData::Bf16(
                values
                    .par_iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect(),
            ),
        }
    }
    /// An FP8 block-scaled matrix. A scale of 2^8 or more (its fold by 2^120 would overflow f32)
    /// keeps the matrix as its dequantized f32 values instead (same values, 4 B each).
    ///
    /// Errors: [`Error::Shape`] when `codes` or `scale` does not match `[rows, cols]` and its
    /// 32 × 32 blocks; [`Error::Invalid`] for a NaN code or a non-finite scale.
    pub fn fp8_block(rows: usize, cols: usize, codes: Vec<u8>, scale: Vec<f32>) -> Result<Matrix> {
        let (br, bc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
        if codes.len() != rows * cols || scale.len() != br * bc {
            return Err(Error::shape(
                "FP8 matrix",
                format!("{} codes and {} block scales", rows * cols, br * bc),
                format!("{} codes and {} block scales", codes.len(), scale.len()),
            ));
        }
        if let Some(i) = codes.iter().position(|&b| b & 0x7F == 0x7F) {
            return Err(Error::invalid(
                "FP8 matrix",
                format!("element {i} is a NaN code"),
            ));
        }
        if let Some(i) = scale.iter().position(|s| !s.is_finite()) {
            return Err(Error::invalid(
                "FP8 matrix",
                format!("block scale {i} is not finite"),
            ));
        }
        let folded: Vec<f32> = scale
            .iter()
            .map(|&s| s * crate::backend::gemm::E4M3_FOLD)
            .collect();
        if folded.iter().all(|f| f.is_finite()) {
            return Ok(Matrix {
                rows,
                cols,
                data: MatrixData::Fp8Block {
                    codes,
                    scale,
                    folded,
                },
            });
        }
        let mut v = vec![0f32; rows * cols];
        v.par_chunks_mut(cols.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                for (c, o) in row.iter_mut().enumerate() {
                    *o = e4m3_decode(codes[r * cols + c])
                        * scale[r / FP8_BLOCK * bc + c / FP8_BLOCK];
                }
            });
        Ok(Matrix::f32(rows, cols, v))
    }
    /// The kernel's borrowed view.
    pub fn view(&self) -> WeightView<'_> {
        match &self.data {
            MatrixData::F32(d) => WeightView::F32 {
                data: d,
                cols: self.cols,
            },
            MatrixData::Bf16(d) => WeightView::Bf16 {
                data: d,
                cols: self.cols,
            },
            MatrixData::Fp8Block { codes, folded, .. } => WeightView::Fp8 {
                codes,
                folded,
                cols: self.cols,
                row0: 0,
            },
        }
    }
    /// Every value as the f32 the kernel multiplies (the dequantized weight), row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            MatrixData::F32(d) => d.clone(),
            _ => self.view().to_f32(),
        }
    }
    /// The values as f32: borrowed when stored as f32, dequantized otherwise.
    pub fn f32_values(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.data {
            MatrixData::F32(d) => std::borrow::Cow::Borrowed(d),
            _ => std::borrow::Cow::Owned(self.to_f32()),
        }
    }
    /// The same values stored as f32 (for the small matrices an op reads as plain f32).
    pub fn into_f32(self) -> Matrix {
        match self.data {
            MatrixData::F32(_) => self,
            _ => Matrix::f32(self.rows, self.cols, self.to_f32()),
        }
    }
    /// Bytes of the stored values (block scales included).
    pub fn stored_bytes(&self) -> usize {
        match &self.data {
            MatrixData::F32(d) => d.len() * 4,
            MatrixData::Bf16(d) => d.len() * 2,
            MatrixData::Fp8Block { codes, scale, .. } => codes.len() + scale.len() * 4,
        }
    }
    /// `f32`, `bf16` or `fp8_e4m3`.
    pub fn dtype_name(&self) -> &'static str {
        match &self.data {
            MatrixData::F32(_) => "f32",
            MatrixData::Bf16(_) => "bf16",
            MatrixData::Fp8Block { .. } => "fp8_e4m3",
        }
    }
}

/// One mHC site's parameters (f32): `hc_fn [24, 4d]`, `hc_base [24]`, `hc_scale [3]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HcSite {
    /// `hc_fn [24, 4d]`.
    pub hc_fn: Vec<f32>,
    /// `hc_base [24]`.
    pub base: Vec<f32>,
    /// `hc_scale [3]`.
    pub scale: Vec<f32>,
    /// `hc_fn` packed for the CPU mix kernel at load ([`PackedHcFn`]).
    pub packed: PackedHcFn,
}

impl HcSite {
    /// Packs `hc_fn [24, 4·hidden]` for the mix kernel. Errors: [`crate::Error::Shape`] on a
    /// wrong `hc_fn` length.
    pub fn new(hidden: usize, hc_fn: Vec<f32>, base: Vec<f32>, scale: Vec<f32>) -> Result<HcSite> {
        let packed = PackedHcFn::new(hidden, &hc_fn)?;
        Ok(HcSite {
            hc_fn,
            base,
            scale,
            packed,
        })
    }

    /// Borrowed view for [`crate::ops::mhc`].
    pub fn mix(&self) -> MixWeights<'_> {
        MixWeights {
            hc_fn: &self.hc_fn,
            base: &self.base,
            scale: &self.scale,
            packed: Some(&self.packed),
        }
    }
}

/// Compressor of a Full layer.
#[derive(Debug, Clone, PartialEq)]
pub struct CompressorWeights {
    /// `wkv [head_dim, hidden]`.
    pub wkv: Matrix,
    /// `wgate [head_dim, hidden]`: the pooling score, ratio-2 layers only.
    pub wgate: Option<Matrix>,
    /// RMSNorm weight of the pooled latent `[head_dim]`.
    pub norm: Vec<f32>,
}

/// The index-K projection owned by a Full layer's indexer.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexKWeights {
    /// `wk [index_head_dim, head_dim]` (latent → index K).
    pub wk: Matrix,
    /// RMSNorm weight of index K `[index_head_dim]`.
    pub k_norm: Vec<f32>,
}

/// Lightning indexer of a Full or Reindex layer.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexerWeights {
    /// `wq_b [index_heads · index_head_dim, q_lora_rank]`.
    pub wq_b: Matrix,
    /// `weights_proj [index_heads, hidden]` (per-head weights).
    pub weights_proj: Matrix,
    /// Index-K projection: Full layers only (Reindex layers read their KV source's index K).
    pub k: Option<IndexKWeights>,
}

/// Attention sublayer weights of one layer, shaped by its role.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionWeights {
    /// `wq_a [q_lora_rank, hidden]`.
    pub wq_a: Matrix,
    /// `q_norm [q_lora_rank]`.
    pub q_norm: Vec<f32>,
    /// `wq_b [heads · head_dim, q_lora_rank]`.
    pub wq_b: Matrix,
    /// `wkv [head_dim, hidden]` (the SWA latent).
    pub wkv: Matrix,
    /// `kv_norm [head_dim]`.
    pub kv_norm: Vec<f32>,
    /// Per-head sink logit `[heads]`.
    pub attn_sink: Vec<f32>,
    /// `wo_a [o_groups · o_lora_rank, heads/o_groups · head_dim]` (grouped output LoRA).
    pub wo_a: Matrix,
    /// `wo_b [hidden, o_groups · o_lora_rank]`.
    pub wo_b: Matrix,
    /// Full layers only.
    pub compressor: Option<CompressorWeights>,
    /// Full and Reindex layers only.
    pub indexer: Option<IndexerWeights>,
}

/// Everything of one layer the attention stack needs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// Layer id.
    pub id: usize,
    /// CSA2 role.
    pub role: Role,
    /// Attention sublayer.
    pub attn: AttentionWeights,
    /// mHC site before attention.
    pub hc_attn: HcSite,
    /// mHC site before the FFN.
    pub hc_ffn: HcSite,
    /// `attn_norm [hidden]`.
    pub attn_norm: Vec<f32>,
    /// `ffn_norm [hidden]`.
    pub ffn_norm: Vec<f32>,
}

impl LayerWeights {
    /// Every matrix stored as f32 (same values).
    pub fn into_f32(self) -> LayerWeights {
        let mut w = self;
        let a = &mut w.attn;
        for m in [
            &mut a.wq_a,
            &mut a.wq_b,
            &mut a.wkv,
            &mut a.wo_a,
            &mut a.wo_b,
        ] {
            *m = std::mem::replace(m, Matrix::f32(0, 0, vec![])).into_f32();
        }
        if let Some(c) = &mut a.compressor {
            c.wkv = std::mem::replace(&mut c.wkv, Matrix::f32(0, 0, vec![])).into_f32();
            if let Some(g) = &mut c.wgate {
                *g = std::mem::replace(g, Matrix::f32(0, 0, vec![])).into_f32();
            }
        }
        if let Some(i) = &mut a.indexer {
            i.wq_b = std::mem::replace(&mut i.wq_b, Matrix::f32(0, 0, vec![])).into_f32();
            i.weights_proj =
                std::mem::replace(&mut i.weights_proj, Matrix::f32(0, 0, vec![])).into_f32();
        }
        w
    }
    /// Bytes of the stored matrices (scales included).
    pub fn matrix_bytes(&self) -> usize {
        let a = &self.attn;
        let mut n = [&a.wq_a, &a.wq_b, &a.wkv, &a.wo_a, &a.wo_b]
            .iter()
            .map(|m| m.stored_bytes())
            .sum::<usize>();
        if let Some(c) = &a.compressor {
            n += c.wkv.stored_bytes() + c.wgate.as_ref().map_or(0, |g| g.stored_bytes());
        }
        if let Some(i) = &a.indexer {
            n += i.wq_b.stored_bytes()
                + i.weights_proj.stored_bytes()
                + i.k.as_ref().map_or(0, |k| k.wk.stored_bytes());
        }
        n
    }
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    header: usize,
    meta: Metadata,
}

/// A checkpoint directory: `model.safetensors.index.json` + shards (or a single
/// `model.safetensors`), memory-mapped.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// tensor name → shard index.
    where_is: BTreeMap<String, usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.where_is.len())
            .finish()
    }
}

fn parse_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Parse {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

impl Checkpoint {
    /// Opens `dir`: reads the index (or finds `model.safetensors`) and maps every shard it names.
    ///
    /// Errors: [`Error::Io`] for unreadable files, [`Error::Parse`] for a bad index or shard
    /// header, [`Error::NotFound`] when the index names a tensor its shard lacks.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join(INDEX_FILE);
        let mut files: Vec<String> = Vec::new();
        let mut claimed: BTreeMap<String, String> = BTreeMap::new();
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| parse_err(&index, e.to_string()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| parse_err(&index, "no `weight_map` object"))?;
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    parse_err(&index, format!("weight_map[{name}] is not a string"))
                })?;
                if file.contains('/') || file.contains("..") {
                    return Err(parse_err(
                        &index,
                        format!("shard name {file:?} leaves the directory"),
                    ));
                }
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_string());
                }
                claimed.insert(name.clone(), file.to_string());
            }
        } else if dir.join("model.safetensors").exists() {
            files.push("model.safetensors".into());
        } else {
            return Err(Error::NotFound(format!(
                "{}: neither {INDEX_FILE} nor model.safetensors",
                dir.display()
            )));
        }
        files.sort();
        let mut shards = Vec::new();
        let mut where_is = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            let path = dir.join(f);
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            let map = map_file(&file, &path)?;
            let (header, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| parse_err(&path, e.to_string()))?;
            for name in meta.tensors().keys() {
                where_is.insert(name.clone(), i);
            }
            shards.push(Shard {
                path,
                map,
                header,
                meta,
            });
        }
        for (name, file) in &claimed {
            let i = files.iter().position(|f| f == file).expect("listed");
            if where_is.get(name) != Some(&i) {
                return Err(Error::NotFound(format!(
                    "tensor `{name}`: {INDEX_FILE} places it in {file}, which does not hold it"
                )));
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            where_is,
        })
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.where_is.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.where_is.keys().map(|s| s.as_str())
    }

    /// Dtype, shape and raw little-endian bytes of `name` (borrowed from the mapping).
    ///
    /// Errors: [`Error::NotFound`] naming the tensor.
    pub fn raw(&self, name: &str) -> Result<(Dtype, &[usize], &[u8])> {
        let &i = self.where_is.get(name).ok_or_else(|| {
            Error::NotFound(format!(
                "tensor `{name}` is not in the checkpoint at {}",
                self.dir.display()
            ))
        })?;
        let s = &self.shards[i];
        let info = s.meta.info(name).expect("indexed at open");
        let (a, b) = info.data_offsets;
        let base = 8 + s.header;
        let bytes = s.map.get(base + a..base + b).ok_or_else(|| {
            parse_err(
                &s.path,
                format!("tensor `{name}` runs past the end of the file"),
            )
        })?;
        Ok((info.dtype, &info.shape, bytes))
    }

    /// Loads `name` as f32 after checking its shape is `shape`; FP8 E4M3 tensors are dequantized
    /// with their `….scale` block scales (UE8M0 or f32).
    ///
    /// Errors: [`Error::NotFound`] when the tensor (or an FP8 tensor's scale) is missing — the
    /// message names it and the expected shape; [`Error::Shape`] naming the tensor, expected and
    /// found shape; [`Error::Parse`] for unsupported dtypes or NaN codes.
    pub fn load_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (dtype, bytes) = self.checked(name, shape)?;
        let path = &self.shards[self.where_is[name]].path;
        match dtype {
            Dtype::F32 => Ok(bytes
                .par_chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            Dtype::BF16 => Ok(bytes
                .par_chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            Dtype::F16 => Ok(bytes
                .par_chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            Dtype::F8_E4M3 => {
                let scales = self.fp8_scales(name, shape, bytes, path)?;
                let (rows, cols) = (shape[0], shape[1]);
                let bc = cols.div_ceil(FP8_BLOCK);
                let mut out = vec![0.0f32; rows * cols];
                out.par_chunks_mut(cols.max(1))
                    .enumerate()
                    .for_each(|(r, row)| {
                        let srow = &scales[(r / FP8_BLOCK) * bc..(r / FP8_BLOCK + 1) * bc];
                        for (c, (o, &b)) in row
                            .iter_mut()
                            .zip(&bytes[r * cols..(r + 1) * cols])
                            .enumerate()
                        {
                            *o = e4m3_decode(b) * srow[c / FP8_BLOCK];
                        }
                    });
                Ok(out)
            }
            other => Err(parse_err(
                path,
                format!("tensor `{name}` has dtype {other:?}; expected F32, BF16, F16 or F8_E4M3"),
            )),
        }
    }

    /// Loads `name` as a [`Matrix`] `[rows, cols]` in its stored dtype: BF16 stays bf16, FP8 E4M3
    /// stays codes + block scales (UE8M0 or f32 scales), F32 and F16 become f32.
    ///
    /// Errors: as [`Checkpoint::load_f32`].
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let shape = [rows, cols];
        let (dtype, bytes) = self.checked(name, &shape)?;
        let path = &self.shards[self.where_is[name]].path;
        match dtype {
            Dtype::BF16 => Ok(Matrix {
                rows,
                cols,
                data: MatrixData::Bf16(
                    bytes
                        .par_chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                ),
            }),
            Dtype::F8_E4M3 => {
                let scales = self.fp8_scales(name, &shape, bytes, path)?;
                Matrix::fp8_block(rows, cols, bytes.to_vec(), scales)
                    .map_err(|e| parse_err(path, format!("FP8 `{name}`: {e}")))
            }
            _ => Ok(Matrix::f32(rows, cols, self.load_f32(name, &shape)?)),
        }
    }

    /// Dtype and bytes of `name` after checking its shape is `shape` (errors of `load_f32`).
    fn checked(&self, name: &str, shape: &[usize]) -> Result<(Dtype, &[u8])> {
        let (dtype, found, bytes) = self.raw(name).map_err(|_| {
            Error::NotFound(format!(
                "tensor `{name}` (expected shape {}) is not in the checkpoint at {}",
                shape_str(shape),
                self.dir.display()
            ))
        })?;
        if found != shape {
            return Err(Error::shape(
                format!("tensor `{name}`"),
                shape_str(shape),
                shape_str(found),
            ));
        }
        Ok((dtype, bytes))
    }

    /// The checked block scales of FP8 tensor `name` `shape` (its codes `q` checked for NaN codes).
    fn fp8_scales(&self, name: &str, shape: &[usize], q: &[u8], path: &Path) -> Result<Vec<f32>> {
        if shape.len() != 2 {
            return Err(Error::shape(
                format!("FP8 tensor `{name}`"),
                "2 dims [out, in] for 32×32 block scales",
                shape_str(shape),
            ));
        }
        let (rows, cols) = (shape[0], shape[1]);
        let (br, bc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
        let sname = scale_name(name);
        let (sd, sshape, sbytes) = self.raw(&sname).map_err(|_| {
            Error::NotFound(format!(
                "tensor `{sname}` (block scale of FP8 `{name}`, expected shape [{br}, {bc}]) is not in the checkpoint at {}",
                self.dir.display()
            ))
        })?;
        if sshape != [br, bc] {
            return Err(Error::shape(
                format!("tensor `{sname}`"),
                shape_str(&[br, bc]),
                shape_str(sshape),
            ));
        }
        let scales: Vec<f32> = match sd {
            Dtype::F8_E8M0 => sbytes.iter().map(|&b| e8m0_decode(b)).collect(),
            Dtype::F32 => sbytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            other => {
                return Err(parse_err(
                    path,
                    format!("scale `{sname}` has dtype {other:?}; expected F8_E8M0 or F32"),
                ))
            }
        };
        if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
            return Err(parse_err(
                path,
                format!("scale `{sname}` block {i} is not finite"),
            ));
        }
        if let Some(i) = q.iter().position(|&b| b & 0x7F == 0x7F) {
            return Err(parse_err(
                path,
                format!("FP8 `{name}` element {i} is a NaN code"),
            ));
        }
        Ok(scales)
    }

    /// Loads layer `layer`'s attention, norms and mHC tensors per its role in `g`.
    ///
    /// Errors: as [`Checkpoint::load_f32`], for the first missing or misshaped tensor.
    pub fn layer(&self, g: &Geometry, layer: usize) -> Result<LayerWeights> {
        let specs = layer_specs(g, layer)?;
        let get = |suffix: &str| -> Result<Vec<f32>> {
            let full = format!("layers.{layer}.{suffix}");
            let s = specs.iter().find(|s| s.name == full).expect("spec listed");
            self.load_f32(&s.name, &s.shape)
        };
        let mat = |suffix: &str| -> Result<Matrix> {
            let full = format!("layers.{layer}.{suffix}");
            let s = specs.iter().find(|s| s.name == full).expect("spec listed");
            self.matrix(&s.name, s.shape[0], s.shape[1])
        };
        assemble_layer(g, layer, get, mat)
    }
}

#[allow(unsafe_code)]
fn map_file(file: &File, path: &Path) -> Result<Mmap> {
    // SAFETY: the mapping is read-only and lives as long as the Checkpoint; a checkpoint modified
    // by another process while mapped is outside the contract (as for every mmap-based loader).
    unsafe { Mmap::map(file) }.map_err(|e| Error::io(path, e))
}

/// Assembles one layer's weights by role from two lookups keyed by the tensor-name suffix after
/// `layers.{L}.` (`get` for vectors, `mat` for matrices): the one place that maps the released
/// checkpoint naming onto [`LayerWeights`], shared by the loader and the in-memory synthetic weights.
///
/// Errors: the first error either lookup returns.
pub fn assemble_layer(
    g: &Geometry,
    layer: usize,
    get: impl Fn(&str) -> Result<Vec<f32>>,
    mat: impl Fn(&str) -> Result<Matrix>,
) -> Result<LayerWeights> {
    let plan = &g.layers[layer];
    let compressor = if plan.role == Role::Full {
        Some(CompressorWeights {
            wkv: mat("attn.compressor.wkv.weight")?,
            wgate: if plan.ratio >= 2 {
                Some(mat("attn.compressor.wgate.weight")?)
            } else {
                None
            },
            norm: get("attn.compressor.norm.weight")?,
        })
    } else {
        None
    };
    let indexer = if matches!(plan.role, Role::Full | Role::Reindex) {
        Some(IndexerWeights {
            wq_b: mat("attn.indexer.wq_b.weight")?,
            weights_proj: mat("attn.indexer.weights_proj.weight")?,
            k: if plan.role == Role::Full {
                Some(IndexKWeights {
                    // Read by the compressor as plain f32 (128 × 512, small).
                    wk: mat("attn.indexer.wk.weight")?.into_f32(),
                    k_norm: get("attn.indexer.k_norm.weight")?,
                })
            } else {
                None
            },
        })
    } else {
        None
    };
    let site = |s: &str| -> Result<HcSite> {
        HcSite::new(
            g.hidden_size,
            get(&format!("hc_{s}_fn"))?,
            get(&format!("hc_{s}_base"))?,
            get(&format!("hc_{s}_scale"))?,
        )
    };
    Ok(LayerWeights {
        id: layer,
        role: plan.role,
        attn: AttentionWeights {
            wq_a: mat("attn.wq_a.weight")?,
            q_norm: get("attn.q_norm.weight")?,
            wq_b: mat("attn.wq_b.weight")?,
            wkv: mat("attn.wkv.weight")?,
            kv_norm: get("attn.kv_norm.weight")?,
            attn_sink: get("attn.attn_sink")?,
            wo_a: mat("attn.wo_a.weight")?,
            wo_b: mat("attn.wo_b.weight")?,
            compressor,
            indexer,
        },
        hc_attn: site("attn")?,
        hc_ffn: site("ffn")?,
        attn_norm: get("attn_norm.weight")?,
        ffn_norm: get("ffn_norm.weight")?,
    })
}
