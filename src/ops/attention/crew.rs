//! A two-phase task crew for one token's attention: a serial prologue (the query conversion,
//! while the helpers wake up), the row chunks (scores), one serial step (the chunk merge), then
//! the dim slices (P·V), on this thread and up to `threads − 1` pool workers that claim task
//! indices from one counter.
//!
//! Why not a rayon scope per phase: on a 2-vCPU VM a rayon fork/join from outside the pool costs
//! 17–45 µs (waking a worker, then waking this thread back on a futex when the worker finishes),
//! and a decode token's whole attention is ~0.3 ms. Here this thread never blocks on a worker:
//! it starts on the tasks at once, helpers join when the OS wakes them, one set of helpers serves
//! both phases (no second wake-up), and at the end this thread spins only on tasks that a running
//! helper has already claimed. A helper that starts late finds the counter exhausted and leaves
//! without touching the borrowed task closure, so this thread never waits for a helper to start.
//!
//! Which thread runs a task never changes its arithmetic: results do not depend on the thread
//! count (batch invariance, `tests/batch_invariance.rs`).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The task closure with its lifetime erased, so that a `'static` rayon job can hold it.
type TaskFn = dyn Fn(usize) + Sync;

struct Crew {
    /// The next unclaimed task index (phase one: `0..first`, phase two: `first..total`).
    next: AtomicUsize,
    /// Tasks finished. Phase-two tasks start only after `open`, which this thread sets once all
    /// of phase one is finished, so `done ≥ first` means phase one is complete.
    done: AtomicUsize,
    /// Phase one may start (the prologue ran).
    start: AtomicBool,
    /// Phase two may start (the serial step ran).
    open: AtomicBool,
    first: usize,
    total: usize,
    /// Valid while `done < total`: the owner does not return before every claimed task is done,
    /// and a participant dereferences it only for a claimed index `< total`.
    f: *const TaskFn,
    /// The first panic of a task, re-raised on this thread once every task has settled.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    failed: AtomicBool,
}

// SAFETY: `f` points to a `Sync` closure that outlives every dereference (see the field's rule);
// the other fields are atomics and a mutex.
unsafe impl Send for Crew {}
// SAFETY: as above.
unsafe impl Sync for Crew {}

impl Crew {
    /// Runs task `k` (already claimed), recording a panic instead of unwinding through the crew.
    fn run(&self, k: usize) {
        if !self.failed.load(Ordering::Acquire) {
            // SAFETY: `k < total` was claimed by this participant and is not yet counted in
            // `done`, so the owner is still waiting and `f`'s referent is alive.
            let f = unsafe { &*self.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(k))) {
                self.fail(p);
            }
        }
        self.done.fetch_add(1, Ordering::AcqRel);
    }

    /// Records a panic (the first one is kept); the later steps are skipped.
    fn fail(&self, p: Box<dyn std::any::Any + Send>) {
        self.failed.store(true, Ordering::Release);
        let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(p);
    }

    /// A helper's loop: claim, wait for the index's phase to open, run.
    fn help(&self) {
        loop {
            let k = self.next.fetch_add(1, Ordering::AcqRel);
            if k >= self.total {
                return;
            }
            let gate = if k >= self.first {
                &self.open
            } else {
                &self.start
            };
            wait_until(|| gate.load(Ordering::Acquire));
            self.run(k);
        }
    }
}

/// Spins until `ready()`: the waits here are for a task already running on another thread (tens of
/// µs), shorter than a futex round trip. Past 4,096 pauses (tens of µs), the thread that should
/// finish it has probably lost its core (more runnable threads than cores), so the wait yields
/// the core at each check instead of burning it (a yield with nothing else runnable returns at
/// once).
fn wait_until(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        if spins < 1 << 12 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Runs `prologue()` on this thread (the helpers are already asked for and wake meanwhile), then
/// `f(0) .. f(first − 1)`, then `between()` once on this thread after all of them have finished,
/// then `f(first) .. f(first + second − 1)`; each task once, on this thread and (with `help`) on
/// up to `min(threads, tasks) − 1` pool workers. Returns after every task has finished. A panic
/// in the prologue, a task or `between` is re-raised here after the others have settled (the
/// later steps are then skipped).
///
/// The closures must not enter rayon (no join, scope, parallel iterator or `yield_now`): a worker
/// waiting inside such a call could run a helper of this same crew, which could claim a phase-two
/// index and spin on the gate while the phase-one task it sits on top of never finishes.
pub(super) fn run_phases(
    prologue: impl FnOnce(),
    first: usize,
    between: impl FnOnce(),
    second: usize,
    help: bool,
    f: impl Fn(usize) + Sync,
) {
    let total = first + second;
    let helpers = if help {
        rayon::current_num_threads()
            .min(first.max(second))
            .saturating_sub(1)
    } else {
        0
    };
    let f: &(dyn Fn(usize) + Sync + '_) = &f;
    // SAFETY: only the lifetime is erased; see `Crew::f` for why no dereference outlives `f`.
    let f: *const TaskFn =
        unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static TaskFn>(f) };
    let crew = Arc::new(Crew {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        start: AtomicBool::new(false),
        open: AtomicBool::new(false),
        first,
        total,
        f,
        panic: Mutex::new(None),
        failed: AtomicBool::new(false),
    });
    for _ in 0..helpers {
        let c = Arc::clone(&crew);
        rayon::spawn(move || c.help());
    }
    if let Err(p) = catch_unwind(AssertUnwindSafe(prologue)) {
        crew.fail(p);
    }
    crew.start.store(true, Ordering::Release);
    let mut between = Some(between);
    loop {
        let k = crew.next.fetch_add(1, Ordering::AcqRel);
        if k >= first && !crew.open.load(Ordering::Relaxed) {
            // Every phase-one index is claimed: wait for the ones still running, then the serial
            // step, then open phase two.
            wait_until(|| crew.done.load(Ordering::Acquire) >= first);
            if !crew.failed.load(Ordering::Acquire) {
                if let Some(b) = between.take() {
                    if let Err(p) = catch_unwind(AssertUnwindSafe(b)) {
                        crew.fail(p);
                    }
                }
            }
            crew.open.store(true, Ordering::Release);
        }
        if k >= total {
            break;
        }
        crew.run(k);
    }
    // Only tasks a running participant has claimed remain: short spins, no futex wake-up.
    wait_until(|| crew.done.load(Ordering::Acquire) >= total);
    let p = crew.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(p) = p {
        resume_unwind(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task runs exactly once, phase one only after the prologue, phase two only after
    /// `between`, which runs once after all of phase one; with and without helpers, from outside
    /// the pool and from inside a pool job.
    #[test]
    fn each_task_once_and_in_phase_order() {
        for (first, second) in [(0usize, 0usize), (1, 0), (0, 1), (2, 3), (10, 8), (64, 7)] {
            for help in [false, true] {
                for inside in [false, true] {
                    let hits: Vec<AtomicUsize> =
                        (0..first + second).map(|_| AtomicUsize::new(0)).collect();
                    let finished_first = AtomicUsize::new(0);
                    let seen_at_between = AtomicUsize::new(usize::MAX);
                    let prologue_done = AtomicBool::new(false);
                    let before_prologue = AtomicBool::new(false);
                    let early = AtomicBool::new(false);
                    let opened = AtomicBool::new(false);
                    let go = || {
                        run_phases(
                            || {
                                // Long enough for a helper to wake and claim an index.
                                std::hint::black_box((0..20000).sum::<u64>());
                                prologue_done.store(true, Ordering::Release);
                            },
                            first,
                            || {
                                let f = finished_first.load(Ordering::Acquire);
                                seen_at_between.store(f, Ordering::Relaxed);
                                opened.store(true, Ordering::Release);
                            },
                            second,
                            help,
                            |k| {
                                if !prologue_done.load(Ordering::Acquire) {
                                    before_prologue.store(true, Ordering::Relaxed);
                                }
                                if k >= first && !opened.load(Ordering::Acquire) {
                                    early.store(true, Ordering::Relaxed);
                                }
                                // A little work, so that helpers get to claim some tasks.
                                std::hint::black_box((0..2000).sum::<u64>());
                                hits[k].fetch_add(1, Ordering::Relaxed);
                                if k < first {
                                    finished_first.fetch_add(1, Ordering::AcqRel);
                                }
                            },
                        )
                    };
                    if inside {
                        rayon::scope(|_| go());
                    } else {
                        go();
                    }
                    let case = format!("{first}+{second}, help {help}, inside {inside}");
                    for (k, h) in hits.iter().enumerate() {
                        assert_eq!(h.load(Ordering::Relaxed), 1, "{case}: task {k}");
                    }
                    assert!(
                        !before_prologue.load(Ordering::Relaxed),
                        "{case}: before prologue"
                    );
                    assert!(!early.load(Ordering::Relaxed), "{case}: phase two early");
                    let at = seen_at_between.load(Ordering::Relaxed);
                    assert!(at == first, "{case}: between saw {at} finished");
                }
            }
        }
    }

    /// A long task on a helper: the caller's waits pass from spinning to yielding and still end
    /// when the task does, with every task run once.
    #[test]
    fn long_waits_yield_and_finish() {
        for help in [false, true] {
            let hits: Vec<AtomicUsize> = (0..6).map(|_| AtomicUsize::new(0)).collect();
            run_phases(
                || {},
                3,
                || {},
                3,
                help,
                |k| {
                    if k == 0 || k == 3 {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                    hits[k].fetch_add(1, Ordering::Relaxed);
                },
            );
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    /// A panic in a task, the prologue or `between` surfaces on the caller after the others
    /// settle, the later serial steps are skipped, and the crew still returns (no helper left
    /// spinning on a phase that never opens).
    #[test]
    fn a_panic_reaches_the_caller() {
        for (at, help) in [(0, false), (0, true), (1, false), (1, true), (2, true)] {
            let ran_between = AtomicBool::new(false);
            let r = catch_unwind(AssertUnwindSafe(|| {
                run_phases(
                    || {
                        if at == 0 {
                            panic!("prologue");
                        }
                    },
                    6,
                    || {
                        if at == 2 {
                            panic!("between");
                        }
                        ran_between.store(true, Ordering::Relaxed)
                    },
                    4,
                    help,
                    |k| {
                        if at == 1 && k == 3 {
                            panic!("task 3");
                        }
                    },
                )
            }));
            let msg = r.expect_err("the panic surfaces");
            let want = ["prologue", "task 3", "between"][at];
            assert_eq!(msg.downcast_ref::<&str>(), Some(&want));
            assert!(
                !ran_between.load(Ordering::Relaxed),
                "between skipped after a failure"
            );
        }
    }
}
