use super::*;
use crate::formats::KvScheme;
use crate::formats::{encode_rows, RecordFormat};
use crate::geometry::Geometry;

fn manager(layout: KvScheme, blocks: usize) -> CacheManager {
    let g = Geometry::embedded();
    CacheManager::new(
        CacheSpec::from_geometry(&g, layout),
        CacheConfig::host(blocks),
        b"test-model",
    )
    .unwrap()
}

fn row(seed: usize, dim: usize) -> Vec<f32> {
    (0..dim)
        .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) * 0.037)
        .collect()
}

#[test]
fn ratio_two_pages_hold_half_the_entries_and_slots_follow_the_table() {
    let c = manager(KvScheme::CSA2, 8);
    c.add_request(1).unwrap();
    c.allocate(1, 600).unwrap(); // 3 blocks of 256
    let table = c.block_table(1).unwrap();
    assert_eq!(table.len(), 3);
    let l2 = c
        .block_layout()
        .place(2, RecordKind::Main)
        .unwrap()
        .page
        .slots;
    let l20 = c
        .block_layout()
        .place(20, RecordKind::Main)
        .unwrap()
        .page
        .slots;
    assert_eq!((l2, l20), (128, 256));
    // Entries around the block boundary of the ratio-2 layer: 127 | 128.
    let s = c.slot_mapping(1, 2, 126..130).unwrap();
    let b0 = table[0] as u64 * 128;
    let b1 = table[1] as u64 * 128;
    assert_eq!(s, vec![b0 + 126, b0 + 127, b1, b1 + 1]);
    // Ratio 1: entry 511 is the last of block 1, 512 the first of block 2.
    let s = c.slot_mapping(1, 20, 511..513).unwrap();
    assert_eq!(s, vec![table[1] as u64 * 256 + 255, table[2] as u64 * 256]);
    // 3 blocks hold 384 ratio-2 entries; asking for entry 384 is an error, not a panic.
    assert!(c.slot_mapping(1, 2, 380..385).is_err());
    // Not a KV source.
    assert!(c.slot_mapping(1, 3, 0..1).is_err());
}

#[test]
fn no_two_layers_alias_a_page_or_a_scale_region() {
    for layout in KvScheme::ALL {
        let c = manager(layout, 2);
        let places = &c.block_layout().pages;
        assert_eq!(places.len(), 8, "4 KV sources × (main, index)");
        // Byte ranges of data and scale regions of every page are pairwise disjoint and inside the slab.
        let mut ranges = Vec::new();
        for p in places {
            assert_eq!(p.offset % PAGE_ALIGN, 0);
            let data_end = p.offset + p.page.slots * p.page.format.data_bytes();
            ranges.push((p.offset, data_end));
            ranges.push((data_end, p.offset + p.bytes()));
        }
        ranges.sort();
        for w in ranges.windows(2) {
            assert!(
                w[0].1 <= w[1].0,
                "{layout:?}: {:?} overlaps {:?}",
                w[0],
                w[1]
            );
        }
        assert!(ranges.last().unwrap().1 <= c.block_layout().slab_bytes);
        // Writing every (layer, kind) at the same slot number leaves each one's record intact.
        c.add_request(7).unwrap();
        c.allocate(7, 256).unwrap();
        let mut written = Vec::new();
        for (i, p) in places.iter().enumerate() {
            let fmt = p.page.format;
            let mut rec = vec![0u8; fmt.record_bytes()];
            encode_rows(fmt, &row(i, fmt.dim()), &mut rec).unwrap();
            c.write_record(p.layer, p.kind, 5, &rec).unwrap();
            written.push(rec);
        }
        for (p, rec) in places.iter().zip(&written) {
            let mut out = vec![0u8; rec.len()];
            c.read_record(p.layer, p.kind, 5, &mut out).unwrap();
            assert_eq!(&out, rec, "{layout:?} layer {} {:?}", p.layer, p.kind);
        }
    }
}

#[test]
fn rows_round_trip_through_the_page_like_the_codec() {
    let c = manager(KvScheme::CSA2, 2);
    c.add_request(1).unwrap();
    c.allocate(1, 512).unwrap();
    let slot = c.slot_mapping(1, 8, 200..201).unwrap()[0];
    for (kind, fmt) in [
        (RecordKind::Main, RecordFormat::Nvfp4Ds),
        (RecordKind::Index, RecordFormat::Mxfp4Index),
    ] {
        let x = row(3, fmt.dim());
        c.write_row(8, kind, slot, &x).unwrap();
        // Quantize→dequantize reference through the standalone codec: identical values.
        let mut rec = vec![0u8; fmt.record_bytes()];
        encode_rows(fmt, &x, &mut rec).unwrap();
        let mut want = vec![0f32; fmt.dim()];
        crate::formats::decode_rows(fmt, &rec, &mut want).unwrap();
        let mut got = vec![0f32; fmt.dim()];
        c.read_row(8, kind, slot, &mut got).unwrap();
        assert_eq!(got, want);
        let mut raw = vec![0u8; fmt.record_bytes()];
        c.read_record(8, kind, slot, &mut raw).unwrap();
        assert_eq!(raw, rec);
    }
    // Wrong record length is a shape error naming the format.
    let e = c
        .write_record(8, RecordKind::Main, slot, &[0u8; 10])
        .unwrap_err();
    assert!(e.to_string().contains("288"), "{e}");
}

#[test]
fn prefix_blocks_are_shared_sealed_and_evicted_deepest_first() {
    let c = manager(KvScheme::CSA2, 6);
    let tokens: Vec<u32> = (0..800).collect();
    let keys = c.hasher().keys(&tokens);
    assert_eq!(keys.len(), 3);
    c.add_request(1).unwrap();
    c.allocate(1, 800).unwrap();
    let slot = c.slot_mapping(1, 20, 0..1).unwrap()[0];
    c.write_row(20, RecordKind::Main, slot, &row(1, 512))
        .unwrap();
    assert_eq!(c.publish(1, &keys).unwrap(), 3);
    // A published block is read-only: a replay cannot overwrite a shared entry.
    assert!(c
        .write_row(20, RecordKind::Main, slot, &row(2, 512))
        .is_err());
    // The partial 4th block stays writable.
    let tail = c.slot_mapping(1, 20, 790..791).unwrap()[0];
    c.write_row(20, RecordKind::Main, tail, &row(2, 512))
        .unwrap();

    c.add_request(2).unwrap();
    assert_eq!(c.lookup_prefix(&keys).unwrap(), 3);
    assert_eq!(c.adopt_prefix(2, &keys[..2]).unwrap(), 2);
    assert_eq!(
        &c.block_table(2).unwrap()[..],
        &c.block_table(1).unwrap()[..2]
    );
    c.allocate(2, 1024).unwrap();
    c.check_invariants().unwrap();
    let st = c.stats();
    assert_eq!(st.used_blocks, 4 + 2);
    c.free_request(1).unwrap();
    c.free_request(2).unwrap();
    c.check_invariants().unwrap();
    let st = c.stats();
    assert_eq!(
        (st.used_blocks, st.cached_blocks, st.free_blocks),
        (0, 3, 3)
    );
    // A fresh request needing 4 blocks takes the 3 free ones, then evicts the deepest cached block.
    c.add_request(3).unwrap();
    c.allocate(3, 4 * 256).unwrap();
    assert_eq!(
        c.lookup_prefix(&keys).unwrap(),
        2,
        "block 3 of the prefix went first"
    );
    assert_eq!(c.stats().evictions, 1);
    c.check_invariants().unwrap();
    // Double free is reported.
    c.free_request(3).unwrap();
    assert!(matches!(c.free_request(3), Err(Error::NotFound(_))));
}

#[test]
fn out_of_blocks_is_an_error_that_changes_nothing() {
    let c = manager(KvScheme::CSA2, 4);
    c.add_request(1).unwrap();
    c.allocate(1, 3 * 256).unwrap();
    c.add_request(2).unwrap();
    let before = c.stats();
    match c.allocate(2, 2 * 256) {
        Err(Error::OutOfBlocks {
            requested,
            free,
            evictable,
        }) => assert_eq!((requested, free, evictable), (2, 1, 0)),
        other => panic!("expected OutOfBlocks, got {other:?}"),
    }
    assert_eq!(c.stats(), before);
    assert!(c.block_table(2).unwrap().is_empty());
    c.allocate(2, 256).unwrap();
    c.check_invariants().unwrap();
}

/// docs/SPEC.md §0: at long context the measured global KV comes to 890 / 1,490 / 1,790 B per token.
#[test]
fn measured_bytes_per_token_at_long_context() {
    let tokens = 64 * 1024;
    for (layout, want) in [
        (KvScheme::CSA2, 890.0),
        (KvScheme::MXFP8, 1490.0),
        (KvScheme::LAUNCH_DAY, 1790.0),
    ] {
        let c = manager(layout, tokens / 256 + 1);
        c.add_request(1).unwrap();
        c.allocate(1, tokens).unwrap();
        let b = c.request_bytes(1).unwrap();
        assert_eq!(b.bytes_per_token, want, "{layout:?}");
        assert_eq!(
            b.padding_bytes, 0,
            "256-token pages are 512-B aligned already"
        );
        assert_eq!(c.stats().allocated_bytes, b.slab_bytes);
        // One token more opens a block: the padding is reported, not hidden.
        c.allocate(1, tokens + 1).unwrap();
        let b = c.request_bytes(1).unwrap();
        let slab = c.block_layout().slab_bytes;
        // The extra token has its layer-20 entry only (ratio-2 pairs are not complete).
        let l20 = layout.main_record_bytes() + layout.index_record_bytes();
        assert_eq!(b.padding_bytes, slab - l20, "{layout:?}");
        assert!(b.bytes_per_token > want);
    }
}

#[test]
fn swa_ring_keeps_the_last_window_and_snapshots_encoder_layers() {
    let c = manager(KvScheme::CSA2, 1);
    c.add_request(1).unwrap();
    let rec = |p: usize, l: usize| vec![(p * 7 + l) as u8; 528];
    for p in 0..300 {
        for l in [0, 19, 39] {
            c.swa_write(1, l, p, &rec(p, l)).unwrap();
        }
    }
    let mut out = vec![0u8; 528];
    for p in [172, 200, 299] {
        c.swa_read(1, 19, p, &mut out).unwrap();
        assert_eq!(out, rec(p, 19));
    }
    assert!(
        c.swa_read(1, 19, 171, &mut out).is_err(),
        "evicted from the window"
    );
    assert!(c.swa_read(1, 19, 300, &mut out).is_err(), "not written yet");
    assert!(
        c.swa_read(1, 5, 10, &mut out).is_err(),
        "layer never written"
    );
    assert!(
        c.swa_write(1, 19, 100, &rec(0, 0)).is_err(),
        "older than the window"
    );
    assert!(c.swa_write(1, 40, 0, &rec(0, 0)).is_err());
    let snap = c.swa_snapshot(1).unwrap();
    assert_eq!(snap.len(), 20 * 128 * 528);
    // Layer 19 is the 20th snapshotted layer; its window starts with position 172.
    let l19 = &snap[19 * 128 * 528..];
    assert_eq!(&l19[..528], &rec(172, 19)[..]);
    assert_eq!(&l19[127 * 528..128 * 528], &rec(299, 19)[..]);
}

#[test]
fn compressor_pair_state_for_ratio_two_layers_only() {
    let c = manager(KvScheme::CSA2, 1);
    c.add_request(1).unwrap();
    assert_eq!(c.compressor_state(1, 2).unwrap(), None);
    let half: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    c.set_compressor_state(1, 14, Some(&half)).unwrap();
    assert_eq!(c.compressor_state(1, 14).unwrap().unwrap(), half);
    assert_eq!(c.compressor_state(1, 8).unwrap(), None, "per layer");
    assert!(
        c.set_compressor_state(1, 20, Some(&half)).is_err(),
        "ratio 1 has no pair"
    );
    assert!(c.set_compressor_state(1, 2, Some(&half[..10])).is_err());
    assert_eq!(c.stats().session_bytes, 40 * 128 * 528 + 4096);
    c.set_compressor_state(1, 14, None).unwrap();
    assert_eq!(c.compressor_state(1, 14).unwrap(), None);
}

#[test]
fn accounting_backing_counts_without_memory() {
    let g = Geometry::embedded();
    let c = CacheManager::new(
        CacheSpec::from_geometry(&g, KvScheme::CSA2),
        CacheConfig {
            block_tokens: 512,
            num_blocks: 100,
            backing: Backing::Accounting,
        },
        b"m",
    )
    .unwrap();
    c.add_request(1).unwrap();
    c.allocate(1, 512 * 10).unwrap();
    assert_eq!(c.request_bytes(1).unwrap().bytes_per_token, 890.0);
    assert!(matches!(
        c.write_row(2, RecordKind::Main, 0, &[0.0; 512]),
        Err(Error::Unsupported(_))
    ));
    assert_eq!(c.stats().allocated_bytes, 10 * 512 * 890);
}

#[test]
fn bad_configs_are_typed_errors() {
    let g = Geometry::embedded();
    let spec = CacheSpec::from_geometry(&g, KvScheme::CSA2);
    for (bt, nb) in [(0, 4), (255, 4), (256, 0)] {
        let e = CacheManager::new(
            spec.clone(),
            CacheConfig {
                block_tokens: bt,
                num_blocks: nb,
                backing: Backing::Host,
            },
            b"m",
        )
        .unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }), "{e}");
    }
}

#[test]
fn a_gap_write_restarts_the_window_and_skipped_positions_are_not_readable() {
    let c = manager(KvScheme::CSA2, 1);
    c.add_request(1).unwrap();
    let rec = |p: usize| vec![(p * 3 + 1) as u8; 528];
    for p in 0..10 {
        c.swa_write(1, 4, p, &rec(p)).unwrap();
    }
    assert_eq!(c.swa_window(1, 4).unwrap(), Some(0..10));
    // Position 20 leaves 10..20 unwritten: their ring slots hold nothing of this window, so the
    // window restarts at 20 instead of claiming [21 − 128, 21).
    c.swa_write(1, 4, 20, &rec(20)).unwrap();
    assert_eq!(c.swa_window(1, 4).unwrap(), Some(20..21));
    assert_eq!(c.swa_newest(1, 4).unwrap(), Some(21));
    let mut out = vec![0u8; 528];
    for p in [5, 15] {
        assert!(
            matches!(c.swa_read(1, 4, p, &mut out), Err(Error::NotFound(_))),
            "position {p} is not in the restarted window"
        );
    }
    let mut rows = vec![0u8; 2 * 528];
    assert!(c.swa_read_rows(1, 4, 19, &mut rows).is_err());
    c.swa_read(1, 4, 20, &mut out).unwrap();
    assert_eq!(out, rec(20));
    // A write that overlaps the window (rewriting an older held position) keeps it.
    c.swa_write_rows(1, 4, 21, &[rec(21), rec(22)].concat())
        .unwrap();
    c.swa_write(1, 4, 21, &rec(99)).unwrap();
    assert_eq!(c.swa_window(1, 4).unwrap(), Some(20..23));
    c.swa_read(1, 4, 21, &mut out).unwrap();
    assert_eq!(out, rec(99));
    // An explicit restart holds nothing until written; a clear forgets the window.
    c.swa_restart(1, 4, 500).unwrap();
    assert_eq!(c.swa_window(1, 4).unwrap(), Some(500..500));
    assert!(c.swa_read(1, 4, 22, &mut out).is_err());
    c.swa_write(1, 4, 500, &rec(500)).unwrap();
    assert_eq!(c.swa_window(1, 4).unwrap(), Some(500..501));
    c.swa_clear(1, 4).unwrap();
    assert_eq!(c.swa_window(1, 4).unwrap(), None);
    assert!(c.swa_restart(1, 40, 0).is_err(), "layer past the backbone");
    assert!(c.swa_restart(2, 4, 0).is_err(), "unknown request");
}
