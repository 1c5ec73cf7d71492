//! The exact replay staircase and the replay error analyzer on tiny synthetic weights (the
//! release's 40-layer role plan): exact replay reproduces a cold run, a run compared with itself
//! shows zero error, bounded replay differs exactly on the layers and rows docs/SPEC.md §3 says, every
//! layer runs the rows `replay::plan` says, and the report survives JSON.

use csa2::backend::{Backend, BackendConfig, Model};
use csa2::replay::{plan, ReplayConfig};
use csa2::weights::Scale;
use csa2_harness::replay_error::{
    analyze, settles_at, Report, SessionSpec, SnapshotPolicy, StepError, TurnStats, Variant, FLOOR,
};
use std::sync::{Arc, OnceLock};

fn backend() -> Backend {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    let m = M
        .get_or_init(|| Arc::new(Model::synthetic(Scale::Tiny, 5, false).unwrap()))
        .clone();
    Backend::new(m, BackendConfig::CSA2).unwrap()
}

/// Two turns: turn 1 finds a prefix hit of exactly `hit` tokens (turn 0's prompt + its `c` decode
/// tokens) and appends `new` tokens.
fn spec(hit: usize, new: usize, snapshot: SnapshotPolicy, c: usize) -> SessionSpec {
    SessionSpec {
        turns: 2,
        first_prompt: hit - c,
        new_tokens: new,
        continuation: c,
        chunk: 128,
        snapshot,
        seed: 3,
    }
}

fn run(s: &SessionSpec, reference: Variant, cmp: &[Variant]) -> Report {
    analyze(&backend(), s, reference, cmp, &mut |_| {}).unwrap()
}

fn worst(t: &TurnStats) -> f64 {
    t.layers
        .iter()
        .map(|l| l.streams.max_rel().max(l.input.max_rel()))
        .fold(t.output.max_rel(), f64::max)
}

/// Worst error on the rows a replay must get right: new prompt rows, decode rows, the output (the
/// rows the staircase recomputes below `H` have truncated windows by design).
fn worst_kept(t: &TurnStats) -> f64 {
    let c = |a: &csa2_harness::replay_error::Classes| a.prompt.max_rel.max(a.decode.max_rel);
    t.layers
        .iter()
        .map(|l| c(&l.streams).max(c(&l.input)))
        .fold(c(&t.output), f64::max)
}

/// Every layer ran exactly the rows the planner gives it (replayed + prompt rows).
fn assert_rows_follow_the_plan(t: &TurnStats, v: Variant) {
    let g = backend().geometry().clone();
    let p = plan(
        &ReplayConfig::from_geometry(&g, v.mode()),
        t.prompt_tokens,
        if v == Variant::Cold { 0 } else { t.hit },
        t.snapshot_hit,
    )
    .unwrap();
    for (l, ls) in t.layers.iter().enumerate() {
        let ran = ls.streams.replayed.rows + ls.streams.prompt.rows;
        assert_eq!(ran, p.layers[l].rows.len(), "{v:?} layer {l}");
        assert_eq!(ls.input.prompt.rows, ls.streams.prompt.rows);
    }
}

#[test]
fn exact_replay_matches_a_cold_run_at_hits_around_the_window() {
    // H = 128: the hit is too short to use (cold in every run); 129: one token past the window;
    // 256: two windows. The exact staircase starts at 0 on every layer below H / 128 steps.
    for hit in [128usize, 129, 256] {
        let s = spec(hit, 40, SnapshotPolicy::Miss, 2);
        let r = run(&s, Variant::Cold, &[Variant::Exact, Variant::Bounded]);
        let (exact, bounded) = (&r.variants[0].turns[1], &r.variants[1].turns[1]);
        assert_eq!(exact.prompt_tokens, hit + 40);
        assert_eq!(exact.hit, if hit > 128 { hit } else { 0 }, "H = {hit}");
        assert_eq!(bounded.replayed_tokens, if hit > 128 { 128 } else { 0 });
        let e = worst_kept(exact);
        println!(
            "H = {hit}: exact vs cold worst row error {e:.3e} (with the staircase rows below H: {:.3e}), bounded {:.3e}",
            worst(exact),
            worst(bounded)
        );
        // Bit-identical: the staircase gives every kept row the window a cold run gives it, and
        // the cached global entries are the ones a cold run writes.
        assert_eq!(
            e, 0.0,
            "H = {hit}: exact replay differs from cold by {e:.3e}"
        );
        for st in &exact.persistence {
            assert!(
                st.rel <= FLOOR,
                "H = {hit} decode step {}: {}",
                st.step,
                st.rel
            );
        }
        // Bounded replay is not exact: decoder replay trims the 168-row prompt, and from H = 129
        // the encoder replay truncates windows.
        assert!(
            worst(bounded) > FLOOR,
            "H = {hit}: bounded {}",
            worst(bounded)
        );
        assert_rows_follow_the_plan(exact, Variant::Exact);
    }
}

#[test]
fn a_run_compared_with_itself_has_zero_error() {
    let s = spec(150, 60, SnapshotPolicy::Alternate, 2);
    for v in [Variant::Bounded, Variant::Exact] {
        let r = run(&s, v, &[v]);
        for t in &r.variants[0].turns {
            assert_eq!(worst(t), 0.0, "{v:?} turn {}", t.turn);
            assert!(t.persistence.iter().all(|p| p.rel == 0.0 && p.cos == 1.0));
            assert_eq!(t.settles_at, Some(0));
            assert!(t.layers[39].streams.prompt.rows > 0);
        }
    }
}

#[test]
fn bounded_replay_differs_exactly_where_the_spec_says() {
    // Miss: encoder replay of [H − 128, H) with windows floored at H − 128.
    let hit = 256;
    let s = spec(hit, 150, SnapshotPolicy::Miss, 2);
    let r = run(
        &s,
        Variant::Exact,
        &[Variant::EncoderOnly, Variant::Bounded],
    );
    for vr in &r.variants {
        let t = &vr.turns[1];
        assert_rows_follow_the_plan(t, vr.variant);
        assert_eq!(t.replayed_tokens, 128);
        // Layer 0's input is the embedding: identical.
        assert_eq!(t.layers[0].input.max_rel(), 0.0);
        // After layer 0 (SWA only): a replayed row p < H − 1 lost positions of its window, a row
        // p ≥ H − 1 sees exactly [p − 127, p].
        let l0 = &t.layers[0].streams;
        assert!(l0.replayed.max_rel > FLOOR, "{:?}: {l0:?}", vr.variant);
        assert!(l0.prompt.max_rel <= FLOOR, "{:?}: {l0:?}", vr.variant);
        // The error reaches the output of the new prompt rows.
        assert!(t.output.prompt.max_rel > FLOOR, "{:?}", vr.variant);
    }
    // Decoder bounded replay runs the last 128 prompt rows from layer 20 on; without it the
    // decoder runs replayed + new rows.
    let (enc, bnd) = (&r.variants[0].turns[1], &r.variants[1].turns[1]);
    assert_eq!(bnd.layers[30].streams.prompt.rows, 128);
    assert_eq!(bnd.layers[30].streams.replayed.rows, 0);
    assert_eq!(enc.layers[30].streams.prompt.rows, 150);
    assert_eq!(enc.layers[30].streams.replayed.rows, 128);
    assert!(bnd.token_layers < enc.token_layers && enc.token_layers < bnd.token_layers_exact);

    // Hit: the encoder windows come from the snapshot, so every encoder layer matches exact
    // replay; decoder windows are never persisted, so decoder layers differ with or without
    // decoder bounded replay.
    let s = spec(hit, 150, SnapshotPolicy::Hit, 2);
    let r = run(
        &s,
        Variant::Exact,
        &[Variant::EncoderOnly, Variant::Bounded],
    );
    for vr in &r.variants {
        let t = &vr.turns[1];
        assert!(t.snapshot_hit);
        assert_eq!(t.replayed_tokens, 0);
        assert_rows_follow_the_plan(t, vr.variant);
        for l in 0..20 {
            let e = t.layers[l].streams.max_rel();
            assert!(e <= FLOOR, "{:?} encoder layer {l}: {e:.3e}", vr.variant);
        }
        let enc = (0..20)
            .map(|l| t.layers[l].streams.max_rel())
            .fold(0.0, f64::max);
        let dec = (20..40)
            .map(|l| t.layers[l].streams.max_rel())
            .fold(0.0, f64::max);
        println!(
            "hit, {:?}: encoder {enc:.3e}, decoder {dec:.3e}, output {:.3e}",
            vr.variant, t.output.prompt.max_rel
        );
        // Decoder windows restart at H (and, with decoder replay, at the first kept row).
        assert!(dec > FLOOR, "{:?}: decoder {dec:.3e}", vr.variant);
        assert!(t.output.prompt.max_rel > FLOOR, "{:?}", vr.variant);
    }
}

#[test]
fn the_report_round_trips_through_json() {
    let s = spec(140, 20, SnapshotPolicy::Miss, 2);
    let r = run(&s, Variant::Exact, &[Variant::Bounded]);
    let text = serde_json::to_string(&r).unwrap();
    let back: Report = serde_json::from_str(&text).unwrap();
    assert_eq!(back.spec, r.spec);
    assert_eq!(back.variants.len(), 1);
    // Floats: equal up to the last bit the JSON text carries.
    let (a, b) = (
        serde_json::to_value(&r).unwrap(),
        serde_json::to_value(&back).unwrap(),
    );
    assert!(close(&a, &b), "round trip changed the report");
    assert_eq!(back.variants[0].turns[1].layers.len(), 40);
}

fn close(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    match (a, b) {
        (Number(x), Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            (x - y).abs() <= 1e-15 * x.abs().max(y.abs())
        }
        (Array(x), Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| close(p, q)),
        (Object(x), Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| close(v, w)))
        }
        _ => a == b,
    }
}

#[test]
fn settling_needs_every_later_step_below_the_floor() {
    let st = |v: &[f64]| -> Vec<StepError> {
        v.iter()
            .enumerate()
            .map(|(i, &rel)| StepError {
                step: i,
                rel,
                cos: 1.0,
                max_layer_rel: rel,
            })
            .collect()
    };
    assert_eq!(
        settles_at(&st(&[1.0, 1e-9, 1.0, 1e-9, 1e-9]), 1e-3),
        Some(3)
    );
    assert_eq!(settles_at(&st(&[1.0, 1e-9, 1.0]), 1e-3), None);
    assert_eq!(settles_at(&st(&[]), 1e-3), None);
}

#[test]
fn bad_sessions_are_typed_errors() {
    let mut s = spec(140, 30, SnapshotPolicy::Miss, 2);
    s.turns = 0;
    let e = analyze(
        &backend(),
        &s,
        Variant::Exact,
        &[Variant::Bounded],
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("turns"), "{e}");
    assert!(Variant::from_name("nope").is_err());
    assert!(SnapshotPolicy::from_name("sometimes").is_err());
}
