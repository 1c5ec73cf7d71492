//! Many threads allocating, sharing prefixes and freeing blocks for many sessions at once: no
//! leak, no double free, counts return to zero.

use csa2::cache::{Backing, CacheConfig, CacheManager, CacheSpec, RecordKind};
use csa2::{Error, Geometry, KvScheme};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

fn sessions_per_thread() -> u64 {
    std::env::var("CSA2_CONCURRENCY_SESSIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300)
}

#[test]
fn concurrent_sessions_leave_no_leak() {
    let g = Geometry::embedded();
    let c = Arc::new(
        CacheManager::new(
            CacheSpec::from_geometry(&g, KvScheme::CSA2),
            CacheConfig {
                block_tokens: 256,
                num_blocks: 24,
                backing: Backing::Host,
            },
            b"concurrency",
        )
        .unwrap(),
    );
    // Four shared system prompts of 2–5 blocks; sessions append their own tokens.
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|p| (0..(2 + p) * 256).map(|t| t * 7 + p).collect())
        .collect();
    let out_of_blocks = Arc::new(AtomicU64::new(0));
    let next_id = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4u64)
        .map(|th| {
            let (c, prompts, oob, next_id) = (
                c.clone(),
                prompts.clone(),
                out_of_blocks.clone(),
                next_id.clone(),
            );
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for n in 0..sessions_per_thread() {
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let mut tokens = prompts[((n + th) % 4) as usize].clone();
                    // Private tail, unique per session: its full blocks pile up in the LRU and must be evicted.
                    tokens.extend(
                        (0..(n % 700) as u32)
                            .map(|t| t + 1_000_000 * th as u32 + ((n as u32) << 20)),
                    );
                    let keys = c.hasher().keys(&tokens);
                    c.add_request(id).unwrap();
                    let hit = c.adopt_prefix(id, &keys).unwrap();
                    match c.allocate(id, tokens.len() + 16) {
                        Ok(()) => {}
                        Err(Error::OutOfBlocks { .. }) => {
                            oob.fetch_add(1, Ordering::Relaxed);
                            c.free_request(id).unwrap();
                            // Release our oldest session and go on.
                            if !live.is_empty() {
                                c.free_request(live.remove(0)).unwrap();
                            }
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    }
                    // Write one record into the first unshared block, then publish.
                    if keys.len() > hit {
                        let entry = hit * 256;
                        let slot = c.slot_mapping(id, 20, entry..entry + 1).unwrap()[0];
                        c.write_row(20, RecordKind::Main, slot, &[0.5; 512])
                            .unwrap();
                    }
                    c.publish(id, &keys).unwrap();
                    live.push(id);
                    if live.len() > 2 || n % 3 == 0 {
                        c.free_request(live.remove(0)).unwrap();
                    }
                }
                for id in live {
                    c.free_request(id).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    c.check_invariants().unwrap();
    let st = c.stats();
    assert_eq!(st.requests, 0);
    assert_eq!(st.used_blocks, 0, "every reference returned");
    assert_eq!(st.in_use_bytes, 0);
    assert_eq!(st.session_bytes, 0);
    assert_eq!(st.cached_blocks + st.free_blocks, st.total_blocks);
    assert!(st.prefix_hits > 0, "sessions shared prefixes");
    assert!(
        st.evictions > 0,
        "the pool was small enough to force evictions"
    );
    assert!(st.allocated_bytes <= st.total_blocks * st.slab_bytes);
    eprintln!(
        "sessions {}, out-of-blocks {}, evictions {}, prefix hits {}/{}",
        next_id.load(Ordering::Relaxed),
        out_of_blocks.load(Ordering::Relaxed),
        st.evictions,
        st.prefix_hits,
        st.prefix_queries
    );
}
