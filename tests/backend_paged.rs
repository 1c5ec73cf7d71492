//! The stack over the paged cache manager ([`PagedCache`]) against the same runs over
//! [`ContiguousCache`]: the records, windows and hidden states must be bit-identical (the adapter
//! changes where bytes live, never what they are), through odd prefill chunks crossing block
//! boundaries, several requests per step, decode steps, an SWA snapshot / drop / restore cycle and
//! a layer-20 pool past the 16,384-entry candidate pool. Plus the measured 890 B/token and a clean
//! `OutOfBlocks`.

use csa2::backend::timing::Timings;
use csa2::backend::{
    Backend, BackendConfig, ContiguousCache, KvCache, Model, PagedCache, Phase, SeqStep,
};
use csa2::cache::RecordKind;
use csa2::cache::{CacheConfig, CacheManager, CacheSpec};
use csa2::geometry::Role;
use csa2::weights::Scale;
use csa2::Error;
use csa2::KvScheme;
use std::sync::{Arc, OnceLock};

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Model::synthetic(Scale::Tiny, 11, false).unwrap()))
        .clone()
}

fn tok(req: u64, p: usize) -> u32 {
    ((p as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(req * 977)
        % 50_000) as u32
}

fn prefill(req: u64, first: usize, len: usize, end: usize, start: usize) -> SeqStep {
    SeqStep {
        req,
        first_pos: first,
        len,
        phase: Phase::Prefill {
            prompt_end: end,
            prefill_start: start,
        },
        replay_start: 0,
        cached_until: first,
    }
}

fn decode(req: u64, pos: usize) -> SeqStep {
    SeqStep {
        req,
        first_pos: pos,
        len: 1,
        phase: Phase::Decode,
        replay_start: 0,
        cached_until: pos,
    }
}

/// A paged cache with `block_tokens`-token blocks (small blocks put many page boundaries inside a
/// short prompt).
fn paged(b: &Backend, block_tokens: usize, num_blocks: usize) -> PagedCache {
    let spec = CacheSpec::from_geometry(b.geometry(), KvScheme::CSA2);
    let cfg = CacheConfig {
        block_tokens,
        ..CacheConfig::host(num_blocks)
    };
    PagedCache::new(Arc::new(CacheManager::new(spec, cfg, b"test").unwrap())).unwrap()
}

/// Runs the same step on both caches and requires bit-identical hidden states.
fn step_both(
    b: &Backend,
    seqs: &[SeqStep],
    c: &mut ContiguousCache,
    p: &mut PagedCache,
    what: &str,
) -> Vec<f32> {
    let toks: Vec<u32> = seqs
        .iter()
        .flat_map(|s| (s.first_pos..s.first_pos + s.len).map(move |q| tok(s.req, q)))
        .collect();
    let mut tm = Timings::default();
    let x = b.step(seqs, &toks, c, &mut tm, false).unwrap();
    let y = b.step(seqs, &toks, p, &mut tm, false).unwrap();
    assert!(!x.hidden.is_empty(), "{what}: no output rows");
    assert!(x.hidden.iter().all(|v| v.is_finite()), "{what}: non-finite");
    let same = x
        .hidden
        .iter()
        .zip(&y.hidden)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same && x.hidden.len() == y.hidden.len(),
        "{what}: hidden states differ"
    );
    x.hidden
}

/// Every stored record, window range and window row of `req` agrees between the two caches.
fn same_state(b: &Backend, c: &ContiguousCache, p: &PagedCache, req: u64) {
    let g = b.geometry();
    for lp in g.layers_with(Role::Full) {
        let n = c.entries(req, lp.id).unwrap();
        assert_eq!(p.entries(req, lp.id).unwrap(), n, "layer {}", lp.id);
        for region in [RecordKind::Main, RecordKind::Index] {
            let x = c.records(req, lp.id, region, 0..n).unwrap();
            let y = p.records(req, lp.id, region, 0..n).unwrap();
            assert!(x[..] == y[..], "layer {} {region:?} records", lp.id);
            // A range starting mid-block.
            if n > 3 {
                let x = c.records(req, lp.id, region, 3..n).unwrap();
                let y = p.records(req, lp.id, region, 3..n).unwrap();
                assert!(x[..] == y[..], "layer {} {region:?} records 3..", lp.id);
            }
        }
    }
    for l in 0..g.num_layers {
        let h = c.swa_held(req, l).unwrap();
        assert_eq!(p.swa_held(req, l).unwrap(), h, "layer {l} SWA held");
        let mut x = vec![0f32; h.len() * 512];
        let mut y = vec![1f32; h.len() * 512];
        c.swa_read(req, l, h.clone(), &mut x).unwrap();
        p.swa_read(req, l, h, &mut y).unwrap();
        assert!(x == y, "layer {l} SWA rows");
    }
}

#[test]
fn chunked_batched_prefill_and_decode_are_bit_identical() {
    let b = Backend::new(model(), BackendConfig::CSA2).unwrap();
    let mut c = ContiguousCache::new(b.geometry(), b.cfg.formats);
    // 16-token blocks: a ratio-2 page holds 8 entries, layer 20's 16, so every chunk below
    // crosses several page boundaries, mid-pair on odd lengths.
    let mut p = paged(&b, 16, 64);
    let (na, nb) = (157usize, 90usize);
    // Request 1 alone, then 1 and 2 together in odd chunks, then 2 alone.
    step_both(&b, &[prefill(1, 0, 37, na, 0)], &mut c, &mut p, "chunk 1");
    step_both(
        &b,
        &[prefill(1, 37, 61, na, 0), prefill(2, 0, 45, nb, 0)],
        &mut c,
        &mut p,
        "chunk 2 (two requests)",
    );
    step_both(
        &b,
        &[prefill(1, 98, na - 98, na, 0), prefill(2, 45, 29, nb, 0)],
        &mut c,
        &mut p,
        "chunk 3 (two requests)",
    );
    step_both(
        &b,
        &[prefill(2, 74, nb - 74, nb, 0)],
        &mut c,
        &mut p,
        "chunk 4",
    );
    for i in 0..3 {
        step_both(
            &b,
            &[decode(1, na + i), decode(2, nb + i)],
            &mut c,
            &mut p,
            &format!("decode {i}"),
        );
    }
    for req in [1, 2] {
        same_state(&b, &c, &p, req);
    }
    assert_eq!(p.entries(1, 20).unwrap(), na + 3);
    assert_eq!(p.entries(1, 2).unwrap(), (na + 3) / 2);
    // The entries really went through the manager's block tables.
    let blocks = p.manager().block_table(1).unwrap().len();
    assert_eq!(blocks, (na + 3).div_ceil(16));
    p.manager().check_invariants().unwrap();
    // Closing frees the blocks.
    p.close(1).unwrap();
    p.close(2).unwrap();
    assert_eq!(p.manager().stats().used_blocks, 0);
    assert!(matches!(p.close(1), Err(Error::NotFound(_))));
}

#[test]
fn snapshot_drop_restore_cycle_is_bit_identical() {
    let m = model();
    let g = m.geometry.clone();
    let b = Backend::new(m, BackendConfig::CSA2).unwrap();
    let mut c = ContiguousCache::new(&g, b.cfg.formats);
    let mut p = paged(&b, 32, 64);
    // Turn 1: prefill past the window, a few decode steps.
    let n = g.window + 21;
    step_both(&b, &[prefill(5, 0, n, n, 0)], &mut c, &mut p, "turn 1");
    for i in 0..2 {
        step_both(&b, &[decode(5, n + i)], &mut c, &mut p, "turn 1 decode");
    }
    let ctx = n + 2;
    // End of turn: snapshot encoder windows, take carries, drop every window and carry.
    let encoder: Vec<usize> = (0..g.first_decoder_layer).collect();
    let all: Vec<usize> = (0..g.num_layers).collect();
    let kv: Vec<usize> = g.layers_with(Role::Full).map(|l| l.id).collect();
    let sc = c.swa_snapshot(5, &encoder).unwrap();
    let sp = p.swa_snapshot(5, &encoder).unwrap();
    assert_eq!(sc, sp, "snapshots");
    assert_eq!(sp.end, ctx);
    let mut carries = vec![];
    for &l in &kv {
        let x = c.carry(5, l).unwrap();
        let y = p.carry(5, l).unwrap();
        assert_eq!(x, y, "layer {l} carry");
        // One copy of the carry: the C ABI's rows-only form reads the engine's open group.
        if g.layers[l].ratio > 1 {
            let rows = y
                .as_ref()
                .filter(|s| s.pending_tokens() > 0)
                .map(|s| [s.pending().0, s.pending().1].concat());
            assert_eq!(
                p.manager().compressor_state(5, l).unwrap(),
                rows,
                "layer {l}"
            );
        }
        carries.push((l, x));
    }
    for cache in [&mut c as &mut dyn KvCache, &mut p] {
        cache.swa_drop(5, &all).unwrap();
        cache.carry_drop(5).unwrap();
        assert_eq!(cache.swa_held(5, 0).unwrap(), 0..0);
    }
    assert_eq!(p.swa_snapshot(5, &encoder).unwrap().layers.len(), 0);
    // Turn 2: restore, then new prompt tokens and decode.
    for cache in [&mut c as &mut dyn KvCache, &mut p] {
        cache.swa_restore(5, &sc).unwrap();
        for (l, s) in &carries {
            cache.set_carry(5, *l, s.clone()).unwrap();
        }
    }
    same_state(&b, &c, &p, 5);
    let end = ctx + 19;
    step_both(
        &b,
        &[prefill(5, ctx, 19, end, ctx)],
        &mut c,
        &mut p,
        "turn 2 prefill",
    );
    step_both(&b, &[decode(5, end)], &mut c, &mut p, "turn 2 decode");
    same_state(&b, &c, &p, 5);
    // A window restart on a non-continuing write (replay after a miss), older than the ring.
    let rows: Vec<f32> = (0..3 * 512).map(|i| (i as f32 * 0.01).sin()).collect();
    for cache in [&mut c as &mut dyn KvCache, &mut p] {
        cache.swa_write(5, 3, 10, &rows).unwrap();
        assert_eq!(cache.swa_held(5, 3).unwrap(), 10..13);
    }
    same_state(&b, &c, &p, 5);
}

#[test]
fn layer_20_pool_past_16k_entries_is_bit_identical() {
    // Layer 20 (ratio 1) holds more entries than the candidate pool, written through the trait
    // (encoding, slot mapping, 68 blocks) rather than prefilled: the decode step then reads and
    // gathers every entry of every KV-source layer from the pages.
    let m = model();
    let g = m.geometry.clone();
    let n = g.candidate_block_size * g.candidate_topk_blocks + 1000;
    let b = Backend::new(m, BackendConfig::CSA2).unwrap();
    let mut c = ContiguousCache::new(&g, b.cfg.formats);
    let mut p = paged(&b, 256, n.div_ceil(256) + 1);
    for cache in [&mut c as &mut dyn KvCache, &mut p] {
        cache.open(1).unwrap();
        for lp in g.layers_with(Role::Full) {
            let e = n / lp.ratio;
            for (region, dim) in [(RecordKind::Main, 512), (RecordKind::Index, 128)] {
                // Two writes: the second starts mid-block.
                let rows: Vec<f32> = (0..e * dim)
                    .map(|i| {
                        ((((i / dim) * 31 + (i % dim) * 7 + lp.id) % 97) as f32 / 48.0 - 1.0) * 1.5
                    })
                    .collect();
                let cut = 1001 / lp.ratio;
                cache
                    .write_entries(1, lp.id, region, 0, &rows[..cut * dim])
                    .unwrap();
                cache
                    .write_entries(1, lp.id, region, cut, &rows[cut * dim..])
                    .unwrap();
            }
        }
    }
    assert!(p.entries(1, 20).unwrap() > 16_384);
    let h = step_both(&b, &[decode(1, n)], &mut c, &mut p, "decode past the pool");
    assert_eq!(h.len(), g.hidden_size);
    let x = c.records(1, 20, RecordKind::Main, 16_000..n).unwrap();
    let y = p.records(1, 20, RecordKind::Main, 16_000..n).unwrap();
    assert!(x[..] == y[..]);
}

#[test]
fn usage_is_890_bytes_per_token_measured_from_the_manager() {
    let b = Backend::new(model(), BackendConfig::CSA2).unwrap();
    let g = b.geometry().clone();
    let mut p = PagedCache::host(&g, b.cfg.formats, 8).unwrap();
    let tokens = 512;
    p.open(1).unwrap();
    for lp in g.layers_with(Role::Full) {
        let e = tokens / lp.ratio;
        p.write_entries(1, lp.id, RecordKind::Main, 0, &vec![0.5; e * 512])
            .unwrap();
        p.write_entries(1, lp.id, RecordKind::Index, 0, &vec![-0.25; e * 128])
            .unwrap();
    }
    let u = p.usage();
    assert_eq!(u.global_bytes() as f64 / tokens as f64, 890.0);
    // Slab bytes of the blocks handed out, as the allocator counts them.
    assert_eq!(u.global_allocated as f64 / tokens as f64, 890.0);
    let rb = p.manager().request_bytes(1).unwrap();
    assert_eq!(
        (rb.blocks, rb.bytes_per_token, rb.padding_bytes),
        (2, 890.0, 0)
    );
    // SWA rings: one window of MXFP8 records per layer, allocated when the request opened.
    assert_eq!(u.swa_bytes, g.num_layers * g.window * 528);
    assert_eq!(u.requests, 1);
    // Launch day through the same adapter: 1,790 B/token.
    let mut l = PagedCache::host(&g, csa2::backend::launch_day::LAUNCH_DAY.formats, 8).unwrap();
    l.open(1).unwrap();
    for lp in g.layers_with(Role::Full) {
        let e = tokens / lp.ratio;
        l.write_entries(1, lp.id, RecordKind::Main, 0, &vec![0.5; e * 512])
            .unwrap();
        l.write_entries(1, lp.id, RecordKind::Index, 0, &vec![0.5; e * 128])
            .unwrap();
    }
    assert_eq!(l.usage().global_allocated as f64 / tokens as f64, 1790.0);
}

#[test]
fn a_full_pool_is_a_clean_out_of_blocks() {
    let b = Backend::new(model(), BackendConfig::CSA2).unwrap();
    let g = b.geometry().clone();
    // One 256-token block.
    let mut p = PagedCache::host(&g, b.cfg.formats, 1).unwrap();
    p.open(1).unwrap();
    p.write_entries(1, 20, RecordKind::Main, 0, &vec![0.5; 200 * 512])
        .unwrap();
    let before = (p.usage(), p.manager().stats());
    let e = p
        .write_entries(1, 20, RecordKind::Main, 200, &vec![0.5; 100 * 512])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutOfBlocks {
                requested: 1,
                free: 0,
                ..
            }
        ),
        "{e}"
    );
    // Nothing changed: counts, records, allocator.
    assert_eq!(p.entries(1, 20).unwrap(), 200);
    assert_eq!((p.usage(), p.manager().stats()), before);
    p.manager().check_invariants().unwrap();
    // Through the stack: a prompt longer than the pool fails with the same typed error.
    let toks: Vec<u32> = (0..300).map(|q| tok(2, q)).collect();
    let mut tm = Timings::default();
    let e = b
        .step(&[prefill(2, 0, 300, 300, 0)], &toks, &mut p, &mut tm, false)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfBlocks { .. }), "{e}");
    // Other typed errors.
    assert!(matches!(p.entries(9, 20), Err(Error::NotFound(_))));
    let e = p
        .write_entries(1, 3, RecordKind::Main, 0, &[0.0; 512])
        .unwrap_err();
    assert!(e.to_string().contains("layer 3 owns no global KV"), "{e}");
    let e = p
        .write_entries(1, 20, RecordKind::Main, 201, &[0.0; 512])
        .unwrap_err();
    assert!(e.to_string().contains("gap"), "{e}");
    let e = p.records(1, 20, RecordKind::Main, 0..201).unwrap_err();
    assert!(e.to_string().contains("200 stored"), "{e}");
    assert!(p.open(1).is_err());
    let bad = CacheManager::new(CacheSpec::v4_flash(), CacheConfig::host(1), b"v4").unwrap();
    assert!(PagedCache::new(Arc::new(bad)).is_err());
}

/// `csa2 run` over both caches: three turns (the last one a prefix hit with a snapshot restore) give
/// the same `output_sha256`, and the paged run reports the manager's measured bytes.
#[test]
fn csa2_run_digest_is_the_same_over_both_caches() {
    let tmp = tempfile::tempdir().unwrap();
    let mut digests = vec![];
    for cache in ["paged", "contiguous"] {
        let json = tmp.path().join(format!("{cache}.json"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_csa2"))
            .args([
                "run",
                "--turns",
                "3",
                "--token-scale",
                "0.004",
                "--decode-max",
                "3",
                "--ttl-s",
                "100000",
                "--cache",
                cache,
                "--json",
                json.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{cache}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(&format!("Cache: {cache}")), "{stdout}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(v["cache"], cache);
        let turns = v["turns"].as_array().unwrap();
        assert_eq!(turns.len(), 3);
        // Turn 2 reuses turn 1's global KV and restores its encoder windows from the snapshot.
        assert!(turns[2]["prefix_hit"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(turns[2]["snapshot_hit"], true, "{v}");
        if cache == "paged" {
            let r = &v["cache_manager"]["request"];
            let ctx = turns[2]["prompt_tokens"].as_u64().unwrap()
                + turns[2]["generated_tokens"].as_u64().unwrap();
            assert_eq!(r["tokens"].as_u64().unwrap(), ctx, "{r}");
            assert!(r["slab_bytes"].as_u64().unwrap() > 0);
        } else {
            assert!(v["cache_manager"].is_null());
        }
        digests.push(v["output_sha256"].as_str().unwrap().to_string());
    }
    assert_eq!(digests[0].len(), 64);
    assert_eq!(digests[0], digests[1], "paged vs contiguous output digests");
}
