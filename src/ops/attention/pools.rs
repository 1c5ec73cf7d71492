//! Attention read in place from vLLM's page pools (FlashMLA's sparse contract): each
//! listed slot is resolved to its bytes at use through [`PoolView`] (the pool descriptor of
//! `ops::pool`), so nothing is gathered or compacted. The CUDA kernel (`ops::attention::cuda`,
//! feature `cuda`) takes the same descriptor.

use super::{
    attention_with_rows, plan_indexed, AttentionDots, AttentionParams, IndexedInputs, KvRows,
};
use crate::error::{Error, Result};
use crate::formats::KV_DIM;
pub use crate::ops::pool::{PoolDesc, PoolLayout, PoolView};
use half::bf16;

/// Inputs of [`attention_pools`] (the C ABI `csa2_attention_pools`): FlashMLA's sparse decode /
/// prefill contract as vLLM 0.33 `models/deepseek_v41/nvidia/flashmla.py` calls it.
#[derive(Debug, Clone, Copy)]
pub struct PoolInputs<'a> {
    /// `[T, padded_heads, 512]` bf16 RoPE'd queries (padded heads 64 or 128).
    pub q: &'a [bf16],
    /// Padded heads of `q` and `out` (64 or 128).
    pub padded_heads: usize,
    /// Local heads `n ≤ padded_heads` (64 at TP 1; 32 / 16 / 8 at TP 2 / 4 / 8): heads `≥ n` are
    /// padding, written as zeros.
    pub heads: usize,
    /// `[heads]` f32 sink logits.
    pub sink: &'a [f32],
    /// `[T, Km]` i32 global slots of the compressed pool (−1 = none); `Km` may be 0.
    pub main_idx: &'a [i32],
    /// `[T]` i32 valid length of each `main_idx` row (entries at or past it are not read).
    pub main_len: Option<&'a [i32]>,
    /// `[T, Ks]` i32 global slots of the SWA pool (−1 = none).
    pub swa_idx: &'a [i32],
    /// `[T]` i32 valid length of each `swa_idx` row.
    pub swa_len: Option<&'a [i32]>,
    /// Softmax scale (512^-0.5).
    pub scale: f32,
}

/// Attention of `T` tokens over the two pools, in place: per token and local head one softmax
/// over the listed compressed entries then the listed SWA slots, plus the sink in the denominator
/// (docs/SPEC.md §2.7–§2.8). Writes `out` `[T, padded_heads, 512]` bf16 (heads past `heads`
/// zero) and, when given, `lse` `[T, heads]` f32 (natural log, without the sink; −∞ with zeros
/// out for a token that attends nothing). `main` is `None` for an SWA-only layer; its lists must
/// then name no slot. Records are decoded exactly (f32) at use; sums are f32
/// ([`crate::tolerance::F32_VS_F64`] before the final bf16 rounding).
///
/// Errors (nothing written): [`Error::Shape`] for inconsistent shapes or `padded_heads` other
/// than 64 / 128; [`Error::Invalid`] for `heads` outside `1..=padded_heads`, a slot `< −1` or
/// past its pool (naming the list, token and column), a pool whose format is not a 512-value
/// latent, a non-finite q or sink, or a token over [`super::MAX_TOKEN_ROWS`] rows.
pub fn attention_pools(
    inp: &PoolInputs,
    main: Option<PoolView>,
    swa: PoolView,
    out: &mut [bf16],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let (hp, h) = (inp.padded_heads, inp.heads);
    if hp != 64 && hp != 128 {
        return Err(Error::shape("q padded heads", "64 or 128", hp));
    }
    if h == 0 || h > hp {
        return Err(Error::invalid(
            "heads",
            format!("{h} local heads must be in 1..={hp} (the padded heads)"),
        ));
    }
    let row = hp * KV_DIM;
    let t = inp.q.len() / row;
    if inp.q.len() != t * row {
        return Err(Error::shape(
            "q",
            format!("[T, {hp}, 512] bf16"),
            format!("{} values", inp.q.len()),
        ));
    }
    if out.len() != inp.q.len() {
        return Err(Error::shape(
            "out",
            format!("[{t}, {hp}, 512] bf16 (as q)"),
            format!("{} values", out.len()),
        ));
    }
    if let Some(l) = &lse {
        if l.len() != t * h {
            return Err(Error::shape(
                "lse",
                format!("[{t}, {h}] f32"),
                format!("{} values", l.len()),
            ));
        }
    }
    for (v, what) in [(Some(&swa), "SWA pool"), (main.as_ref(), "compressed pool")] {
        if let Some(v) = v {
            if v.desc().format.dim() != KV_DIM {
                return Err(Error::invalid(
                    what,
                    format!(
                        "format {} holds {} values per state, attention reads 512-value latents",
                        v.desc().format.name(),
                        v.desc().format.dim()
                    ),
                ));
            }
        }
    }
    // The local heads' queries as f32 (exact): the only copy, of q, never of the pools.
    let mut qf = vec![0f32; t * h * KV_DIM];
    for (dst, src) in qf.chunks_exact_mut(h * KV_DIM).zip(inp.q.chunks_exact(row)) {
        for (d, s) in dst.iter_mut().zip(&src[..h * KV_DIM]) {
            *d = s.to_f32();
        }
    }
    let empty: &[f32] = &[];
    let main_rows = main.map_or(KvRows::F32(empty), KvRows::Pool);
    let swa_rows = KvRows::Pool(swa);
    let p = AttentionParams {
        heads: h,
        scale: inp.scale,
        ..Default::default()
    };
    let ii = IndexedInputs {
        q: &qf,
        sink: inp.sink,
        main_idx: inp.main_idx,
        main_len: inp.main_len,
        swa_idx: inp.swa_idx,
        swa_len: inp.swa_len,
    };
    let rows = plan_indexed(&p, &ii, &main_rows, &swa_rows).map_err(|e| match (&main, e) {
        (None, Error::Invalid { name, reason }) if name == "main_idx" => Error::invalid(
            "main_idx",
            format!(
                "{reason}; this layer has no compressed pool (SWA-only), so its lists must be \
                 empty or −1"
            ),
        ),
        (_, e) => e,
    })?;
    let mut of = vec![0f32; t * h * KV_DIM];
    let mut lf = vec![0f32; t * h];
    attention_with_rows(
        &p,
        AttentionDots::F32,
        &qf,
        inp.sink,
        &rows,
        main_rows,
        swa_rows,
        &mut of,
        &mut lf,
    );
    for (dst, src) in out.chunks_exact_mut(row).zip(of.chunks_exact(h * KV_DIM)) {
        let (live, pad) = dst.split_at_mut(h * KV_DIM);
        for (d, &s) in live.iter_mut().zip(src) {
            *d = bf16::from_f32(s);
        }
        pad.fill(bf16::ZERO);
    }
    if let Some(l) = lse {
        l.copy_from_slice(&lf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::page::PageLayout;
    use crate::formats::RecordFormat;
    use crate::ops::attention::{attention_indexed, reference};
    use crate::tolerance::{compare, F32_VS_F64};
    use csa2_rng::{rand_normal, NewRng, Rng};

    /// A slab of `blocks` blocks of `stride` bytes whose bytes outside the pool's pages hold 0x7F
    /// (an E4M3 NaN, and a NaN-producing E8M0 0x7F·2^0 pattern in scales): a read past a page or
    /// from the wrong region shows up as a NaN or a wrong value. The pool starts `offset` bytes
    /// into the slab, as a layer's view does. Returns (slab, offset, desc, encoded rows).
    fn slab(
        rng: &mut Rng,
        format: RecordFormat,
        layout: PoolLayout,
        blocks: usize,
        states: usize,
        offset: usize,
    ) -> (Vec<u8>, PoolDesc, Vec<f32>) {
        let page = states * format.record_bytes();
        let stride = offset + page + 3 * 64 + 8;
        let desc = PoolDesc {
            format,
            layout,
            blocks,
            states_per_page: states,
            block_stride: stride,
        };
        let mut bytes = vec![0x7Fu8; offset + blocks * stride];
        let n = blocks * states;
        let rows = rand_normal(rng, n * format.dim(), 1.0);
        let (db, sb) = (format.data_bytes(), format.scale_bytes());
        for slot in 0..n {
            let (d, s) = desc.offsets(slot);
            let mut data = vec![0u8; db];
            let mut sc = vec![0u8; sb];
            format.encode_row(
                &rows[slot * format.dim()..][..format.dim()],
                &mut data,
                &mut sc,
            );
            bytes[offset + d..][..db].copy_from_slice(&data);
            bytes[offset + s..][..sb].copy_from_slice(&sc);
        }
        (bytes, desc, rows)
    }

    /// The pool's records compacted as standalone records (data then scales), slot order.
    fn compacted(v: &PoolView) -> Vec<u8> {
        (0..v.desc().slots())
            .flat_map(|s| {
                let (d, sc) = v.parts(s);
                d.iter().chain(sc).copied().collect::<Vec<u8>>()
            })
            .collect()
    }

    #[test]
    fn planar_addressing_is_the_page_layout_and_interleaved_is_one_row_per_record() {
        for format in RecordFormat::ALL {
            let lay = PageLayout { format, slots: 8 };
            let desc = PoolDesc {
                format,
                layout: PoolLayout::BlockPlanar,
                blocks: 3,
                states_per_page: 8,
                block_stride: lay.page_bytes(),
            };
            for slot in 0..24 {
                let (d, s) = lay.slot_ranges(slot % 8);
                let base = (slot / 8) * lay.page_bytes();
                assert_eq!(
                    desc.offsets(slot),
                    (base + d.start, base + s.start),
                    "{format:?}"
                );
            }
            let il = PoolDesc {
                layout: PoolLayout::Interleaved,
                block_stride: 100_000,
                ..desc
            };
            let w = format.record_bytes();
            assert_eq!(
                il.offsets(8 + 3),
                (100_000 + 3 * w, 100_000 + 3 * w + format.data_bytes())
            );
        }
        assert_eq!(
            PoolLayout::vllm(RecordFormat::Nvfp4Ds),
            PoolLayout::Interleaved
        );
        assert_eq!(
            PoolLayout::vllm(RecordFormat::Mxfp8),
            PoolLayout::Interleaved
        );
        assert_eq!(
            PoolLayout::vllm(RecordFormat::V4Record),
            PoolLayout::BlockPlanar
        );
        assert_eq!(
            PoolLayout::vllm(RecordFormat::Mxfp4Index),
            PoolLayout::BlockPlanar
        );
        assert_eq!(
            PoolLayout::vllm(RecordFormat::Fp8Index),
            PoolLayout::BlockPlanar
        );
    }

    /// Every format in both layouts, strided and offset: `read` gives the exact decode of the
    /// record written at that slot (index-K pages included).
    #[test]
    fn strided_pools_read_back_every_slot() {
        let mut rng = Rng::new(31);
        for format in RecordFormat::ALL {
            for layout in [PoolLayout::Interleaved, PoolLayout::BlockPlanar] {
                let (bytes, desc, rows) = slab(&mut rng, format, layout, 3, 5, 96);
                let v = PoolView::new(desc, &bytes[96..], "pool").unwrap();
                let dim = format.dim();
                let mut got = vec![0f32; dim];
                let mut want = vec![0f32; dim];
                let mut rec = vec![0u8; format.record_bytes()];
                for slot in 0..15 {
                    v.read(slot, &mut got).unwrap();
                    crate::formats::encode_rows(format, &rows[slot * dim..][..dim], &mut rec)
                        .unwrap();
                    crate::formats::decode_rows(format, &rec, &mut want).unwrap();
                    assert_eq!(got, want, "{format:?} {layout:?} slot {slot}");
                }
                assert!(v.read(15, &mut got).is_err());
            }
        }
    }

    #[test]
    fn bad_descriptors_are_refused() {
        let d = PoolDesc {
            format: RecordFormat::Mxfp8,
            layout: PoolLayout::Interleaved,
            blocks: 4,
            states_per_page: 32,
            block_stride: 32 * 528,
        };
        let bytes = vec![0u8; d.extent()];
        assert!(PoolView::new(d, &bytes, "p").is_ok());
        let e = PoolView::new(d, &bytes[1..], "p").unwrap_err().to_string();
        assert!(e.contains("at least 67584"), "{e}");
        let e = PoolView::new(
            PoolDesc {
                block_stride: 32 * 528 - 1,
                ..d
            },
            &bytes,
            "p",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("overlap"), "{e}");
        let e = PoolView::new(
            PoolDesc {
                states_per_page: 0,
                ..d
            },
            &bytes,
            "p",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("states_per_page"), "{e}");
        let huge = PoolDesc {
            block_stride: usize::MAX / 2,
            ..d
        };
        assert!(PoolView::new(huge, &bytes, "p").is_err());
        // One block: any stride (vLLM may hand a one-block view).
        let one = PoolDesc {
            blocks: 1,
            block_stride: 0,
            ..d
        };
        assert!(PoolView::new(one, &bytes, "p").is_ok());
    }

    struct Lists {
        main_idx: Vec<i32>,
        main_len: Vec<i32>,
        swa_idx: Vec<i32>,
        swa_len: Vec<i32>,
    }

    /// Per-token lists with −1 holes, stale entries past the length, and repeated pages.
    fn lists(rng: &mut Rng, t: usize, km: usize, nm: usize, ks: usize, ns: usize) -> Lists {
        use rand::Rng as _;
        let mut l = Lists {
            main_idx: vec![],
            main_len: vec![],
            swa_idx: vec![],
            swa_len: vec![],
        };
        for i in 0..t {
            let lm = if nm == 0 { 0 } else { rng.random_range(0..=km) };
            for c in 0..km {
                l.main_idx.push(if c >= lm {
                    i32::MAX // stale: past the length, never read
                } else if c % 5 == 2 {
                    -1
                } else {
                    rng.random_range(0..nm) as i32
                });
            }
            let ls = if i == 1 { 0 } else { rng.random_range(1..=ks) };
            for c in 0..ks {
                l.swa_idx.push(if c >= ls {
                    -7 // stale
                } else {
                    rng.random_range(0..ns) as i32
                });
            }
            l.main_len.push(lm as i32);
            l.swa_len.push(ls as i32);
        }
        l
    }

    /// The CUDA route's pool launch (both kernels) on strided slabs of every record kind vLLM
    /// writes, 64 and 128 padded heads with fewer live heads, −1 holes, stale entries past the
    /// lengths, a token with an empty SWA list, lse and sink: against the same f64 reference as
    /// the host entry, the output rounded to bf16; padded heads come out zero. Runs on the
    /// emulated device (feature `cuda-emu`) or a GPU.
    /// Whether the kernels run as a sanitizer build of the host SIMT harness
    /// (`CSA2_EMU_SANITIZER`, scripts/simt-sanitizers.sh): the costliest tests then keep every
    /// case and code path with less repetition.
    #[cfg(feature = "cuda")]
    fn sanitized() -> bool {
        std::env::var_os("CSA2_EMU_SANITIZER").is_some_and(|v| !v.is_empty())
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_pool_launch_matches_reference_for_all_record_kinds() {
        use crate::cuda::CudaDevice;
        use crate::ops::attention::cuda::{launch_pools, PoolLaunch, PoolsKernel, PoolsLaunch};
        use crate::tolerance::{BF16_DOTS_VS_F64, GPU_BF16_VS_F64, GPU_F32_VS_F64};
        fn a<T>(dev: &CudaDevice, b: &crate::cuda::DeviceBuffer<T>) -> u64 {
            use crate::cuda::driver::DevicePtr;
            b.device_ptr(dev.stream()).0
        }
        if !CudaDevice::driver_present() {
            println!("SKIPPED: no CUDA driver");
            return;
        }
        let dev = CudaDevice::shared(0).unwrap();
        let mut rng = Rng::new(33);
        let kinds: [(Option<RecordFormat>, RecordFormat); 5] = [
            (Some(RecordFormat::Nvfp4Ds), RecordFormat::Mxfp8),
            (Some(RecordFormat::Mxfp8), RecordFormat::Mxfp8),
            (Some(RecordFormat::V4Record), RecordFormat::V4Record),
            (None, RecordFormat::Mxfp8),
            (None, RecordFormat::V4Record),
        ];
        for (ki, (mf, sf)) in kinds.into_iter().enumerate() {
            for (hp, h) in [(64, 64), (128, 8)] {
                let t = 4;
                let (sb, sd, _) = slab(&mut rng, sf, PoolLayout::vllm(sf), 5, 32, 64);
                let swa = PoolView::new(sd, &sb[64..], "swa").unwrap();
                let mslab = mf.map(|f| slab(&mut rng, f, PoolLayout::vllm(f), 3, 16, 200));
                let main = mslab
                    .as_ref()
                    .map(|(b, d, _)| PoolView::new(*d, &b[200..], "main").unwrap());
                let nm = main.map_or(0, |m| m.desc().slots());
                let km = if main.is_some() { 24 } else { 0 };
                let l = lists(&mut rng, t, km, nm, 40, swa.desc().slots());
                let qv = rand_normal(&mut rng, t * hp * KV_DIM, 2.0);
                let q: Vec<bf16> = qv.iter().map(|&v| bf16::from_f32(v)).collect();
                let sink = rand_normal(&mut rng, h, 1.0);
                let mut qf = vec![0f32; t * h * KV_DIM];
                for ti in 0..t {
                    for j in 0..h * KV_DIM {
                        qf[ti * h * KV_DIM + j] = q[ti * hp * KV_DIM + j].to_f32();
                    }
                }
                let p = AttentionParams {
                    heads: h,
                    ..Default::default()
                };
                let ii = IndexedInputs {
                    q: &qf,
                    sink: &sink,
                    main_idx: &l.main_idx,
                    main_len: Some(&l.main_len),
                    swa_idx: &l.swa_idx,
                    swa_len: Some(&l.swa_len),
                };
                let mrows = main.map_or(KvRows::F32(&[]), KvRows::Pool);
                let rows = plan_indexed(&p, &ii, &mrows, &KvRows::Pool(swa)).unwrap();
                let (ro, rl) =
                    reference::attention_rows(&p, &qf, &sink, &rows, mrows, KvRows::Pool(swa));
                let ro: Vec<f64> = ro.iter().map(|&v| bf16::from_f64(v).to_f64()).collect();
                // Under a sanitizer the split kernels are left to the split-kernel test below,
                // which runs them on these kinds and head counts too.
                for kernel in PoolsKernel::ALL {
                    if sanitized() && kernel.split() {
                        continue;
                    }
                    let bufs = (
                        dev.upload(&q).unwrap(),
                        dev.upload(&sb).unwrap(),
                        mslab.as_ref().map(|(b, _, _)| dev.upload(b).unwrap()),
                        dev.upload(&l.main_idx).unwrap(),
                        dev.upload(&l.main_len).unwrap(),
                        dev.upload(&l.swa_idx).unwrap(),
                        dev.upload(&l.swa_len).unwrap(),
                        dev.upload(&sink).unwrap(),
                    );
                    let out = dev
                        .upload(&vec![bf16::from_f32(f32::NAN); q.len()])
                        .unwrap();
                    let lse = dev.zeros::<f32>(t * h).unwrap();
                    let err = dev.zeros::<i32>(4).unwrap();
                    let launch = PoolsLaunch {
                        ordinal: 0,
                        tokens: t,
                        padded_heads: hp,
                        heads: h,
                        q: a(&dev, &bufs.0),
                        main: mslab.as_ref().map(|(_, d, _)| PoolLaunch {
                            addr: a(&dev, bufs.2.as_ref().unwrap()) + 200,
                            desc: *d,
                        }),
                        main_idx: (a(&dev, &bufs.3), km),
                        main_len: if km > 0 { a(&dev, &bufs.4) } else { 0 },
                        swa: PoolLaunch {
                            addr: a(&dev, &bufs.1) + 64,
                            desc: sd,
                        },
                        swa_idx: (a(&dev, &bufs.5), 40),
                        swa_len: a(&dev, &bufs.6),
                        sink: a(&dev, &bufs.7),
                        scale: p.scale,
                        out: a(&dev, &out),
                        lse: a(&dev, &lse),
                        err: a(&dev, &err),
                    };
                    launch_pools(&launch, dev.stream().cu_stream() as u64, kernel).unwrap();
                    dev.synchronize().unwrap();
                    let got = dev.download(&out).unwrap();
                    let mut live = Vec::with_capacity(t * h * KV_DIM);
                    for ti in 0..t {
                        let row = &got[ti * hp * KV_DIM..][..hp * KV_DIM];
                        live.extend(row[..h * KV_DIM].iter().map(|v| v.to_f32()));
                        assert!(
                            row[h * KV_DIM..].iter().all(|v| v.to_f32() == 0.0),
                            "kind {ki} hp {hp} {kernel:?}: padded heads of token {ti} not zero"
                        );
                    }
                    let (to, tl) = if kernel.tensor_core() {
                        (BF16_DOTS_VS_F64, BF16_DOTS_VS_F64)
                    } else {
                        (GPU_BF16_VS_F64, GPU_F32_VS_F64)
                    };
                    let st = compare(&live, &ro, &to);
                    assert!(st.ok(&to), "kind {ki} hp {hp} {kernel:?}: out {st:?}");
                    let st = compare(&dev.download(&lse).unwrap(), &rl, &tl);
                    assert!(st.ok(&tl), "kind {ki} hp {hp} {kernel:?}: lse {st:?}");
                    assert_eq!(
                        dev.download(&err).unwrap(),
                        vec![0; 4],
                        "kind {ki} {kernel:?}"
                    );
                }
            }
        }
    }

    /// One pool for the split-kernel test: slab bytes, the pool's offset into them, descriptor.
    #[cfg(feature = "cuda")]
    type TestPool = (Vec<u8>, usize, PoolDesc);

    /// Runs the split kernel `kernel` under `plan` over tokens `tokens` of the lists (a sub-batch:
    /// the rows of q and of the lists are sliced) and returns (out bf16 bits, lse, err).
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn run_split(
        kernel: crate::ops::attention::cuda::PoolsKernel,
        q: &[bf16],
        hp: usize,
        h: usize,
        sink: &[f32],
        main: Option<&TestPool>,
        swa: &TestPool,
        l: &Lists,
        (km, ks): (usize, usize),
        tokens: std::ops::Range<usize>,
        plan: Option<crate::ops::attention::split_plan::SplitPlan>,
    ) -> (Vec<u16>, Vec<f32>, Vec<i32>) {
        use crate::cuda::driver::DevicePtr;
        use crate::cuda::CudaDevice;
        use crate::ops::attention::cuda::{launch_pools_planned, PoolLaunch, PoolsLaunch};
        let dev = CudaDevice::shared(0).unwrap();
        let a = |b: &crate::cuda::DeviceBuffer<u8>| b.device_ptr(dev.stream()).0;
        let t = tokens.len();
        let bytes = |v: &[u8]| dev.upload(v).unwrap();
        let cast = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let row = hp * KV_DIM;
        let qb: Vec<u8> = q[tokens.start * row..tokens.end * row]
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        let sl = |v: &[i32], w: usize| cast(&v[tokens.start * w..tokens.end * w]);
        let bufs = (
            bytes(&qb),
            bytes(&swa.0),
            main.map(|m| bytes(&m.0)),
            bytes(&sl(&l.main_idx, km)),
            bytes(&sl(&l.main_len, 1)),
            bytes(&sl(&l.swa_idx, ks)),
            bytes(&sl(&l.swa_len, 1)),
            bytes(
                &sink
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
        );
        let out = bytes(&vec![0xA5u8; t * row * 2]);
        let lse = bytes(&vec![0u8; t * h * 4]);
        let err = bytes(&[0u8; 16]);
        let launch = PoolsLaunch {
            ordinal: 0,
            tokens: t,
            padded_heads: hp,
            heads: h,
            q: a(&bufs.0),
            main: main.map(|m| PoolLaunch {
                addr: a(bufs.2.as_ref().unwrap()) + m.1 as u64,
                desc: m.2,
            }),
            main_idx: (a(&bufs.3), km),
            main_len: a(&bufs.4),
            swa: PoolLaunch {
                addr: a(&bufs.1) + swa.1 as u64,
                desc: swa.2,
            },
            swa_idx: (a(&bufs.5), ks),
            swa_len: a(&bufs.6),
            sink: a(&bufs.7),
            scale: AttentionParams::default().scale,
            out: a(&out),
            lse: a(&lse),
            err: a(&err),
        };
        launch_pools_planned(&launch, dev.stream().cu_stream() as u64, kernel, plan).unwrap();
        dev.synchronize().unwrap();
        let words = |b: &crate::cuda::DeviceBuffer<u8>| dev.download(b).unwrap();
        let o = words(&out);
        let o = o
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let f =
            |v: Vec<u8>| -> Vec<[u8; 4]> { v.chunks(4).map(|c| c.try_into().unwrap()).collect() };
        let lse = f(words(&lse)).into_iter().map(f32::from_le_bytes).collect();
        let err = f(words(&err)).into_iter().map(i32::from_le_bytes).collect();
        (o, lse, err)
    }

    /// The split kernels (`attn_pools_bf16_split` and `attn_pools_bf16_split_h32`, each with
    /// `attn_pools_combine`) under every split count
    /// of a 64-key list (chunks of 16, 32, 48 and 64 keys, and the device's own plan): chunk
    /// boundaries inside the compressed list, inside the SWA list and between them, a token with
    /// no keys, tokens whose lists are shorter than one chunk, −1 holes, a slot past its pool (the
    /// error record; the key skipped), sink and lse, 64 and 128 padded heads with fewer live ones,
    /// 16-byte aligned pools (the cp.async path) and unaligned ones (plain loads), SWA-only
    /// layers: against the f64 reference. Then the merge rule: the same plan gives the same bits
    /// on a second run, and a token's bits under one plan do not depend on the batch it is in,
    /// nor on the split count for one chunk (empty chunks appended; a single chunk through the
    /// combine pass or the direct path), nor on another thread's split launches sharing the
    /// workspace.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_split_kernel_every_split_count_matches_reference_and_keeps_its_bits() {
        use crate::cuda::CudaDevice;
        use crate::ops::attention::cuda::PoolsKernel;
        use crate::ops::attention::split_plan::SplitPlan;
        use crate::tolerance::BF16_DOTS_VS_F64;
        if !CudaDevice::driver_present() {
            println!("SKIPPED: no CUDA driver");
            return;
        }
        let mut rng = Rng::new(35);
        let (t, km, ks) = (6, 40, 24);
        // (main, swa, aligned): aligned pools start at offset 0 with a page stride of whole
        // 16-byte units; the others at an odd offset with an 8-byte-misaligned stride.
        let kinds: [(Option<RecordFormat>, RecordFormat, bool); 4] = [
            (Some(RecordFormat::Nvfp4Ds), RecordFormat::Mxfp8, true),
            (Some(RecordFormat::V4Record), RecordFormat::V4Record, true),
            (Some(RecordFormat::Nvfp4Ds), RecordFormat::Mxfp8, false),
            (None, RecordFormat::Mxfp8, true),
        ];
        for (ki, (mf, sf, aligned)) in kinds.into_iter().enumerate() {
            let (hp, h) = if ki % 2 == 0 { (64, 64) } else { (128, 40) };
            let pool = |rng: &mut Rng, f: RecordFormat, blocks, states| -> TestPool {
                let off = if aligned { 0 } else { 3 };
                let (mut b, mut d, _) = slab(rng, f, PoolLayout::vllm(f), blocks, states, off);
                if aligned {
                    // slab's stride is page + 200 bytes; round it to whole 16-byte units.
                    let stride = d.block_stride.div_ceil(16) * 16;
                    let mut nb = vec![0x7Fu8; blocks * stride];
                    for blk in 0..blocks {
                        nb[blk * stride..][..d.block_stride]
                            .copy_from_slice(&b[blk * d.block_stride..][..d.block_stride]);
                    }
                    d.block_stride = stride;
                    b = nb;
                }
                (b, off, d)
            };
            let swa = pool(&mut rng, sf, 4, 16);
            let main = mf.map(|f| pool(&mut rng, f, 3, 16));
            let (nm, ns) = (main.as_ref().map_or(0, |m| m.2.slots()), swa.2.slots());
            let km = if main.is_some() { km } else { 0 };
            // (main_len, swa_len) per token: full; no keys at all; shorter than one chunk; chunk
            // boundaries inside the compressed list and inside the SWA list; a boundary exactly
            // between the lists (32 compressed keys, chunks of 16 and 32).
            let lens: [(usize, usize); 6] = [(40, 24), (0, 0), (5, 3), (17, 24), (40, 9), (32, 20)];
            let mut l = Lists {
                main_idx: vec![],
                main_len: vec![],
                swa_idx: vec![],
                swa_len: vec![],
            };
            use rand::Rng as _;
            for &(lm, ls) in lens.iter() {
                let lm = if km == 0 { 0 } else { lm };
                for c in 0..km {
                    l.main_idx.push(if c >= lm {
                        i32::MAX
                    } else if c % 7 == 3 {
                        -1
                    } else {
                        rng.random_range(0..nm) as i32
                    });
                }
                for c in 0..ks {
                    l.swa_idx.push(if c >= ls {
                        -7
                    } else {
                        rng.random_range(0..ns) as i32
                    });
                }
                l.main_len.push(lm as i32);
                l.swa_len.push(ls as i32);
            }
            // Token 4: one SWA slot past the pool — recorded, skipped (the reference sees −1).
            let bad = (4 * ks + 2, ns as i32 + 5);
            l.swa_idx[bad.0] = bad.1;
            let mut ref_swa = l.swa_idx.clone();
            ref_swa[bad.0] = -1;
            let qv = rand_normal(&mut rng, t * hp * KV_DIM, 2.0);
            let q: Vec<bf16> = qv.iter().map(|&v| bf16::from_f32(v)).collect();
            let sink = rand_normal(&mut rng, h, 1.0);
            let mut qf = vec![0f32; t * h * KV_DIM];
            for ti in 0..t {
                for j in 0..h * KV_DIM {
                    qf[ti * h * KV_DIM + j] = q[ti * hp * KV_DIM + j].to_f32();
                }
            }
            let p = AttentionParams {
                heads: h,
                ..Default::default()
            };
            let views = (
                main.as_ref()
                    .map(|m| PoolView::new(m.2, &m.0[m.1..], "main").unwrap()),
                PoolView::new(swa.2, &swa.0[swa.1..], "swa").unwrap(),
            );
            let ii = IndexedInputs {
                q: &qf,
                sink: &sink,
                main_idx: &l.main_idx,
                main_len: Some(&l.main_len),
                swa_idx: &ref_swa,
                swa_len: Some(&l.swa_len),
            };
            let mrows = views.0.map_or(KvRows::F32(&[]), KvRows::Pool);
            let rows = plan_indexed(&p, &ii, &mrows, &KvRows::Pool(views.1)).unwrap();
            let (ro, rl) =
                reference::attention_rows(&p, &qf, &sink, &rows, mrows, KvRows::Pool(views.1));
            let ro: Vec<f64> = ro.iter().map(|&v| bf16::from_f64(v).to_f64()).collect();
            // Under a sanitizer build of the host SIMT harness (scripts/simt-sanitizers.sh) one
            // split plan and the unsplit one (two of the five plans): the same code paths.
            let chunks: &[usize] = if sanitized() {
                &[16]
            } else {
                &[16, 32, 48, 64]
            };
            let plans = chunks
                .iter()
                .map(|&c| Some(SplitPlan::with_chunk(c, km + ks)))
                .chain([None]);
            let kernels = [PoolsKernel::Split, PoolsKernel::SplitH32];
            for (kernel, plan) in kernels
                .into_iter()
                .flat_map(|k| plans.clone().map(move |p| (k, p)))
            {
                // The 32-head kernel (the same body on other tiles) runs the finest split (chunks
                // of 16: boundaries at every place the list allows) and its own device plan on
                // every kind; under a sanitizer only the finest split, on the first two kinds
                // (both pool kinds, 64 and 128 padded heads).
                if kernel == PoolsKernel::SplitH32 {
                    let finest = plan.is_some_and(|p| p.chunk_keys == 16);
                    let keep = if sanitized() {
                        finest && ki < 2
                    } else {
                        finest || plan.is_none()
                    };
                    if !keep {
                        continue;
                    }
                }
                let what = format!("{kernel:?} kind {ki} hp {hp} plan {plan:?}");
                let run_with = |range, plan| {
                    run_split(
                        kernel,
                        &q,
                        hp,
                        h,
                        &sink,
                        main.as_ref(),
                        &swa,
                        &l,
                        (km, ks),
                        range,
                        plan,
                    )
                };
                let run = |range| run_with(range, plan);
                let (o, lse, err) = run(0..t);
                assert_eq!(err, vec![2, 4, 2, bad.1], "{what}: the error record");
                let mut live = Vec::with_capacity(t * h * KV_DIM);
                for ti in 0..t {
                    let r = &o[ti * hp * KV_DIM..][..hp * KV_DIM];
                    live.extend(r[..h * KV_DIM].iter().map(|&b| bf16::from_bits(b).to_f32()));
                    assert!(
                        r[h * KV_DIM..].iter().all(|&b| b == 0),
                        "{what}: padded heads of token {ti}"
                    );
                }
                let st = compare(&live, &ro, &BF16_DOTS_VS_F64);
                assert!(st.ok(&BF16_DOTS_VS_F64), "{what}: out {st:?}");
                let st = compare(&lse, &rl, &BF16_DOTS_VS_F64);
                assert!(st.ok(&BF16_DOTS_VS_F64), "{what}: lse {st:?}");
                // The empty token: zeros and −inf.
                assert!(
                    o[hp * KV_DIM..2 * hp * KV_DIM].iter().all(|&b| b == 0),
                    "{what}"
                );
                assert!(
                    lse[h..2 * h].iter().all(|&v| v == f32::NEG_INFINITY),
                    "{what}"
                );
                if plan.is_none() {
                    continue;
                }
                // Same plan, same bits: a second run, and tokens 2..4 as a batch of their own.
                let again = run(0..t);
                assert_eq!(again.0, o, "{what}: a second run changed the bits");
                assert_eq!(
                    again.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    lse.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what}"
                );
                let sub = run(2..5);
                assert_eq!(
                    sub.0[..],
                    o[2 * hp * KV_DIM..5 * hp * KV_DIM],
                    "{what}: a token's bits depend on its batch"
                );
                let lb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    lb(&sub.1),
                    lb(&lse[2 * h..5 * h]),
                    "{what}: lse of a sub-batch"
                );
                // The merge rule across split counts: the same chunk with two empty chunks
                // appended (more splits, nothing more to merge) keeps every bit, and for the
                // 64-key chunk (one chunk, the direct splits == 1 path) the combine pass over that
                // chunk and two empty ones gives the direct path's bits.
                let p = plan.expect("a pinned plan");
                let wider = SplitPlan {
                    chunk_keys: p.chunk_keys,
                    splits: p.splits + 2,
                };
                let w = run_with(0..t, Some(wider));
                assert_eq!(w.0, o, "{what}: {wider:?} changed the bits");
                assert_eq!(lb(&w.1), lb(&lse), "{what}: {wider:?} changed the lse");
                // Two host threads launching split batches on one stream at once (the workspace is
                // shared; the launch code that shares it is the same for both split kernels): each
                // gets the bits of its lone run.
                if ki == 0 && kernel == PoolsKernel::Split {
                    std::thread::scope(|sc| {
                        let a = sc.spawn(|| (0..3).map(|_| run(0..t)).collect::<Vec<_>>());
                        let b = sc.spawn(|| (0..3).map(|_| run(2..5)).collect::<Vec<_>>());
                        for r in a.join().unwrap() {
                            assert_eq!(r.0, o, "{what}: a concurrent launch changed the bits");
                        }
                        for r in b.join().unwrap() {
                            assert_eq!(r.0, sub.0, "{what}: a concurrent launch changed the bits");
                        }
                    });
                }
            }
        }
    }

    /// Mutation check: the split-kernel test, run in a child process on deliberately broken builds
    /// of the split kernel, must fail: the combine weighting every partial as if its max were the
    /// token's (w = 1), the wait for the cp.async copies removed (the harness poisons their
    /// destination until the wait), the barrier between the two S halves removed.
    #[cfg(feature = "cuda-emu")]
    #[test]
    fn cuda_broken_split_kernels_fail_the_split_test() {
        for mutant in [
            "split_combine_ignores_partial_max",
            "split_cp_async_wait_removed",
            "split_s_half_barrier_removed",
        ] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "ops::attention::pools::tests::cuda_split_kernel_every_split_count_matches_reference_and_keeps_its_bits",
                    "--test-threads",
                    "1",
                ])
                .env("CSA2_EMU_MUTANT", format!("attention:{mutant}"))
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            // A sanitizer build (scripts/simt-sanitizers.sh) may stop at its report instead.
            let caught = text.contains("1 failed") || text.contains("Sanitizer");
            assert!(
                !out.status.success() && caught,
                "the {mutant} build passed the split test:\n{text}"
            );
        }
    }

    /// The in-place entry on strided slabs of all record kinds vLLM writes: (1) its f32 core
    /// against the f64 reference; (2) bit-equal to the same attention over the compacted records
    /// (the gather-and-compact route), rounded to bf16; padded heads zero; SWA-only layers.
    #[test]
    fn in_place_matches_reference_and_compacted_route_for_all_record_kinds() {
        let mut rng = Rng::new(32);
        let kinds: [(Option<RecordFormat>, RecordFormat); 5] = [
            (Some(RecordFormat::Nvfp4Ds), RecordFormat::Mxfp8), // SM100 V4.1, and 890 B/token on SM90
            (Some(RecordFormat::Mxfp8), RecordFormat::Mxfp8),   // V4.1 MXFP8 compressed
            (Some(RecordFormat::V4Record), RecordFormat::V4Record), // SM90 default
            (None, RecordFormat::Mxfp8),                        // SWA-only, V4.1
            (None, RecordFormat::V4Record),                     // SWA-only, SM90
        ];
        for (ki, (mf, sf)) in kinds.into_iter().enumerate() {
            for (hp, h) in [(64, 64), (128, 8)] {
                let t = 5;
                let (sb, sd, _) = slab(&mut rng, sf, PoolLayout::vllm(sf), 6, 32, 64);
                let swa = PoolView::new(sd, &sb[64..], "swa").unwrap();
                let mslab = mf.map(|f| slab(&mut rng, f, PoolLayout::vllm(f), 4, 16, 200));
                let main = mslab
                    .as_ref()
                    .map(|(b, d, _)| PoolView::new(*d, &b[200..], "main").unwrap());
                let nm = main.map_or(0, |m| m.desc().slots());
                let km = if main.is_some() { 24 } else { 0 };
                let l = lists(&mut rng, t, km, nm, 40, swa.desc().slots());
                let mut q = vec![bf16::ZERO; t * hp * KV_DIM];
                let qv = rand_normal(&mut rng, t * hp * KV_DIM, 2.0);
                for (a, b) in q.iter_mut().zip(&qv) {
                    *a = bf16::from_f32(*b);
                }
                let sink = rand_normal(&mut rng, h, 1.0);
                let inp = PoolInputs {
                    q: &q,
                    padded_heads: hp,
                    heads: h,
                    sink: &sink,
                    main_idx: &l.main_idx,
                    main_len: Some(&l.main_len),
                    swa_idx: &l.swa_idx,
                    swa_len: Some(&l.swa_len),
                    scale: (KV_DIM as f32).sqrt().recip(),
                };
                let mut out = vec![bf16::from_f32(f32::NAN); q.len()];
                let mut lse = vec![f32::NAN; t * h];
                attention_pools(&inp, main, swa, &mut out, Some(&mut lse)).unwrap();

                // (1) f32 core on the pools vs the f64 reference.
                let mut qf = vec![0f32; t * h * KV_DIM];
                for ti in 0..t {
                    for j in 0..h * KV_DIM {
                        qf[ti * h * KV_DIM + j] = q[ti * hp * KV_DIM + j].to_f32();
                    }
                }
                let p = AttentionParams {
                    heads: h,
                    ..Default::default()
                };
                let ii = IndexedInputs {
                    q: &qf,
                    sink: &sink,
                    main_idx: &l.main_idx,
                    main_len: Some(&l.main_len),
                    swa_idx: &l.swa_idx,
                    swa_len: Some(&l.swa_len),
                };
                let mrows = main.map_or(KvRows::F32(&[]), KvRows::Pool);
                let mut of = vec![0f32; t * h * KV_DIM];
                let mut lf = vec![0f32; t * h];
                attention_indexed(&p, &ii, mrows, KvRows::Pool(swa), &mut of, &mut lf).unwrap();
                let rows = plan_indexed(&p, &ii, &mrows, &KvRows::Pool(swa)).unwrap();
                assert!(rows.iter().any(|r| !r.swa.is_empty()));
                assert!(main.is_none() || rows.iter().any(|r| !r.main.is_empty()));
                let (ro, rl) =
                    reference::attention_rows(&p, &qf, &sink, &rows, mrows, KvRows::Pool(swa));
                let st = compare(&of, &ro, &F32_VS_F64);
                assert!(st.ok(&F32_VS_F64), "kind {ki} hp {hp}: out {st:?}");
                let st = compare(&lf, &rl, &F32_VS_F64);
                assert!(st.ok(&F32_VS_F64), "kind {ki} hp {hp}: lse {st:?}");
                assert_eq!(lse, lf);

                // (2) the compacted-records route gives the same f32 values.
                let mrec = main.map(|m| compacted(&m));
                let srec = compacted(&swa);
                let crow = match (&mrec, mf) {
                    (Some(r), Some(f)) => KvRows::Records(f, r),
                    _ => KvRows::F32(&[]),
                };
                let mut oc = vec![0f32; t * h * KV_DIM];
                let mut lc = vec![0f32; t * h];
                attention_indexed(&p, &ii, crow, KvRows::Records(sf, &srec), &mut oc, &mut lc)
                    .unwrap();
                assert_eq!(of, oc, "kind {ki}: in place differs from compacted");
                for ti in 0..t {
                    for hi in 0..hp {
                        let o = &out[(ti * hp + hi) * KV_DIM..][..KV_DIM];
                        if hi < h {
                            let f = &of[(ti * h + hi) * KV_DIM..][..KV_DIM];
                            assert!(o.iter().zip(f).all(|(a, b)| *a == bf16::from_f32(*b)));
                        } else {
                            assert!(o.iter().all(|v| v.to_bits() == 0), "padded head {hi}");
                        }
                    }
                }
                // Token 1 lists no SWA slot; with no compressed entries either it is empty.
                if l.main_len[1] == 0 {
                    assert!(lse[h..2 * h].iter().all(|&v| v == f32::NEG_INFINITY));
                    assert!(out[hp * KV_DIM..2 * hp * KV_DIM]
                        .iter()
                        .all(|v| v.to_f32() == 0.0));
                }
            }
        }
    }

    #[test]
    fn errors_name_the_list_and_write_nothing() {
        let mut rng = Rng::new(33);
        let (sb, sd, _) = slab(
            &mut rng,
            RecordFormat::Mxfp8,
            PoolLayout::Interleaved,
            2,
            32,
            0,
        );
        let swa = PoolView::new(sd, &sb, "swa").unwrap();
        let q = vec![bf16::ONE; 2 * 64 * KV_DIM];
        let sink = vec![0f32; 64];
        let ok = PoolInputs {
            q: &q,
            padded_heads: 64,
            heads: 64,
            sink: &sink,
            main_idx: &[],
            main_len: None,
            swa_idx: &[0, 1, 2, 63],
            swa_len: Some(&[2, 2]),
            scale: 0.05,
        };
        let mut out = vec![bf16::from_f32(7.0); q.len()];
        attention_pools(&ok, None, swa, &mut out, None).unwrap();
        let cases: Vec<(PoolInputs, &str)> = vec![
            (
                PoolInputs {
                    swa_idx: &[0, 64, 2, 3],
                    ..ok
                },
                "outside the pool",
            ),
            (
                PoolInputs {
                    swa_idx: &[0, -2, 2, 3],
                    ..ok
                },
                "outside the pool",
            ),
            (
                PoolInputs {
                    main_idx: &[0, -1],
                    ..ok
                },
                "SWA-only",
            ),
            (PoolInputs { heads: 65, ..ok }, "local heads"),
            (PoolInputs { heads: 0, ..ok }, "local heads"),
            (
                PoolInputs {
                    padded_heads: 32,
                    ..ok
                },
                "64 or 128",
            ),
            (
                PoolInputs {
                    swa_len: Some(&[2]),
                    ..ok
                },
                "swa_len",
            ),
            (
                PoolInputs {
                    sink: &sink[..8],
                    ..ok
                },
                "sink",
            ),
        ];
        for (inp, needle) in cases {
            let mut o = vec![bf16::from_f32(7.0); q.len()];
            let e = attention_pools(&inp, None, swa, &mut o, None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{needle}: {e}");
            assert!(
                o.iter().all(|v| v.to_f32() == 7.0),
                "{needle}: wrote on error"
            );
        }
        // A length past the row is clamped, a −1 inside the length is skipped.
        let inp = PoolInputs {
            swa_idx: &[0, -1, 2, 3],
            swa_len: Some(&[9, 1]),
            ..ok
        };
        attention_pools(&inp, None, swa, &mut out, None).unwrap();
        // A non-finite query is an error, not a NaN output.
        let mut bad = q.clone();
        bad[5] = bf16::NAN;
        let e = attention_pools(&PoolInputs { q: &bad, ..ok }, None, swa, &mut out, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("non-finite"), "{e}");
        // An index-K pool is not a latent pool.
        let (ib, id, _) = slab(
            &mut rng,
            RecordFormat::Mxfp4Index,
            PoolLayout::BlockPlanar,
            2,
            8,
            0,
        );
        let iv = PoolView::new(id, &ib, "index").unwrap();
        let e = attention_pools(&ok, None, iv, &mut out, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("512-value"), "{e}");
    }
}
