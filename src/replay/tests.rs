use super::*;

fn cfg(mode: ReplayMode) -> ReplayConfig {
    ReplayConfig::from_geometry(&Geometry::embedded(), mode)
}

/// Independent statement of docs/SPEC.md §3 for one row: the window start in bounded mode.
#[allow(clippy::implicit_saturating_sub)] // spelled out as docs/SPEC.md §3 states it
fn bounded_window(p: usize, h: usize) -> usize {
    // Hits of ≤ 128 tokens are not used, so their floor is 0.
    let floor = if h > 128 { h - 128 } else { 0 };
    p.saturating_sub(127).max(floor)
}

#[test]
fn hit_of_128_is_not_used_but_129_is() {
    let c = cfg(ReplayMode::Bounded);
    let p = plan(&c, 1000, 128, false).unwrap();
    assert_eq!(p.hit_used, 0);
    assert_eq!(p.layers[0].rows, 0..1000);
    assert_eq!(p.kv_write, 0..1000);
    assert!(p.protected.is_empty());
    assert_eq!(p.replayed_tokens(), 0);

    let p = plan(&c, 1000, 129, false).unwrap();
    assert_eq!(p.hit_used, 129);
    assert_eq!(
        p.layers[0].rows,
        1..1000,
        "replay [H − 128, H) plus the suffix"
    );
    assert_eq!(p.replayed_tokens(), 128);
    assert_eq!(p.kv_write, 129..1000);
    assert_eq!(p.protected, 1..129);
    // Ratio-2 sources: entries [0, 64) are cached; the replay from token 1 must not rewrite them.
    assert_eq!(p.protected_entries[0], (2, 0..64));
    assert_eq!(p.protected_entries[3], (20, 1..129));
    // H = 129 is odd, but the replay recomputes token 128, so no saved pair state is needed.
    assert!(!p.needs_compressor_state);
    for q in [1, 50, 129, 200, 999] {
        assert_eq!(p.window_start(5, q), bounded_window(q, 129), "p = {q}");
    }
}

#[test]
fn hit_at_a_page_multiple_with_and_without_snapshot() {
    let c = cfg(ReplayMode::Bounded);
    let (i, h) = (5000, 4096);
    let miss = plan(&c, i, h, false).unwrap();
    assert!(!miss.snapshot_used);
    for k in 0..20 {
        assert_eq!(miss.layers[k].rows, h - 128..i);
        assert_eq!(miss.layers[k].window_floor, h - 128);
    }
    // Decoder: the last 128 rows, window starting at the first kept row.
    for k in 20..40 {
        assert_eq!(miss.layers[k].rows, i - 128..i);
        assert_eq!(miss.window_start(k, i - 1), i - 128);
        assert_eq!(miss.window_start(k, i - 100), i - 128);
    }
    assert_eq!(miss.protected, h - 128..h);
    assert_eq!(miss.protected_entries[1], (8, (h - 128) / 2..h / 2));
    assert_eq!(miss.token_layers(0..20), 20 * (i - h + 128));
    assert_eq!(miss.token_layers(20..40), 20 * 128);

    let hit = plan(&c, i, h, true).unwrap();
    assert!(hit.snapshot_used);
    assert_eq!(hit.replayed_tokens(), 0);
    assert_eq!(hit.layers[0].rows, h..i);
    assert_eq!(
        hit.window_start(0, h),
        h - 127,
        "the window reaches into the snapshot"
    );
    assert!(hit.protected.is_empty());
    assert!(
        !hit.needs_compressor_state,
        "4096 is a whole number of pairs"
    );
    assert_eq!(hit.layers[39].rows, i - 128..i);
}

#[test]
fn short_suffix_keeps_every_new_row_in_the_decoder() {
    // Snapshot present and only 40 new tokens: the decoder cannot keep rows the encoder did not run.
    let p = plan(&cfg(ReplayMode::Bounded), 4136, 4096, true).unwrap();
    assert_eq!(p.layers[25].rows, 4096..4136);
    assert_eq!(p.window_start(25, 4135), 4096);
    // Snapshot missing: the decoder keeps the last 128 of the 168 replayed + new rows.
    let p = plan(&cfg(ReplayMode::Bounded), 4136, 4096, false).unwrap();
    assert_eq!(p.layers[25].rows, 4008..4136);
}

#[test]
fn prompt_shorter_than_the_window() {
    for mode in [ReplayMode::Bounded, ReplayMode::Exact, ReplayMode::Off] {
        let p = plan(&cfg(mode), 100, 0, false).unwrap();
        assert_eq!(p.hit_used, 0);
        for l in &p.layers {
            assert_eq!(l.rows, 0..100, "{mode:?}");
        }
        assert_eq!(p.window_start(30, 99), 0);
        assert_eq!(p.window_start(30, 50), 0);
    }
}

#[test]
fn odd_hit_served_from_a_snapshot_needs_the_pair_state() {
    let p = plan(&cfg(ReplayMode::Bounded), 1000, 301, true).unwrap();
    assert!(p.snapshot_used);
    assert!(p.needs_compressor_state);
}

#[test]
fn full_hit_keeps_one_row_to_compute() {
    let p = plan(&cfg(ReplayMode::Bounded), 1024, 1024, true).unwrap();
    assert_eq!(p.hit_used, 1023);
    assert_eq!(p.layers[0].rows, 1023..1024);
    assert_eq!(p.kv_write, 1023..1024);
}

#[test]
fn exact_is_the_staircase() {
    let c = cfg(ReplayMode::Exact);
    let (i, h) = (20_000, 12_288);
    let p = plan(&c, i, h, true).unwrap();
    // Decoder SWA is never snapshotted, so even with the encoder snapshot the whole stack replays.
    for k in 0..40 {
        assert_eq!(p.layers[k].rows, h - (40 - k) * 128..i, "layer {k}");
    }
    assert_eq!(p.replayed_tokens(), 40 * 128);
    let staircase: usize = (1..=40).map(|n| n * 128).sum();
    assert_eq!(p.token_layers(0..40), 40 * (i - h) + staircase);
    // Short hits clamp at token 0.
    let p = plan(&c, 3000, 1000, false).unwrap();
    assert_eq!(p.layers[0].rows, 0..3000);
    assert_eq!(p.layers[39].rows, 872..3000);
    // A snapshot of every layer (V4) makes exact replay unnecessary.
    let mut v4 = c.clone();
    v4.snapshot_scope = SnapshotScope::AllLayers;
    let p = plan(&v4, i, h, true).unwrap();
    assert!(p.snapshot_used);
    assert!(p.layers.iter().all(|l| l.rows == (h..i)));
    let p = plan(&v4, i, h, false).unwrap();
    assert_eq!(p.layers[0].rows, h - 40 * 128..i);
}

#[test]
fn off_runs_the_decoder_on_every_row() {
    let p = plan(&cfg(ReplayMode::Off), 5000, 4096, false).unwrap();
    assert_eq!(p.layers[0].rows, 3968..5000);
    assert_eq!(p.layers[30].rows, 3968..5000);
    assert_eq!(p.window_start(30, 4000), 3968);
    let cold = plan(&cfg(ReplayMode::Off), 5000, 0, false).unwrap();
    assert_eq!(cold.layers[30].rows, 0..5000);
}

#[test]
fn bad_inputs_are_errors() {
    let c = cfg(ReplayMode::Bounded);
    assert!(plan(&c, 0, 0, false).is_err());
    assert!(plan(&c, 10, 11, false).is_err());
    assert!(ReplayMode::from_name("sometimes").is_err());
    assert_eq!(ReplayMode::from_name("exact").unwrap(), ReplayMode::Exact);
}
