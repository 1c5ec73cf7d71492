//! `csa2 check`: every op, fast path against its f64 reference, on seeded random inputs whose sizes
//! hit the edges (lengths around multiples of the ratio and the 128 window, visible 512/513, the
//! 16,384-entry pool, masked rows). Prints the worst errors per case and PASS/FAIL from the
//! tolerance table; exits non-zero on any failure.

use crate::out::JsonOut;
use csa2::formats::{decode_rows, encode_rows, RecordFormat};
use csa2::ops::attention::{self, AttentionInputs, AttentionParams, KvRows, HEADS};
use csa2::ops::candidates::{self, CandidateParams};
use csa2::ops::compressor::{self, Compressor, CompressorState, PooledWeights};
use csa2::ops::indexer::{self, IndexKeys, IndexerParams, IndexerQueries, QueryQuant};
use csa2::ops::rope::{self, Direction, Rope};
use csa2::ops::topk;
use csa2::tolerance::{compare, Stats, Tolerance, BF16_ROUNDED, F32_VS_F64, QUANT_VS_EXACT};
use csa2::{Error, Geometry, Result};
use csa2_harness::rng::{rand_normal, NewRng, Rng};

#[derive(clap::Args)]
pub struct Args {
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = crate::out::count::<u64>)]
    seed: u64,
    /// Write every check as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
}

/// One check: its name, the criterion that decided it, the other figures, the verdict.
#[derive(serde::Serialize)]
struct Row {
    op: String,
    case: String,
    pass: bool,
    decided_by: String,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<Stats>,
}

struct Report {
    rows: Vec<Row>,
}

/// The criterion that decided a tolerance verdict: the failing one, or on a pass the one with the
/// least margin (element bound |a − r| ≤ abs + rel·|r|, or the 1 − cos limit).
fn decided_by(s: &Stats, tol: &Tolerance) -> String {
    // A tolerance without an element bound (infinite abs) is judged by the cosine alone.
    let bound = match (tol.abs.is_finite(), tol.rel == 0.0) {
        (false, _) => None,
        (true, true) => Some(format!("|a−r| ≤ {:e}", tol.abs)),
        (true, false) => Some(format!("|a−r| ≤ {:e} + {:e}·|r|", tol.abs, tol.rel)),
    };
    let elem = match &bound {
        Some(b) => format!(
            "worst element at {:.3} of its bound {b}",
            s.worst_bound_ratio
        ),
        None => "no element bound".into(),
    };
    let cos = format!("1−cos {:.3e} vs limit {:e}", s.cos_diff, tol.cos_diff);
    if s.special_mismatches > 0 {
        return format!("{} NaN/Inf positions differ", s.special_mismatches);
    }
    if s.violations > 0 {
        return format!("{} elements outside the bound; {elem}", s.violations);
    }
    if s.cos_diff > tol.cos_diff {
        return cos;
    }
    if bound.is_some() && s.worst_bound_ratio >= s.cos_diff / tol.cos_diff {
        elem
    } else {
        cos
    }
}

impl Report {
    fn stats(&mut self, op: &str, case: &str, s: Stats, tol: &Tolerance) {
        let ok = s.ok(tol);
        let detail = format!(
            "max_abs {:.3e}  max_rel {:.3e}  1-cos {:.3e}",
            s.max_abs, s.max_rel, s.cos_diff
        );
        self.rows.push(Row {
            op: op.into(),
            case: case.into(),
            pass: ok,
            decided_by: decided_by(&s, tol),
            detail,
            stats: Some(s),
        });
    }
    fn exact(&mut self, op: &str, case: &str, mismatches: usize, total: usize) {
        self.rows.push(Row {
            op: op.into(),
            case: case.into(),
            pass: mismatches == 0,
            decided_by: format!("exact: {mismatches} of {total} differ"),
            detail: String::new(),
            stats: None,
        });
    }
    fn codes(&mut self, op: &str, case: &str, fmt: RecordFormat, a: &[u8], b: &[u8]) {
        let n = a.len() / fmt.record_bytes();
        let (mut da, mut db) = (vec![0f32; n * fmt.dim()], vec![0f32; n * fmt.dim()]);
        decode_rows(fmt, a, &mut da).expect("whole records");
        decode_rows(fmt, b, &mut db).expect("whole records");
        let differ = da.iter().zip(&db).filter(|(x, y)| x != y).count();
        // One-code flips happen when the f32 and f64 paths straddle a rounding boundary.
        let ok = differ * 1000 <= da.len().max(1000);
        self.rows.push(Row {
            op: op.into(),
            case: case.into(),
            pass: ok,
            decided_by: format!(
                "{differ} of {} decoded values differ (≤ 0.1% allowed)",
                da.len()
            ),
            detail: String::new(),
            stats: None,
        });
    }
}

pub fn run(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json)?;
    let mut r = Report { rows: Vec::new() };
    let mut rng = Rng::new(a.seed);
    let g = Geometry::embedded();
    check_rope(&mut r, &mut rng, &g)?;
    check_compressor(&mut r, &mut rng, &g)?;
    check_indexer(&mut r, &mut rng)?;
    check_candidates(&mut r, &mut rng)?;
    check_attention(&mut r, &mut rng)?;
    let mut failed = 0;
    for row in &r.rows {
        let name = format!("{:<11} {}", row.op, row.case);
        say!(
            "{} {name:<44} {}{}{}",
            if row.pass { "PASS" } else { "FAIL" },
            row.decided_by,
            if row.detail.is_empty() { "" } else { "  |  " },
            row.detail
        );
        failed += usize::from(!row.pass);
    }
    say!(
        "{} of {} checks passed (isa {:?}); each line names the criterion that decided it first",
        r.rows.len() - failed,
        r.rows.len(),
        csa2_isa()
    );
    crate::out::write_json(
        &a.json,
        &serde_json::json!({
            "seed": a.seed,
            "isa": csa2_isa(),
            "passed": r.rows.len() - failed,
            "total": r.rows.len(),
            "checks": r.rows,
        }),
    )?;
    if failed > 0 {
        return Err(Error::Internal(format!("{failed} op checks failed")));
    }
    Ok(())
}

fn csa2_isa() -> String {
    csa2::isa::describe()
}

fn check_rope(r: &mut Report, rng: &mut Rng, g: &Geometry) -> Result<()> {
    let positions = [0i64, 1, 127, 128, 65_535, 65_536, 1_048_575];
    for layer in [0usize, 2] {
        let rp = Rope::for_layer(&g.layers[layer]);
        let x = rand_normal(rng, positions.len() * 4 * 512, 1.0);
        for dir in [Direction::Forward, Direction::Inverse] {
            let mut y = x.clone();
            rp.apply(&mut y, 4, 512, &positions, dir)?;
            let refv = rope::reference::rope(&rp, &x, 4, 512, &positions, dir);
            r.stats(
                "rope",
                &format!("layer {layer} {dir:?}"),
                compare(&y, &refv, &F32_VS_F64),
                &F32_VS_F64,
            );
        }
    }
    Ok(())
}

fn check_compressor(r: &mut Report, rng: &mut Rng, g: &Geometry) -> Result<()> {
    let norm: Vec<f32> = rand_normal(rng, 512, 0.2).iter().map(|v| 1.0 + v).collect();
    let wk = rand_normal(rng, 128 * 512, 512f32.sqrt().recip());
    let k_norm: Vec<f32> = rand_normal(rng, 128, 0.2).iter().map(|v| 1.0 + v).collect();
    let w = PooledWeights {
        norm: &norm,
        wk: &wk,
        k_norm: &k_norm,
    };
    for (m, t, start) in [(2usize, 37usize, 128usize), (2, 256, 0), (1, 129, 65_472)] {
        let rp = Rope::for_layer(&g.layers[if m == 2 { 2 } else { 20 }]);
        let kv = rand_normal(rng, t * 512, 1.0);
        let score = rand_normal(rng, t * 512, 2.0);
        let sc = (m == 2).then_some(&score[..]);
        let c = Compressor::new(m, 1e-20, rp.clone(), w)?;
        // Split at an odd token so a pair crosses two calls.
        let mut st = CompressorState::new(start as u64);
        let cut = 5.min(t);
        let a = c.compress(&mut st, &kv[..cut * 512], sc.map(|s| &s[..cut * 512]))?;
        let b = c.compress(&mut st, &kv[cut * 512..], sc.map(|s| &s[cut * 512..]))?;
        let cat =
            |f: fn(&compressor::Compressed) -> &Vec<f32>| [f(&a).clone(), f(&b).clone()].concat();
        let catb =
            |f: fn(&compressor::Compressed) -> &Vec<u8>| [f(&a).clone(), f(&b).clone()].concat();
        let refc = compressor::reference::compress(m, 1e-20, &rp, &w, &kv, sc, start);
        let case = format!("m={m} T={t} start={start}");
        r.stats(
            "compress",
            &format!("{case} latent"),
            compare(&cat(|c| &c.latent), &refc.latent, &BF16_ROUNDED),
            &BF16_ROUNDED,
        );
        // Downstream of the latent: the reference continued from our latent, so that a bf16 step
        // that rounded the other way is not counted twice.
        let (mut rm, mut ri) = (Vec::new(), Vec::new());
        for (gi, lat) in cat(|c| &c.latent).chunks_exact(512).enumerate() {
            let (x, y) =
                compressor::reference::from_latent(1e-20, &rp, &w, lat, (start / m + gi) * m);
            rm.extend(x);
            ri.extend(y);
        }
        r.stats(
            "compress",
            &format!("{case} main_kv"),
            compare(&cat(|c| &c.main_kv), &rm, &F32_VS_F64),
            &F32_VS_F64,
        );
        r.stats(
            "compress",
            &format!("{case} index_k"),
            compare(&cat(|c| &c.index_k), &ri, &F32_VS_F64),
            &F32_VS_F64,
        );
        r.codes(
            "compress",
            &format!("{case} main_kv_nvfp4"),
            RecordFormat::Nvfp4Ds,
            &catb(|c| &c.main_kv_nvfp4),
            &refc.f32.main_kv_nvfp4,
        );
        r.codes(
            "compress",
            &format!("{case} index_k_mxfp4"),
            RecordFormat::Mxfp4Index,
            &catb(|c| &c.index_k_mxfp4),
            &refc.f32.index_k_mxfp4,
        );
    }
    Ok(())
}

fn index_case(rng: &mut Rng, n: usize, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<u8>) {
    let q = rand_normal(rng, t * 32 * 128, 1.0);
    let w = rand_normal(rng, t * 32, (128f32 * 32.0).sqrt().recip());
    let k = rand_normal(rng, n * 128, 1.0);
    let mut km = vec![0u8; n * 68];
    encode_rows(RecordFormat::Mxfp4Index, &k, &mut km).expect("whole rows");
    (q, w, k, km)
}

fn check_indexer(r: &mut Report, rng: &mut Rng) -> Result<()> {
    // Positions around multiples of m, visible 512 / 513, a decode query at the end.
    for m in [1usize, 2] {
        let n = 1100;
        let positions: Vec<i64> = [
            0i64,
            1,
            2,
            3,
            511,
            1023,
            1024,
            1025,
            1026,
            1027,
            1099,
            (n * m) as i64 - 1,
        ]
        .into_iter()
        .filter(|&p| (p as usize + 1) / m <= n)
        .collect();
        let (q, w, k, km) = index_case(rng, n, positions.len());
        let qs = IndexerQueries {
            q: &q,
            w: &w,
            positions: &positions,
        };
        for (kname, keys) in [
            ("f32", IndexKeys::F32(&k)),
            ("mxfp4", IndexKeys::Mxfp4(&km)),
        ] {
            for qq in [
                QueryQuant::None,
                QueryQuant::Mxfp4,
                QueryQuant::Fp8,
                QueryQuant::Bf16,
            ] {
                let p = IndexerParams {
                    query_quant: qq,
                    ..IndexerParams::new(m)
                };
                let mut out = vec![0f32; positions.len() * n];
                indexer::logits(&p, &qs, keys, &mut out)?;
                let refl = indexer::reference::logits(&p, &qs, keys, None);
                let case = format!("m={m} keys={kname} q={qq:?}");
                r.stats(
                    "indexer",
                    &case,
                    compare(&out, &refl, &F32_VS_F64),
                    &F32_VS_F64,
                );
                let vis: Vec<usize> = positions.iter().map(|&x| indexer::visible(x, m)).collect();
                let mut sel = vec![0i32; positions.len() * 512];
                topk::select_rows(&out, n, &vis, &mut sel)?;
                let mut bad = 0;
                for (i, row) in sel.chunks(512).enumerate() {
                    let want = topk::reference::select(&out[i * n..(i + 1) * n], vis[i], 512);
                    bad += row.iter().zip(&want).filter(|(a, b)| a != b).count();
                }
                r.exact("topk", &format!("{case} (same logits)"), bad, sel.len());
            }
        }
    }
    // Large decode row: threshold path of the top-k.
    let row = rand_normal(rng, 1 << 20, 1.0);
    let mut sel = vec![0i32; 512];
    topk::select(&row, row.len(), &mut sel);
    let want = topk::reference::select(&row, row.len(), 512);
    r.exact(
        "topk",
        "1M logits, top-512",
        sel.iter().zip(&want).filter(|(a, b)| a != b).count(),
        512,
    );
    Ok(())
}

fn check_candidates(r: &mut Report, rng: &mut Rng) -> Result<()> {
    let cp = CandidateParams::default();
    let n = 16_400;
    let row: Vec<f32> = (0..n)
        .map(|_| (rand_normal(rng, 1, 1.0)[0] * 4.0).round())
        .collect();
    let mut masked = row.clone();
    for v in masked[800..1600].iter_mut() {
        *v = f32::NEG_INFINITY;
    }
    for (name, rw) in [("ties", &row), ("-inf blocks", &masked)] {
        for vis in [16_383usize, 16_384, 16_385, 16_400] {
            let mut out = vec![0i32; cp.num_blocks];
            candidates::select_blocks(&cp, rw, vis, &mut out);
            let want = candidates::reference::select_blocks(&cp, rw, vis);
            r.exact(
                "candidates",
                &format!("{name} visible {vis}"),
                out.iter().zip(&want).filter(|(a, b)| a != b).count(),
                out.len(),
            );
        }
    }
    // Reindex: pooled scoring vs the reference at 16,385 visible entries.
    let n = 16_385;
    let (q, w, _, km) = index_case(rng, n, 1);
    let positions = [n as i64 - 1];
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &positions,
    };
    let p = IndexerParams::new(1);
    let mut full = vec![0f32; n];
    indexer::logits(&p, &qs, IndexKeys::Mxfp4(&km), &mut full)?;
    let mut blocks = vec![0i32; cp.num_blocks];
    candidates::select_blocks(&cp, &full, n, &mut blocks);
    let mut pooled = vec![0f32; n];
    indexer::logits_in_blocks(&p, &qs, IndexKeys::Mxfp4(&km), &blocks, &cp, &mut pooled)?;
    let pools = indexer::pools_of(1, n, &blocks, &cp, &[n])?;
    let refl = indexer::reference::logits(&p, &qs, IndexKeys::Mxfp4(&km), Some(&pools));
    r.stats(
        "reindex",
        "pooled logits, 16,385 visible",
        compare(&pooled, &refl, &F32_VS_F64),
        &F32_VS_F64,
    );
    Ok(())
}

fn check_attention(r: &mut Report, rng: &mut Rng) -> Result<()> {
    let (n, s) = (600, 300);
    let positions: Vec<i64> = vec![0, 1, 126, 127, 128, 129, 255, 299];
    let t = positions.len();
    let q = rand_normal(rng, t * HEADS * 512, 1.0);
    let main = rand_normal(rng, n * 512, 1.0);
    let swa = rand_normal(rng, s * 512, 1.0);
    let sink = rand_normal(rng, HEADS, 1.0);
    let mut mq = vec![0u8; n * 288];
    encode_rows(RecordFormat::Nvfp4Ds, &main, &mut mq).expect("whole rows");
    let mut sq = vec![0u8; s * 528];
    encode_rows(RecordFormat::Mxfp8, &swa, &mut sq).expect("whole rows");
    // Top-k rows: the first 16 slots −1 on token 1, all −1 on token 0, 513 candidates cut to 512.
    let mut topk = vec![-1i32; t * 512];
    for (i, row) in topk.chunks_mut(512).enumerate().skip(1) {
        for (c, v) in row.iter_mut().enumerate().skip(if i == 1 { 16 } else { 0 }) {
            *v = ((c * 7 + i) % n) as i32;
        }
    }
    for (label, rs) in [
        ("replay_start 0", vec![0i64]),
        ("replay_start 100", vec![100i64]),
    ] {
        let inp = AttentionInputs {
            q: &q,
            topk: &topk,
            topk_len: None,
            positions: &positions,
            replay_start: &rs,
            sink: &sink,
        };
        let p = AttentionParams::default();
        for (kname, mk, sk) in [
            ("f32", KvRows::F32(&main), KvRows::F32(&swa)),
            (
                "nvfp4+mxfp8",
                KvRows::Records(RecordFormat::Nvfp4Ds, &mq),
                KvRows::Records(RecordFormat::Mxfp8, &sq),
            ),
        ] {
            let mut out = vec![0f32; t * HEADS * 512];
            let mut lse = vec![0f32; t * HEADS];
            attention::attention(&p, &inp, mk, sk, &mut out, &mut lse)?;
            let rows = attention::plan(&p, &inp, &mk, &sk)?;
            let (ro, rl) = attention::reference::attention(&p, &inp, &rows, mk, sk);
            r.stats(
                "attention",
                &format!("{label} {kname} out"),
                compare(&out, &ro, &F32_VS_F64),
                &F32_VS_F64,
            );
            r.stats(
                "attention",
                &format!("{label} {kname} lse"),
                compare(&lse, &rl, &F32_VS_F64),
                &F32_VS_F64,
            );
            if kname != "f32" {
                let (eo, _) = attention::reference::attention(
                    &p,
                    &inp,
                    &rows,
                    KvRows::F32(&main),
                    KvRows::F32(&swa),
                );
                let st = compare(&out, &eo, &QUANT_VS_EXACT);
                let loose = Tolerance {
                    abs: f64::INFINITY,
                    rel: 0.0,
                    ..QUANT_VS_EXACT
                };
                r.stats(
                    "attention",
                    &format!("{label} {kname} vs unquantised (cosine)"),
                    st,
                    &loose,
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod decided_by_tests {
    use super::*;

    /// A cosine-only tolerance (no element bound) printed `|a−r| ≤ inf + 0e0·|r|`.
    #[test]
    fn a_cosine_only_tolerance_names_no_element_bound() {
        let tol = Tolerance {
            abs: f64::INFINITY,
            rel: 0.0,
            cos_diff: 2e-2,
        };
        let s = Stats {
            cos_diff: 0.0,
            ..Stats::default()
        };
        let line = decided_by(&s, &tol);
        assert!(!line.contains("inf"), "{line}");
        assert!(line.starts_with("1−cos"), "{line}");
        let elem = Tolerance {
            abs: 1e-5,
            rel: 0.0,
            cos_diff: 1e-6,
        };
        let s = Stats {
            worst_bound_ratio: 0.5,
            ..Stats::default()
        };
        assert!(
            decided_by(&s, &elem).ends_with("|a−r| ≤ 1e-5"),
            "{}",
            decided_by(&s, &elem)
        );
    }
}
