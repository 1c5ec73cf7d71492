//! mHC: fused and unfused CPU paths against the f64 reference and each other (docs/SPEC.md §4).

use csa2::ops::mhc::{
    boundary, cpu, one_hot_pre, reference, BoundaryIn, BoundaryOut, Coeffs, MhcParams, MixWeights,
    Path, PostUpdate, HC, MIX,
};
use csa2::tolerance::{compare, Tolerance, F32_VS_F64};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

struct Case {
    d: usize,
    t: usize,
    x: Vec<f32>,
    y: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
    pre_prev: Vec<f32>,
    hc_fn: Vec<f32>,
    base: Vec<f32>,
    scale: Vec<f32>,
    norm: Vec<f32>,
}

fn normal(rng: &mut StdRng, n: usize, sd: f32) -> Vec<f32> {
    let dist = Normal::new(0.0f32, sd).unwrap();
    (0..n).map(|_| dist.sample(rng)).collect()
}

impl Case {
    fn new(t: usize, d: usize, seed: u64) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        Case {
            d,
            t,
            x: normal(&mut rng, t * HC * d, 1.0),
            y: normal(&mut rng, t * d, 1.0),
            post: (0..t * HC).map(|_| rng.random_range(0.0..2.0)).collect(),
            // Positive and deliberately non-symmetric.
            comb: (0..t * HC * HC)
                .map(|_| rng.random_range(0.0..1.0))
                .collect(),
            pre_prev: (0..t * HC).map(|_| rng.random_range(0.0..1.0)).collect(),
            hc_fn: normal(&mut rng, MIX * HC * d, 1.0 / ((HC * d) as f32).sqrt()),
            base: normal(&mut rng, MIX, 0.5),
            scale: (0..3).map(|_| rng.random_range(0.5..1.5)).collect(),
            norm: normal(&mut rng, d, 0.1).iter().map(|v| 1.0 + v).collect(),
        }
    }
    fn params(&self) -> MhcParams {
        MhcParams::new(self.d)
    }
    fn weights(&self) -> MixWeights<'_> {
        MixWeights {
            hc_fn: &self.hc_fn,
            base: &self.base,
            scale: &self.scale,
            packed: None,
        }
    }
    fn input(&self) -> BoundaryIn<'_> {
        BoundaryIn {
            x: &self.x,
            update: Some(PostUpdate {
                y: &self.y,
                post: &self.post,
                comb: &self.comb,
            }),
            pre_prev: &self.pre_prev,
            next: Some(self.weights()),
            norm: &self.norm,
        }
    }
}

fn check(name: &str, a: &[f32], b: &[f64], tol: &Tolerance) {
    let s = compare(a, b, tol);
    assert!(
        s.ok(tol),
        "{name}: {s:?} (actual {}, expected {})",
        a[s.worst],
        b[s.worst]
    );
}

fn check_against_reference(c: &Case, inp: &BoundaryIn, path: Path) {
    let p = c.params();
    let got = boundary(&p, inp, path).unwrap();
    let want = reference::boundary(&p, inp).unwrap();
    let tag = format!("{path:?} T={} d={}", c.t, c.d);
    check(
        &format!("{tag} x_new"),
        &got.x_new,
        &want.x_new,
        &F32_VS_F64,
    );
    check(
        &format!("{tag} layer_in"),
        &got.layer_in,
        &want.layer_in,
        &F32_VS_F64,
    );
    if inp.next.is_some() {
        let co = got.coeffs.unwrap();
        let (pre, post, comb) = want.flat_coeffs();
        check(&format!("{tag} pre"), &co.pre, &pre, &F32_VS_F64);
        check(&format!("{tag} post"), &co.post, &post, &F32_VS_F64);
        check(&format!("{tag} comb"), &co.comb, &comb, &F32_VS_F64);
    } else {
        assert!(got.coeffs.is_none());
    }
}

/// Widths around the SIMD width (8) and the kernel chunk (256); token counts around the tile (8).
const DS: [usize; 6] = [1, 8, 37, 256, 300, 520];
const TS: [usize; 6] = [1, 2, 7, 8, 9, 17];

#[test]
fn fused_and_unfused_match_f64_reference() {
    for (i, &d) in DS.iter().enumerate() {
        for (k, &t) in TS.iter().enumerate() {
            let c = Case::new(t, d, (i * 10 + k) as u64);
            check_against_reference(&c, &c.input(), Path::Fused);
            check_against_reference(&c, &c.input(), Path::Unfused);
        }
    }
}

#[test]
fn fused_matches_unfused() {
    for &(t, d) in &[(1usize, 5120usize), (9, 640), (33, 264)] {
        let c = Case::new(t, d, 99);
        let p = c.params();
        let f = boundary(&p, &c.input(), Path::Fused).unwrap();
        let u = boundary(&p, &c.input(), Path::Unfused).unwrap();
        let as64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        check("x_new", &f.x_new, &as64(&u.x_new), &F32_VS_F64);
        check("layer_in", &f.layer_in, &as64(&u.layer_in), &F32_VS_F64);
        let (fc, uc) = (f.coeffs.unwrap(), u.coeffs.unwrap());
        check("pre", &fc.pre, &as64(&uc.pre), &F32_VS_F64);
        check("post", &fc.post, &as64(&uc.post), &F32_VS_F64);
        check("comb", &fc.comb, &as64(&uc.comb), &F32_VS_F64);
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The two paths run the same kernels with the same chunk-wise sums, and the packed `hc_fn` only
/// changes where values are read from: all four combinations give the same bits, at the first
/// site (no update) too, and on widths that are not multiples of the 512-dim chunk or of 16.
#[test]
fn fused_unfused_packed_and_row_major_give_the_same_bits() {
    for &(t, d) in &[(1usize, 5120usize), (9, 640), (17, 1033), (33, 264)] {
        let c = Case::new(t, d, 7 + d as u64);
        let p = c.params();
        let pk = cpu::PackedHcFn::new(d, &c.hc_fn).unwrap();
        let first_pre = one_hot_pre(t);
        for first in [false, true] {
            let mut outs = vec![];
            for packed in [None, Some(&pk)] {
                for path in [Path::Fused, Path::Unfused] {
                    let mut inp = BoundaryIn {
                        next: Some(MixWeights {
                            packed,
                            ..c.weights()
                        }),
                        ..c.input()
                    };
                    if first {
                        inp.update = None;
                        inp.pre_prev = &first_pre;
                    }
                    let o = boundary(&p, &inp, path).unwrap();
                    let co = o.coeffs.unwrap();
                    let tag = format!(
                        "T={t} d={d} first={first} packed={} {path:?}",
                        packed.is_some()
                    );
                    outs.push((
                        tag,
                        bits(&o.x_new),
                        bits(&o.layer_in),
                        bits(&co.pre),
                        bits(&co.post),
                        bits(&co.comb),
                    ));
                }
            }
            for o in &outs[1..] {
                assert!(o.1 == outs[0].1, "x_new: {} vs {}", o.0, outs[0].0);
                assert!(o.2 == outs[0].2, "layer_in: {} vs {}", o.0, outs[0].0);
                assert!(
                    o.3 == outs[0].3 && o.4 == outs[0].4 && o.5 == outs[0].5,
                    "coeffs: {} vs {}",
                    o.0,
                    outs[0].0
                );
            }
        }
    }
}

/// A token's rows do not depend on how many tokens share the call (tile size, 4-token GEMV
/// groups and thread split all change with T): the first 5 tokens of a 33-token call equal a
/// 5-token call and 5 one-token calls, bit for bit.
#[test]
fn fused_rows_do_not_depend_on_the_batch() {
    let d = 600;
    let c = Case::new(33, d, 41);
    let p = c.params();
    let pk = cpu::PackedHcFn::new(d, &c.hc_fn).unwrap();
    let run = |t0: usize, t: usize| {
        let sub = BoundaryIn {
            x: &c.x[t0 * HC * d..(t0 + t) * HC * d],
            update: Some(PostUpdate {
                y: &c.y[t0 * d..(t0 + t) * d],
                post: &c.post[t0 * HC..(t0 + t) * HC],
                comb: &c.comb[t0 * HC * HC..(t0 + t) * HC * HC],
            }),
            pre_prev: &c.pre_prev[t0 * HC..(t0 + t) * HC],
            next: Some(MixWeights {
                packed: Some(&pk),
                ..c.weights()
            }),
            norm: &c.norm,
        };
        let o = boundary(&p, &sub, Path::Fused).unwrap();
        let co = o.coeffs.unwrap();
        (o.x_new, o.layer_in, co.pre, co.post, co.comb)
    };
    let all = run(0, 33);
    let five = run(0, 5);
    assert_eq!(bits(&five.1), bits(&all.1[..5 * d]));
    assert_eq!(bits(&five.4), bits(&all.4[..5 * HC * HC]));
    for tok in 0..5 {
        let one = run(tok, 1);
        assert_eq!(
            bits(&one.0),
            bits(&all.0[tok * HC * d..(tok + 1) * HC * d]),
            "x_new {tok}"
        );
        assert_eq!(
            bits(&one.1),
            bits(&all.1[tok * d..(tok + 1) * d]),
            "layer_in {tok}"
        );
        assert_eq!(
            bits(&one.2),
            bits(&all.2[tok * HC..(tok + 1) * HC]),
            "pre {tok}"
        );
        assert_eq!(
            bits(&one.4),
            bits(&all.4[tok * HC * HC..(tok + 1) * HC * HC]),
            "comb {tok}"
        );
    }
}

/// X'_j = Σ_i C[i, j]·X_i: with C[i][(i+1) % 4] = 1, stream i moves to stream i+1. The transposed
/// mix (Σ_i C[j, i]·X_i) would move it to i−1 instead.
#[test]
fn post_update_orientation_with_a_non_symmetric_comb() {
    let mut c = Case::new(3, 40, 7);
    c.comb.iter_mut().for_each(|v| *v = 0.0);
    for tok in 0..c.t {
        for i in 0..HC {
            c.comb[tok * HC * HC + i * HC + (i + 1) % HC] = 1.0;
        }
    }
    c.post.iter_mut().for_each(|v| *v = 0.5);
    let p = c.params();
    let d = c.d;
    for path in [Path::Fused, Path::Unfused] {
        let got = boundary(&p, &c.input(), path).unwrap();
        for tok in 0..c.t {
            for i in 0..HC {
                let j = (i + 1) % HC;
                for k in 0..d {
                    let want = 0.5 * c.y[tok * d + k] + c.x[(tok * HC + i) * d + k];
                    let have = got.x_new[(tok * HC + j) * d + k];
                    assert!((have - want).abs() <= 1e-6 * (1.0 + want.abs()), "{path:?}");
                }
            }
        }
    }
    check_against_reference(&c, &c.input(), Path::Fused);
}

/// The sublayer input is collapsed with the carried pre, not with the pre computed from X'.
#[test]
fn collapse_uses_the_carried_pre() {
    let c = Case::new(5, 64, 3);
    let p = c.params();
    let d = c.d;
    let got = boundary(&p, &c.input(), Path::Fused).unwrap();
    let new_pre = &got.coeffs.as_ref().unwrap().pre;
    for tok in 0..c.t {
        let collapse = |pre: &[f32]| -> Vec<f64> {
            let u: Vec<f64> = (0..d)
                .map(|k| {
                    (0..HC)
                        .map(|j| {
                            pre[tok * HC + j] as f64 * got.x_new[(tok * HC + j) * d + k] as f64
                        })
                        .sum()
                })
                .collect();
            let r = 1.0 / (u.iter().map(|v| v * v).sum::<f64>() / d as f64 + 1e-20).sqrt();
            u.iter()
                .zip(&c.norm)
                .map(|(v, &w)| v * r * w as f64)
                .collect()
        };
        let row = &got.layer_in[tok * d..(tok + 1) * d];
        check("carried", row, &collapse(&c.pre_prev), &F32_VS_F64);
        let s = compare(row, &collapse(new_pre), &F32_VS_F64);
        assert!(
            !s.ok(&F32_VS_F64),
            "layer_in also matches the new pre: test has no power"
        );
    }
}

/// With hc_fn = 0 the mixes vanish: pre = sigmoid(base) + eps, post = 2·sigmoid(base), and zero
/// logits give a uniform comb that Sinkhorn leaves at ≈ 1/4.
#[test]
fn zero_mix_gives_closed_form_coefficients() {
    let mut c = Case::new(2, 16, 5);
    c.hc_fn.iter_mut().for_each(|v| *v = 0.0);
    c.base.iter_mut().for_each(|v| *v = 0.0);
    c.base[1] = 2.0;
    c.base[HC + 2] = -1.0;
    let p = c.params();
    for path in [Path::Fused, Path::Unfused] {
        let co = boundary(&p, &c.input(), path).unwrap().coeffs.unwrap();
        for tok in 0..c.t {
            let pre = &co.pre[tok * HC..(tok + 1) * HC];
            let post = &co.post[tok * HC..(tok + 1) * HC];
            assert!((pre[0] - (0.5 + 1e-6)).abs() < 1e-7);
            assert!((pre[1] - (1.0 / (1.0 + (-2.0f32).exp()) + 1e-6)).abs() < 1e-7);
            assert!((post[0] - 1.0).abs() < 1e-7);
            assert!((post[2] - 2.0 / (1.0 + 1.0f32.exp())).abs() < 1e-6);
            for v in &co.comb[tok * 16..(tok + 1) * 16] {
                assert!((v - 0.25).abs() < 1e-5, "comb {v}");
            }
        }
    }
}

/// After 20 iterations every column sums to 1 (the last step), rows nearly so; all positive.
#[test]
fn comb_is_doubly_stochastic() {
    let c = Case::new(16, 24, 11);
    let co = boundary(&c.params(), &c.input(), Path::Fused)
        .unwrap()
        .coeffs
        .unwrap();
    for m in co.comb.chunks(16) {
        for j in 0..HC {
            let col: f32 = (0..HC).map(|i| m[i * HC + j]).sum();
            assert!((col - 1.0).abs() < 1e-5, "column sum {col}");
        }
        for i in 0..HC {
            let row: f32 = m[i * HC..(i + 1) * HC].iter().sum();
            assert!((row - 1.0).abs() < 1e-3, "row sum {row}");
        }
        assert!(m.iter().all(|&v| v > 0.0 && v < 1.0));
    }
    assert!(co.pre.iter().all(|&v| v > 0.0 && v <= 1.0 + 1e-6));
    assert!(co.post.iter().all(|&v| v > 0.0 && v < 2.0));
}

/// First site: no post update, one-hot pre → the input is RMSNorm(stream 0) and X' = X.
#[test]
fn first_site_collapses_stream_zero() {
    let c = Case::new(4, 48, 13);
    let p = c.params();
    let pre = one_hot_pre(c.t);
    let inp = BoundaryIn {
        update: None,
        pre_prev: &pre,
        ..c.input()
    };
    for path in [Path::Fused, Path::Unfused] {
        let got = boundary(&p, &inp, path).unwrap();
        assert_eq!(got.x_new, c.x);
        for tok in 0..c.t {
            let x0 = &c.x[tok * HC * c.d..tok * HC * c.d + c.d];
            let ms = x0.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c.d as f64;
            let want: Vec<f64> = x0
                .iter()
                .zip(&c.norm)
                .map(|(&v, &w)| v as f64 / (ms + 1e-20).sqrt() * w as f64)
                .collect();
            check(
                "first",
                &got.layer_in[tok * c.d..(tok + 1) * c.d],
                &want,
                &F32_VS_F64,
            );
        }
    }
    check_against_reference(&c, &inp, Path::Fused);
}

/// After the last site there are no new coefficients; the collapse + norm still run.
#[test]
fn final_site_has_no_coefficients() {
    let c = Case::new(3, 32, 17);
    let inp = BoundaryIn {
        next: None,
        ..c.input()
    };
    check_against_reference(&c, &inp, Path::Fused);
    check_against_reference(&c, &inp, Path::Unfused);
}

/// All-zero streams and output: zeros out, finite coefficients (the 1e-20 eps keeps rsqrt finite).
#[test]
fn zero_streams_stay_finite() {
    let mut c = Case::new(9, 40, 19);
    c.x.iter_mut().for_each(|v| *v = 0.0);
    c.y.iter_mut().for_each(|v| *v = 0.0);
    for path in [Path::Fused, Path::Unfused] {
        let got = boundary(&c.params(), &c.input(), path).unwrap();
        assert!(got.x_new.iter().all(|&v| v == 0.0));
        assert!(got.layer_in.iter().all(|&v| v == 0.0));
        let co = got.coeffs.unwrap();
        assert!(co
            .pre
            .iter()
            .chain(&co.post)
            .chain(&co.comb)
            .all(|v| v.is_finite()));
    }
}

/// Three boundaries chained (outputs carried as the next inputs) agree with the chained reference.
#[test]
fn chained_boundaries_track_the_reference() {
    let d = 72;
    let t = 10;
    let sites: Vec<Case> = (0..3).map(|s| Case::new(t, d, 100 + s)).collect();
    let p = MhcParams::new(d);
    let pre0 = one_hot_pre(t);
    let mut x = sites[0].x.clone();
    let mut carry: Option<Coeffs> = None;
    let mut x64: Vec<f32> = x.clone();
    let mut carry64: Option<Coeffs> = None;
    for s in &sites {
        let step =
            |x: &[f32], carry: &Option<Coeffs>, fast: bool| -> (Vec<f32>, Coeffs, Vec<f64>) {
                let inp = BoundaryIn {
                    x,
                    update: carry.as_ref().map(|c| PostUpdate {
                        y: &s.y,
                        post: &c.post,
                        comb: &c.comb,
                    }),
                    pre_prev: carry.as_ref().map_or(&pre0[..], |c| &c.pre[..]),
                    next: Some(s.weights()),
                    norm: &s.norm,
                };
                if fast {
                    let b = boundary(&p, &inp, Path::Fused).unwrap();
                    let li = b.layer_in.iter().map(|&v| v as f64).collect();
                    (b.x_new, b.coeffs.unwrap(), li)
                } else {
                    let r = reference::boundary(&p, &inp).unwrap();
                    let (pre, post, comb) = r.flat_coeffs();
                    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
                    let c = Coeffs {
                        pre: f(pre),
                        post: f(post),
                        comb: f(comb),
                    };
                    (r.x_new.iter().map(|&v| v as f32).collect(), c, r.layer_in)
                }
            };
        let (xf, cf, lf) = step(&x, &carry, true);
        let (xr, cr, lr) = step(&x64, &carry64, false);
        let lf32: Vec<f32> = lf.iter().map(|&v| v as f32).collect();
        let loose = Tolerance {
            abs: 1e-4,
            rel: 1e-4,
            cos_diff: 1e-8,
        };
        check("chain layer_in", &lf32, &lr, &loose);
        (x, carry, x64, carry64) = (xf, Some(cf), xr, Some(cr));
    }
}

#[test]
fn shape_errors_name_the_argument() {
    let c = Case::new(4, 16, 23);
    let p = c.params();
    let short_y = &c.y[..c.y.len() - 1];
    let inp = BoundaryIn {
        update: Some(PostUpdate {
            y: short_y,
            post: &c.post,
            comb: &c.comb,
        }),
        ..c.input()
    };
    let e = boundary(&p, &inp, Path::Fused).unwrap_err().to_string();
    assert!(
        e.contains("y") && e.contains("64") && e.contains("63"),
        "{e}"
    );
    let bad_fn = &c.hc_fn[1..];
    let inp = BoundaryIn {
        next: Some(MixWeights {
            hc_fn: bad_fn,
            ..c.weights()
        }),
        ..c.input()
    };
    let e = boundary(&p, &inp, Path::Unfused).unwrap_err().to_string();
    assert!(e.contains("hc_fn"), "{e}");
    // A packed table of another width is refused, not silently used.
    let other = cpu::PackedHcFn::new(8, &vec![0.0; MIX * HC * 8]).unwrap();
    let inp = BoundaryIn {
        next: Some(MixWeights {
            packed: Some(&other),
            ..c.weights()
        }),
        ..c.input()
    };
    let e = boundary(&p, &inp, Path::Fused).unwrap_err().to_string();
    assert!(e.contains("packed hc_fn") && e.contains("d = 8"), "{e}");
    let x_odd = &c.x[..c.x.len() - 3];
    let inp = BoundaryIn {
        x: x_odd,
        ..c.input()
    };
    assert!(boundary(&p, &inp, Path::Fused)
        .unwrap_err()
        .to_string()
        .contains("x"));
    // Missing coefficient outputs while new weights are given.
    let mut xn = vec![0.0; c.x.len()];
    let mut li = vec![0.0; c.y.len()];
    let mut out = BoundaryOut {
        x_new: &mut xn,
        layer_in: &mut li,
        coeffs: None,
    };
    let e = cpu::fused_boundary(&p, &c.input(), &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("coeffs"), "{e}");
    let bad = MhcParams {
        sinkhorn_iters: 0,
        ..p
    };
    assert!(boundary(&bad, &c.input(), Path::Fused)
        .unwrap_err()
        .to_string()
        .contains("sinkhorn_iters"));
}

/// The bf16-rounded reference (what the CUDA kernel is checked against): with no post update
/// X' = X, the collapse with a one-hot pre is stream 0, normalised and rounded to bf16; the
/// Sinkhorn comb ends on a column normalisation. Its rounding points are the only difference from
/// the f32 reference.
#[test]
fn bf16_rounded_reference_sinkhorn_identity_and_rounding_points() {
    use csa2::formats::scalar::bf16_round;
    use reference::{boundary_rounded, Rounding};
    let d = 32;
    let x: Vec<f32> = (0..4 * d)
        .map(|i| bf16_round((i as f32 * 0.37).sin()))
        .collect();
    let hc_fn: Vec<f32> = (0..MIX * HC * d)
        .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.01)
        .collect();
    let base: Vec<f32> = (0..MIX).map(|i| i as f32 * 0.05).collect();
    let p = MhcParams::new(d);
    let norm = vec![1.0f32; d];
    let inp = BoundaryIn {
        x: &x,
        update: None,
        pre_prev: &one_hot_pre(1),
        next: Some(MixWeights {
            hc_fn: &hc_fn,
            base: &base,
            scale: &[1.0, 1.0, 1.0],
            packed: None,
        }),
        norm: &norm,
    };
    let o = boundary_rounded(&p, &inp, Rounding::Bf16).unwrap();
    assert!(o.x_new.iter().zip(&x).all(|(a, &b)| *a == b as f64));
    assert!(o.layer_in.iter().all(|&v| bf16_round(v as f32) as f64 == v));
    let ms = x[..d].iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
    assert!((o.layer_in[3] - x[3] as f64 / ms.sqrt()).abs() < 1e-2 * (x[3] as f64).abs().max(1e-3));
    let (pre, post, comb) = o.flat_coeffs();
    for j in 0..HC {
        let s: f64 = (0..HC).map(|i| comb[i * HC + j]).sum();
        assert!((s - 1.0).abs() < 1e-5, "column {j} sums to {s}");
    }
    assert!(pre.iter().all(|&v| v > 0.0 && v < 1.0 + 1e-6));
    assert!(post.iter().all(|&v| v > 0.0 && v < 2.0));
    // Unrounded, the same coefficients (X' is bf16 already) and a layer input within one bf16 step.
    let f = reference::boundary(&p, &inp).unwrap();
    assert_eq!(f.flat_coeffs(), o.flat_coeffs());
    for (a, b) in f.layer_in.iter().zip(&o.layer_in) {
        assert!((a - b).abs() <= a.abs() * 2f64.powi(-8), "{a} vs {b}");
    }
}
