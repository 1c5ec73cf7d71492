//! Seeded fuzzing of the C ABI boundary and replay of both corpora; the harness itself (case
//! templates, mutations, invariants) is `tests/fuzz_harness/mod.rs`, shared with the cargo-fuzz
//! target in `fuzz/` (docs/FUZZ.md).

mod fuzz_harness;

use csa2::ffi::*;
use fuzz_harness::*;
use std::collections::BTreeSet;

#[test]
fn fuzz_ops_boundary() {
    let iters: u64 = std::env::var("CSA2_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let first: u64 = std::env::var("CSA2_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let save = std::env::var("CSA2_FUZZ_SAVE").is_ok_and(|v| v == "1");
    let x = Ctx::new();
    let mut seen = BTreeSet::new();
    let mut per_export = [[0u64; 2]; EXPORTS.len()];
    let start = std::time::Instant::now();
    // Of every 15 executions, 14 alternate the first two families (execution k of them runs seed
    // k / 2 of the first family for even k, of the second for odd k, as before the third family
    // existed) and one runs the next seed of the third (one export against their seven each).
    for i in first..first + iters {
        let seed = match i % 15 {
            14 => (i / 15) | FAMILY3,
            j => {
                let k = i / 15 * 14 + j;
                (k / 2) | if k % 2 == 1 { FAMILY2 } else { 0 }
            }
        };
        let (c, st) = run(seed, &x);
        per_export[c.export][(st == Csa2Status::Csa2Ok) as usize] += 1;
        if save {
            // The first refused single-mutation case of every (export, mutation kind).
            let key = (c.export, c.kinds.first().copied());
            if c.kinds.len() == 1 && st != Csa2Status::Csa2Ok && seen.insert(key) {
                let text = format!(
                    "export={}\nseed={seed}\nstatus={}\nmutations={}\n",
                    EXPORTS[c.export],
                    st as i32,
                    c.mutations.join("; ")
                );
                std::fs::create_dir_all(corpus_dir()).unwrap();
                std::fs::write(
                    corpus_dir().join(format!("{}-{seed}.case", EXPORTS[c.export])),
                    text,
                )
                .unwrap();
            }
        }
    }
    drop(x);
    eprintln!(
        "ffi fuzz: {iters} executions ({first}..{}), {:.1} s, 0 crashes; per export [errors, ok]:",
        first + iters,
        start.elapsed().as_secs_f64()
    );
    for (e, n) in EXPORTS.iter().zip(per_export) {
        eprintln!("  {e:17} {n:?}");
    }
    // Every export saw both accepted and refused calls.
    if iters >= 1000 {
        for (e, n) in EXPORTS.iter().zip(per_export) {
            assert!(n[0] > 0 && n[1] > 0, "{e}: {n:?}");
        }
    }
}

#[test]
fn corpus_replays() {
    let x = Ctx::new();
    let mut n = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("tests/fuzz_corpus") {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "case") {
            continue; // libfuzzer/: replayed by `libfuzzer_corpus_replays`
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{}: no `{k}=`", path.display()))
                .to_string()
        };
        let seed: u64 = field("seed").parse().unwrap();
        let (c, st) = run(seed, &x);
        let ctx = format!("{}", path.display());
        assert_eq!(EXPORTS[c.export], field("export"), "{ctx}: case drifted");
        assert_eq!(
            c.mutations.join("; "),
            field("mutations"),
            "{ctx}: case drifted"
        );
        assert_eq!((st as i32).to_string(), field("status"), "{ctx}");
        n += 1;
    }
    assert!(n >= 10, "corpus has only {n} cases");
}

/// The coverage-guided corpus that `cargo fuzz run c_abi` grew and merged (docs/FUZZ.md): every
/// input must still pass the harness's invariants, without libFuzzer.
#[test]
fn libfuzzer_corpus_replays() {
    let x = Ctx::new();
    let dir = corpus_dir().join("libfuzzer");
    let mut n = 0;
    let mut exports = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).expect("tests/fuzz_corpus/libfuzzer") {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        let (c, _) = run_bytes(&data, &x);
        exports.insert(c.export);
        n += 1;
    }
    assert!(n >= 100, "libFuzzer corpus has only {n} inputs");
    assert_eq!(
        exports.len(),
        EXPORTS.len(),
        "some export is not in the corpus"
    );
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Handle misuse (C ABI finding 7): seeded call sequences over live, freed, foreign-typed,
/// null and garbage handle values (`tests/fuzz_harness/lifecycle.rs`). `CSA2_FUZZ_HANDLE_SEQS`
/// sequences (default 200) of 100 calls from seed `CSA2_FUZZ_SEED`.
#[test]
fn fuzz_handle_misuse() {
    let seqs = env_u64("CSA2_FUZZ_HANDLE_SEQS", 200);
    let first = env_u64("CSA2_FUZZ_SEED", 0);
    let start = std::time::Instant::now();
    let mut t = lifecycle::Tally::default();
    for s in first..first + seqs {
        t.add(&lifecycle::run_seed(s, 100));
    }
    eprintln!(
        "handle fuzz: {seqs} sequences, {} calls, {:.1} s, 0 crashes, 0 panics; {t:?}",
        t.calls,
        start.elapsed().as_secs_f64()
    );
    // Every class of outcome occurred.
    if seqs >= 50 {
        assert!(
            t.ok > 0 && t.invalid_handle > 0 && t.null_pointer > 0 && t.other_errors > 0,
            "{t:?}"
        );
    }
}

/// Concurrent calls (C ABI findings 5 and 7): `CSA2_FUZZ_THREADS` threads (default 4) ×
/// `CSA2_FUZZ_CONCURRENT_STEPS` calls (default 3000) on shared caches while one thread frees and
/// recreates one of them.
#[test]
fn fuzz_concurrent_calls() {
    let threads = env_u64("CSA2_FUZZ_THREADS", 4) as usize;
    let steps = env_u64("CSA2_FUZZ_CONCURRENT_STEPS", 3000) as usize;
    let seed = env_u64("CSA2_FUZZ_SEED", 0);
    let start = std::time::Instant::now();
    let t = lifecycle::run_concurrent(seed, threads, steps);
    eprintln!(
        "concurrent fuzz: {threads} threads, {} calls, {:.1} s, 0 crashes, 0 panics; {t:?}",
        t.calls,
        start.elapsed().as_secs_f64()
    );
    assert!(t.ok > 0 && t.invalid_handle > 0, "{t:?}");
}
