use super::*;
use crate::formats::encode_rows;
use crate::ops::topk;
use crate::tolerance::{compare, F32_VS_F64};
use csa2_rng::{rand_normal, NewRng, Rng};

struct Case {
    q: Vec<f32>,
    w: Vec<f32>,
    k: Vec<f32>,
    k_mx: Vec<u8>,
    positions: Vec<i64>,
}

fn case(rng: &mut Rng, n: usize, positions: Vec<i64>) -> Case {
    let t = positions.len();
    let q = rand_normal(rng, t * INDEX_HEADS * INDEX_DIM, 1.0);
    let w = rand_normal(rng, t * INDEX_HEADS, (128f32 * 32.0).sqrt().recip());
    let k = rand_normal(rng, n * INDEX_DIM, 1.0);
    let mut k_mx = vec![0u8; n * MXFP4_INDEX_BYTES];
    encode_rows(RecordFormat::Mxfp4Index, &k, &mut k_mx).unwrap();
    Case {
        q,
        w,
        k,
        k_mx,
        positions,
    }
}

fn run_both(p: &IndexerParams, c: &Case, keys: IndexKeys) -> (Vec<f32>, Vec<f64>) {
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let mut out = vec![0f32; c.positions.len() * keys.len()];
    logits(p, &qs, keys, &mut out).unwrap();
    let r = reference::logits(p, &qs, keys, None);
    (out, r)
}

#[test]
fn visibility_around_every_multiple_of_the_ratio() {
    let mut rng = Rng::new(1);
    for m in [1usize, 2] {
        let n = 300;
        // p from 0 up to the last position whose visible count fits n, stepping over m·j − 1, m·j, m·j + 1.
        let positions: Vec<i64> = (0..(n * m) as i64)
            .filter(|p| p % 37 < 3 || p % 37 > 34)
            .collect();
        let c = case(&mut rng, n, positions.clone());
        let p = IndexerParams::new(m);
        let (out, r) = run_both(&p, &c, IndexKeys::F32(&c.k));
        for (ti, &pos) in positions.iter().enumerate() {
            let vis = (pos as usize + 1) / m;
            let row = &out[ti * n..(ti + 1) * n];
            assert!(
                row[..vis].iter().all(|v| v.is_finite()),
                "m {m} p {pos}: visible entries finite"
            );
            assert!(
                row[vis..].iter().all(|&v| v == f32::NEG_INFINITY),
                "m {m} p {pos}: entry {vis} hidden"
            );
        }
        let s = compare(&out, &r, &F32_VS_F64);
        assert!(s.ok(&F32_VS_F64), "m {m}: {s:?}");
    }
}

#[test]
fn mxfp4_keys_and_quantised_queries_match_the_reference() {
    let mut rng = Rng::new(2);
    // Enough queries for the prefill path (query blocks) and a single query for the decode path.
    for positions in [
        (0..40).map(|i| 100 + 97 * i).collect::<Vec<i64>>(),
        vec![4095],
    ] {
        let c = case(&mut rng, 4096, positions);
        for qq in [
            QueryQuant::None,
            QueryQuant::Mxfp4,
            QueryQuant::Fp8,
            QueryQuant::Bf16,
        ] {
            let p = IndexerParams {
                query_quant: qq,
                ..IndexerParams::new(1)
            };
            let (out, r) = run_both(&p, &c, IndexKeys::Mxfp4(&c.k_mx));
            let s = compare(&out, &r, &F32_VS_F64);
            assert!(s.ok(&F32_VS_F64), "{qq:?}: {s:?}");
        }
        // The MXFP4 keys are a loose approximation of the f32 keys.
        let p = IndexerParams::new(1);
        let (exact, _) = run_both(&p, &c, IndexKeys::F32(&c.k));
        let (quant, _) = run_both(&p, &c, IndexKeys::Mxfp4(&c.k_mx));
        let s = compare(&quant, &exact, &crate::tolerance::QUANT_VS_EXACT);
        assert!(s.cos_diff < 2e-2, "mxfp4 vs f32 keys: {s:?}");
    }
}

/// Every kernel this CPU has for `qq`, each with its tolerance against the f64 reference.
fn kernels_for(qq: QueryQuant) -> Vec<(cpu::DotKernel, crate::tolerance::Tolerance)> {
    use cpu::DotKernel as K;
    let mut v = vec![(K::F32, F32_VS_F64)];
    if qq == QueryQuant::Mxfp4 && dot::int8_supported() {
        v.push((K::Int8, crate::tolerance::INT_DOT_VS_F64));
    }
    if qq == QueryQuant::Bf16 && dot::bf16_supported() {
        v.push((K::Bf16, F32_VS_F64));
    }
    v
}

/// Keys whose rows span 2^-e .. 2^e (so the block scales and their products sweep a range), with some all-zero blocks and a few rows whose block 0 has the smallest scale, 2^-127 (E8M0
/// byte 0). (A block scale far above its row's others makes the f32 kernel's 128-long dots
/// miss the f32 tolerance by cancellation; the integer kernel's block sums are exact.)
fn wide_keys(rng: &mut Rng, n: usize, e: i32) -> Vec<u8> {
    use rand::Rng as _;
    let mut k = rand_normal(rng, n * INDEX_DIM, 1.0);
    for (r, row) in k.chunks_mut(INDEX_DIM).enumerate() {
        let mag = crate::formats::scalar::pow2(rng.random_range(-e..=e));
        row.iter_mut().for_each(|v| *v *= mag);
        if r % 7 == 3 {
            row[32..64].fill(0.0);
        }
    }
    let mut km = vec![0u8; n * MXFP4_INDEX_BYTES];
    encode_rows(RecordFormat::Mxfp4Index, &k, &mut km).unwrap();
    for rec in km.chunks_mut(MXFP4_INDEX_BYTES).step_by(53) {
        rec[64] = 0x00;
    }
    km
}

fn run_kernel(
    p: &IndexerParams,
    qs: &IndexerQueries,
    keys: IndexKeys,
    kernel: cpu::DotKernel,
) -> Vec<f32> {
    let vis = check(p, qs, &keys, qs.positions.len() * keys.len()).unwrap();
    let pr = cpu::Prepared::with_kernel(p, qs, vis, kernel).unwrap();
    assert_eq!(pr.kernel(), kernel);
    let mut out = vec![0f32; qs.positions.len() * keys.len()];
    cpu::dense(&pr, keys, &mut out);
    out
}

fn queries(rng: &mut Rng, t: usize) -> (Vec<f32>, Vec<f32>) {
    let q = rand_normal(rng, t * INDEX_HEADS * INDEX_DIM, 1.0);
    let w = rand_normal(rng, t * INDEX_HEADS, (128f32 * 32.0).sqrt().recip());
    (q, w)
}

/// The integer (VNNI) and bf16 kernels against the f64 reference, decode (one query, keys split
/// over threads) and prefill (query blocks), unit-scale rows with zero blocks and 2^-127 block
/// scales; the integer kernel is held to the exact-arithmetic tolerance. (The table's bounds are
/// relative to each logit, not to the sum of its terms: on rows far from unit scale the
/// head-weighted sum may cancel to a small logit and miss any of them, the f32 kernel's too.)
#[test]
fn narrow_dot_kernels_match_the_f64_reference() {
    let mut rng = Rng::new(11);
    let n = 3000;
    {
        let km = wide_keys(&mut rng, n, 0);
        for positions in [vec![n as i64 - 1], (0..37).map(|i| 80 * i + 5).collect()] {
            let t = positions.len();
            let (q, w) = queries(&mut rng, t);
            let qs = IndexerQueries {
                q: &q,
                w: &w,
                positions: &positions,
            };
            for qq in [QueryQuant::Mxfp4, QueryQuant::Bf16] {
                let p = IndexerParams {
                    query_quant: qq,
                    ..IndexerParams::new(1)
                };
                let r = reference::logits(&p, &qs, IndexKeys::Mxfp4(&km), None);
                for (kernel, tol) in kernels_for(qq) {
                    let out = run_kernel(&p, &qs, IndexKeys::Mxfp4(&km), kernel);
                    let s = compare(&out, &r, &tol);
                    assert!(s.ok(&tol), "{qq:?} {kernel:?} T={t}: {s:?}");
                }
            }
        }
    }
}

/// Where one block's scale is 2^20 above the row's others, the f32 kernel's running 128-term sum
/// drops the small blocks' low bits; the integer kernel sums each block exactly, so it is closer
/// to the f64 reference in both the largest error and the cosine.
#[test]
fn int8_kernel_is_more_exact_than_f32_on_skewed_block_scales() {
    if !dot::int8_supported() {
        return;
    }
    let mut rng = Rng::new(14);
    let n = 3000;
    let mut km = wide_keys(&mut rng, n, 0);
    for rec in km.chunks_mut(MXFP4_INDEX_BYTES).step_by(3) {
        rec[65] = rec[65].saturating_add(20);
    }
    let positions = vec![n as i64 - 1];
    let (q, w) = queries(&mut rng, 1);
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &positions,
    };
    let p = IndexerParams {
        query_quant: QueryQuant::Mxfp4,
        ..IndexerParams::new(1)
    };
    let r = reference::logits(&p, &qs, IndexKeys::Mxfp4(&km), None);
    let tol = crate::tolerance::INT_DOT_VS_F64;
    let f = compare(
        &run_kernel(&p, &qs, IndexKeys::Mxfp4(&km), cpu::DotKernel::F32),
        &r,
        &tol,
    );
    let i = compare(
        &run_kernel(&p, &qs, IndexKeys::Mxfp4(&km), cpu::DotKernel::Int8),
        &r,
        &tol,
    );
    assert!(
        i.max_abs < f.max_abs && i.cos_diff < f.cos_diff && i.cos_diff <= tol.cos_diff,
        "int8 {i:?} vs f32 {f:?}"
    );
}

/// A key's logit does not depend on which other keys, queries or threads share the call: the
/// integer and bf16 kernels give bit-identical rows for one query alone, in a batch of queries
/// (prefill path), and over a shuffled subset of the keys (pooled path).
#[test]
fn narrow_dot_kernels_are_batch_invariant() {
    let mut rng = Rng::new(12);
    let n = 700;
    let km = wide_keys(&mut rng, n, 10);
    let t = 33;
    let positions: Vec<i64> = (0..t as i64).map(|i| n as i64 - 1 - 5 * i).collect();
    let q = rand_normal(&mut rng, t * INDEX_HEADS * INDEX_DIM, 1.0);
    let w = rand_normal(&mut rng, t * INDEX_HEADS, 0.02);
    for (qq, kernel) in [
        (QueryQuant::Mxfp4, cpu::DotKernel::Int8),
        (QueryQuant::Bf16, cpu::DotKernel::Bf16),
    ] {
        if !kernels_for(qq).iter().any(|k| k.0 == kernel) {
            continue;
        }
        let p = IndexerParams {
            query_quant: qq,
            ..IndexerParams::new(1)
        };
        let all = IndexerQueries {
            q: &q,
            w: &w,
            positions: &positions,
        };
        let batch = run_kernel(&p, &all, IndexKeys::Mxfp4(&km), kernel);
        for ti in [0usize, 17, 32] {
            let one = IndexerQueries {
                q: &q[ti * INDEX_HEADS * INDEX_DIM..][..INDEX_HEADS * INDEX_DIM],
                w: &w[ti * INDEX_HEADS..][..INDEX_HEADS],
                positions: &positions[ti..ti + 1],
            };
            let alone = run_kernel(&p, &one, IndexKeys::Mxfp4(&km), kernel);
            let row = &batch[ti * n..][..n];
            assert!(
                alone
                    .iter()
                    .zip(row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kernel:?} token {ti}: alone vs in a batch"
            );
            // Every 3rd entry, in pooled order.
            let ids: Vec<u32> = (0..n as u32).filter(|j| j % 3 == 1).collect();
            let vis = vec![positions[ti] as usize + 1];
            let pr = cpu::Prepared::with_kernel(&p, &one, vis, kernel).unwrap();
            let mut pooled = vec![0f32; n];
            cpu::pooled(
                &pr,
                IndexKeys::Mxfp4(&km),
                std::slice::from_ref(&ids),
                &mut pooled,
            );
            for &j in &ids {
                assert_eq!(
                    pooled[j as usize].to_bits(),
                    row[j as usize].to_bits(),
                    "{kernel:?} token {ti} entry {j}: pooled vs dense"
                );
            }
        }
    }
}

#[test]
fn a_kernel_the_query_quantisation_cannot_use_is_an_error() {
    let mut rng = Rng::new(13);
    let c = case(&mut rng, 10, vec![9]);
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let p = IndexerParams::new(1);
    for k in [cpu::DotKernel::Int8, cpu::DotKernel::Bf16] {
        let e = cpu::Prepared::with_kernel(&p, &qs, vec![10], k)
            .err()
            .unwrap();
        assert!(
            matches!(
                e,
                crate::Error::Invalid { .. } | crate::Error::Unsupported(_)
            ),
            "{k:?}: {e}"
        );
    }
}

#[test]
fn pooled_scoring_masks_outside_the_blocks() {
    let mut rng = Rng::new(3);
    let n = 1000;
    let c = case(&mut rng, n, vec![999, 500, 7]);
    let p = IndexerParams::new(1);
    let cp = CandidateParams {
        block_size: 8,
        num_blocks: 4,
    };
    // Token 0: blocks 124 (newest), 3 and 0 listed out of order; token 1: none; token 2: block 0.
    let blocks = vec![124, 3, 0, -1, -1, 9, 9, 9, 0, -1, -1, -1];
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let mut out = vec![0f32; 3 * n];
    logits_in_blocks(&p, &qs, IndexKeys::Mxfp4(&c.k_mx), &blocks, &cp, &mut out).unwrap();
    let vis = [1000, 501, 8];
    let pools = pools_of(3, n, &blocks, &cp, &vis).unwrap();
    assert_eq!(pools[1].len(), 0, "a list starting with −1 is empty");
    let r = reference::logits(&p, &qs, IndexKeys::Mxfp4(&c.k_mx), Some(&pools));
    let s = compare(&out, &r, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "{s:?}");
    let finite: Vec<usize> = (0..n).filter(|&j| out[j].is_finite()).collect();
    let want: Vec<usize> = (0..8).chain(24..32).chain(992..1000).collect();
    assert_eq!(finite, want);
    assert!(out[n..2 * n].iter().all(|&v| v == f32::NEG_INFINITY));
    // A block id past the keys is an error naming it.
    let e = logits_in_blocks(
        &p,
        &qs,
        IndexKeys::F32(&c.k),
        &[200, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
        &cp,
        &mut out,
    );
    assert!(e.unwrap_err().to_string().contains("block 200"));
}

#[test]
fn integer_logits_tie_to_the_smaller_index() {
    // Keys that are copies of 3 patterns make many exactly equal logits.
    let mut rng = Rng::new(4);
    let n = 2000;
    let mut c = case(&mut rng, n, vec![1999]);
    let pats: Vec<f32> = c.k[..3 * INDEX_DIM].iter().map(|v| v.round()).collect();
    for j in 0..n {
        let src = &pats[(j % 3) * INDEX_DIM..][..INDEX_DIM];
        c.k[j * INDEX_DIM..][..INDEX_DIM].copy_from_slice(src);
    }
    for v in c.q.iter_mut() {
        *v = v.round();
    }
    for v in c.w.iter_mut() {
        *v = v.abs().max(0.25).round().max(1.0);
    }
    let p = IndexerParams::new(1);
    let (out, r) = run_both(&p, &c, IndexKeys::F32(&c.k));
    let r32: Vec<f32> = r.iter().map(|&v| v as f32).collect();
    assert_eq!(out, r32, "integer inputs are exact in f32");
    let mut sel = vec![0i32; 512];
    topk::select(&out, 2000, &mut sel);
    let refsel = topk::reference::select(&r32, 2000, 512);
    assert_eq!(sel, refsel);
    // Among equal logits the smallest indices win: every selected entry of the boundary value has a
    // smaller index than every unselected one.
    let kth = out[sel[511] as usize];
    let max_sel = sel
        .iter()
        .filter(|&&j| out[j as usize] == kth)
        .max()
        .unwrap();
    let min_unsel = (0..n as i32)
        .filter(|j| !sel.contains(j) && out[*j as usize] == kth)
        .min();
    if let Some(u) = min_unsel {
        assert!(max_sel < &u);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut rng = Rng::new(5);
    let c = case(&mut rng, 10, vec![9]);
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let mut out = vec![0f32; 10];
    assert!(logits(&IndexerParams::new(0), &qs, IndexKeys::F32(&c.k), &mut out).is_err());
    let e = logits(
        &IndexerParams::new(1),
        &IndexerQueries {
            positions: &[20],
            ..qs
        },
        IndexKeys::F32(&c.k),
        &mut out,
    );
    assert!(e.unwrap_err().to_string().contains("at least 21 entries"));
    let e = logits(
        &IndexerParams::new(1),
        &IndexerQueries {
            positions: &[-3],
            ..qs
        },
        IndexKeys::F32(&c.k),
        &mut out,
    );
    assert!(e.is_err());
    assert!(logits(
        &IndexerParams::new(1),
        &qs,
        IndexKeys::F32(&c.k[..100]),
        &mut out
    )
    .is_err());
}

/// A NaN or ±∞ query value or head weight is an error naming token and head. Before the check the
/// score's ReLU (`max(x, 0)`) turned a NaN dot into a silent 0 logit and the call returned Ok.
#[test]
fn non_finite_queries_are_errors_not_silent_zeros() {
    let mut rng = Rng::new(6);
    let c = case(&mut rng, 10, vec![8, 9]);
    let p = IndexerParams::new(1);
    let heads = p.heads;
    let mut out = vec![0f32; 20];
    let mut q = c.q.clone();
    q[(heads + 1) * INDEX_DIM + 5] = f32::NAN; // token 1, head 1
    let qs = IndexerQueries {
        q: &q,
        w: &c.w,
        positions: &c.positions,
    };
    let e = logits(&p, &qs, IndexKeys::F32(&c.k), &mut out).unwrap_err();
    assert!(
        e.to_string().contains("indexer q") && e.to_string().contains("token 1, head 1"),
        "{e}"
    );
    let mut w = c.w.clone();
    w[2] = f32::INFINITY; // token 0, head 2
    let qs = IndexerQueries {
        q: &c.q,
        w: &w,
        positions: &c.positions,
    };
    let e = logits(&p, &qs, IndexKeys::F32(&c.k), &mut out).unwrap_err();
    assert!(
        e.to_string().contains("indexer w") && e.to_string().contains("token 0, head 2"),
        "{e}"
    );
}

/// The paged reference (the CUDA kernel's contract): records scattered over pages through a
/// block table with a hole score like the contiguous keys, −∞ in the hole and outside the mask.
#[test]
fn paged_reference_reads_through_the_block_table() {
    use crate::formats::page::PageLayout;
    let mut rng = Rng::new(11);
    let (n, page_slots) = (40usize, 8usize);
    let c = case(&mut rng, n, vec![39, 20, 0]);
    // Request 0's blocks 0..5 live on pages [3, 0, -1, 4, 1] (block 2 unmapped).
    let bt = vec![3i32, 0, -1, 4, 1];
    let layout = PageLayout {
        format: RecordFormat::Mxfp4Index,
        slots: page_slots,
    };
    let mut pages = vec![0u8; 5 * layout.page_bytes()];
    let slots: Vec<i64> = (0..n as i64)
        .map(|j| {
            crate::formats::page::block_table_slot(&bt, j, page_slots).map_or(-1, |s| s as i64)
        })
        .collect();
    layout.encode_into_pages(&c.k, &slots, &mut pages).unwrap();
    let p = IndexerParams::new(1);
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let cache = IndexCache {
        pages: &pages,
        block_table: &bt,
        max_blocks: 5,
        page_slots,
    };
    cache.check().unwrap();
    let mask: Vec<u8> = (0..3 * 5).map(|i| u8::from(i != 3)).collect();
    let paged = reference::logits_paged(&p, &qs, &[0, 0, 0], &cache, Some((&mask, 5)), n);
    let flat = reference::logits(&p, &qs, IndexKeys::Mxfp4(&c.k_mx), None);
    for t in 0..3 {
        for j in 0..n {
            let (a, b) = (paged[t * n + j], flat[t * n + j]);
            if (16..24).contains(&j) || (t == 0 && (24..32).contains(&j)) {
                assert_eq!(a, f64::NEG_INFINITY, "t {t} j {j}: unmapped or masked");
            } else {
                assert_eq!(a, b, "t {t} j {j}");
            }
        }
    }
    let bad = IndexCache {
        block_table: &[5, 0, 0, 0, 0],
        ..cache
    };
    assert!(bad.check().unwrap_err().to_string().contains("outside"));
}

/// The pooled indexer reads vLLM's strided, block-planar index-K slab in place and equals the
/// paged f64 reference over the same codes (compact pages): shuffled and unmapped blocks, two
/// requests, rows before / at / past each page edge, MXFP4 and unquantised queries.
#[test]
fn pooled_indexer_reads_a_strided_slab_in_place() {
    use crate::ops::pool::{PoolDesc, PoolLayout, PoolView};
    let mut rng = Rng::new(41);
    let (spp, n_pages, max_blocks) = (16usize, 6usize, 4usize);
    let (stride, offset) = (3 * spp * MXFP4_INDEX_BYTES + 40, 28usize);
    let k = rand_normal(&mut rng, n_pages * spp * INDEX_DIM, 1.0);
    let mut rows = vec![0u8; n_pages * spp * MXFP4_INDEX_BYTES];
    encode_rows(RecordFormat::Mxfp4Index, &k, &mut rows).unwrap();
    // Compact block-planar pages (the reference's pool) and the same pages inside a slab whose
    // other bytes (other layers) are noise.
    let page = spp * MXFP4_INDEX_BYTES;
    let mut compact = vec![0u8; n_pages * page];
    let mut slab: Vec<u8> = (0..offset + n_pages * stride)
        .map(|i| (i * 131 % 251) as u8)
        .collect();
    for pg in 0..n_pages {
        for s in 0..spp {
            let rec = &rows[(pg * spp + s) * MXFP4_INDEX_BYTES..][..MXFP4_INDEX_BYTES];
            for (dst, base) in [(&mut compact, pg * page), (&mut slab, offset + pg * stride)] {
                dst[base + s * 64..][..64].copy_from_slice(&rec[..64]);
                dst[base + spp * 64 + s * 4..][..4].copy_from_slice(&rec[64..]);
            }
        }
    }
    let desc = PoolDesc {
        format: RecordFormat::Mxfp4Index,
        layout: PoolLayout::BlockPlanar,
        blocks: n_pages,
        states_per_page: spp,
        block_stride: stride,
    };
    let view = PoolView::new(desc, &slab[offset..], "keys").unwrap();
    let block_table = vec![4, 1, 5, -1, 2, 0, 3, 5];
    let positions = vec![0i64, 15, 16, 31, 32, 47, 63, 200, 5, 17, 40];
    let req = vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1];
    let t = positions.len();
    let n_cols = max_blocks * spp;
    let q = rand_normal(&mut rng, t * INDEX_HEADS * INDEX_DIM, 1.0);
    let w = rand_normal(&mut rng, t * INDEX_HEADS, (128f32 * 32.0).sqrt().recip());
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &positions,
    };
    let cache = IndexCache {
        pages: &compact,
        block_table: &block_table,
        max_blocks,
        page_slots: spp,
    };
    for (ratio, qq) in [
        (1, QueryQuant::None),
        (1, QueryQuant::Mxfp4),
        (2, QueryQuant::Mxfp4),
    ] {
        let p = IndexerParams {
            ratio,
            heads: INDEX_HEADS,
            query_quant: qq,
        };
        let mut out = vec![0f32; t * n_cols];
        logits_in_pool(
            &p,
            &qs,
            &req,
            &view,
            &block_table,
            max_blocks,
            n_cols,
            &mut out,
        )
        .unwrap();
        let r = reference::logits_paged(&p, &qs, &req, &cache, None, n_cols);
        let st = compare(&out, &r, &F32_VS_F64);
        assert!(st.ok(&F32_VS_F64), "ratio {ratio} {qq:?}: {st:?}");
        // Column 48.. of request 0 is the unmapped block: −∞ even where visible.
        assert!(out[7 * n_cols + 48..8 * n_cols]
            .iter()
            .all(|v| *v == f32::NEG_INFINITY));
        assert!(out[7 * n_cols..7 * n_cols + 48]
            .iter()
            .all(|v| v.is_finite()));
    }
    // Bad input: a block past the pool, a request past the table, a non-MXFP4 pool.
    let p = IndexerParams::new(1);
    let mut out = vec![0f32; t * n_cols];
    let bad_table = vec![4, 1, 6, -1, 2, 0, 3, 5];
    let e = logits_in_pool(
        &p, &qs, &req, &view, &bad_table, max_blocks, n_cols, &mut out,
    );
    assert!(format!("{}", e.unwrap_err()).contains("block 6"));
    let mut bad_req = req.clone();
    bad_req[3] = 2;
    let e = logits_in_pool(
        &p,
        &qs,
        &bad_req,
        &view,
        &block_table,
        max_blocks,
        n_cols,
        &mut out,
    );
    assert!(format!("{}", e.unwrap_err()).contains("request 2"));
    assert!(out.iter().all(|v| *v == 0.0), "an error writes nothing");
}

/// [`logits_in_pool_view`]: on host views it is [`logits_in_pool`] bit for bit (int32 and int64
/// positions); mixed devices, a pool that is not MXFP4 block-planar, an output over the pool and a
/// head count off `q` are refused and write nothing; CUDA views without the `cuda` feature are
/// `NoCudaBuild`.
#[test]
fn pooled_view_entry_dispatches_by_device_and_checks() {
    use crate::ops::pool::{PoolDesc, PoolLayout, PoolView};
    use crate::tensor::{DType, Device, TensorView, TensorViewMut};
    let mut rng = Rng::new(43);
    let (spp, n_pages, max_blocks) = (8usize, 4usize, 3usize);
    let (stride, offset) = (spp * MXFP4_INDEX_BYTES + 24, 9usize);
    let mut slab: Vec<u8> = (0..offset + n_pages * stride)
        .map(|i| (i * 37 % 239) as u8)
        .collect();
    let desc = PoolDesc {
        format: RecordFormat::Mxfp4Index,
        layout: PoolLayout::BlockPlanar,
        blocks: n_pages,
        states_per_page: spp,
        block_stride: stride,
    };
    for slot in 0..n_pages * spp {
        let row = rand_normal(&mut rng, INDEX_DIM, 1.0);
        let mut rec = [0u8; MXFP4_INDEX_BYTES];
        encode_rows(RecordFormat::Mxfp4Index, &row, &mut rec).unwrap();
        let (d, s) = desc.offsets(slot);
        slab[offset + d..][..64].copy_from_slice(&rec[..64]);
        slab[offset + s..][..4].copy_from_slice(&rec[64..]);
    }
    let block_table = vec![3i32, -1, 0, 2, 1, 3];
    let positions = vec![0i64, 9, 23, 5, 17];
    let pos32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let req = vec![0i32, 0, 0, 1, 1];
    let (t, h, n_cols) = (positions.len(), 4usize, max_blocks * spp);
    let q = rand_normal(&mut rng, t * h * INDEX_DIM, 1.0);
    let w = rand_normal(&mut rng, t * h, 0.1);
    let p = IndexerParams {
        ratio: 1,
        heads: h,
        query_quant: QueryQuant::Mxfp4,
    };
    let view = PoolView::new(desc, &slab[offset..], "keys").unwrap();
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &positions,
    };
    let mut want = vec![0f32; t * n_cols];
    logits_in_pool(
        &p,
        &qs,
        &req,
        &view,
        &block_table,
        max_blocks,
        n_cols,
        &mut want,
    )
    .unwrap();

    let qv = TensorView::from_host_slice(&q, &[t, h, INDEX_DIM]).unwrap();
    let wv = TensorView::from_host_slice(&w, &[t, h]).unwrap();
    let pv = TensorView::from_host_slice(&positions, &[t]).unwrap();
    let pv32 = TensorView::from_host_slice(&pos32, &[t]).unwrap();
    let rv = TensorView::from_host_slice(&req, &[t]).unwrap();
    let bv = TensorView::from_host_slice(&block_table, &[2, max_blocks]).unwrap();
    // SAFETY: the slab outlives every call below and is only read.
    let keys = unsafe { PoolPlace::new(desc, slab.as_ptr() as usize + offset, Device::Cpu) };
    let call = PoolQueries {
        q: &qv,
        w: &wv,
        positions: &pv,
        req: &rv,
        block_table: &bv,
        keys,
    };
    let mut out = vec![7f32; t * n_cols];
    let mut err = [0i32; 4];
    for positions in [&pv, &pv32] {
        let c = PoolQueries { positions, ..call };
        let mut ov = TensorViewMut::from_host_slice(&mut out, &[t, n_cols]).unwrap();
        let mut ev = TensorViewMut::from_host_slice(&mut err, &[4]).unwrap();
        logits_in_pool_view(&p, &c, &mut ov, Some(&mut ev), 0).unwrap();
        drop(ov);
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    assert_eq!(err, [0; 4], "the host path leaves the error record alone");

    let mut fresh = vec![7f32; t * n_cols];
    let mut expect_err = |c: &PoolQueries, p: &IndexerParams, needle: &str| {
        let mut ov = TensorViewMut::from_host_slice(&mut fresh, &[t, n_cols]).unwrap();
        let e = logits_in_pool_view(p, c, &mut ov, None, 0).unwrap_err();
        assert!(e.to_string().contains(needle), "{needle}: {e}");
        e
    };
    let cuda_q = crate::tensor::fake::cuda(0x1000, &[t, h, INDEX_DIM], DType::F32);
    let mixed = PoolQueries { q: &cuda_q, ..call };
    expect_err(&mixed, &p, "share a device");
    // SAFETY (the places below): never read, the checks refuse the call first.
    let wrong_fmt = PoolQueries {
        keys: unsafe {
            PoolPlace::new(
                PoolDesc {
                    format: RecordFormat::Fp8Index,
                    ..desc
                },
                keys.addr(),
                Device::Cpu,
            )
        },
        ..call
    };
    expect_err(&wrong_fmt, &p, "MXFP4");
    let interleaved = PoolQueries {
        keys: unsafe {
            PoolPlace::new(
                PoolDesc {
                    layout: PoolLayout::Interleaved,
                    ..desc
                },
                keys.addr(),
                Device::Cpu,
            )
        },
        ..call
    };
    expect_err(&interleaved, &p, "block-planar");
    let p8 = IndexerParams { heads: 8, ..p };
    expect_err(&call, &p8, "H=8");
    assert!(fresh.iter().all(|&v| v == 7.0), "an error writes nothing");
    // The output inside the pool's bytes.
    // SAFETY: the slab is this test's; the call is refused before anything is written.
    let mut over = unsafe {
        let a = slab.as_mut_ptr().add(offset);
        TensorViewMut::from_raw_parts(
            a.add(a.align_offset(4)),
            &[t, n_cols],
            &[n_cols, 1],
            DType::F32,
            Device::Cpu,
        )
    }
    .unwrap();
    let e = logits_in_pool_view(&p, &call, &mut over, None, 0).unwrap_err();
    assert!(e.to_string().contains("overlaps"), "{e}");

    #[cfg(not(feature = "cuda"))]
    {
        let dev = |shape: &[usize], dt| crate::tensor::fake::cuda(0x1000, shape, dt);
        let (dq, dw, dp, dr, db) = (
            dev(&[t, h, INDEX_DIM], DType::F32),
            dev(&[t, h], DType::F32),
            dev(&[t], DType::I64),
            dev(&[t], DType::I32),
            dev(&[2, max_blocks], DType::I32),
        );
        // Far apart: the output must not overlap the (fake) inputs.
        // SAFETY: never read: the build refuses CUDA memory first.
        let dkeys = unsafe { PoolPlace::new(desc, 0x6000_0000, Device::Cuda(0)) };
        let c = PoolQueries {
            q: &dq,
            w: &dw,
            positions: &dp,
            req: &dr,
            block_table: &db,
            keys: dkeys,
        };
        let mut ov = crate::tensor::fake::cuda_mut(0x7000_0000, &[t, n_cols], DType::F32);
        let e = logits_in_pool_view(&p, &c, &mut ov, None, 0).unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
    }
}
