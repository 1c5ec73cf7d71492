//! Injected time. The tiers never read the wall clock themselves: tests and the trace simulator
//! drive a [`ManualClock`], production uses [`SystemClock`].
//!
//! Two readings: [`Clock::now_ms`] is wall-clock time (comparable across processes and restarts,
//! but it can jump when an operator or NTP sets it), [`Clock::monotonic_ms`] never goes backwards
//! and never jumps, but only differences within one process mean anything. The SSD tier measures
//! lifetimes with the monotonic reading while it is open and trusts a wall-clock gap across a
//! restart only up to a bound (see [`crate::store::ssd`], "Store age").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// A source of time in milliseconds.
pub trait Clock: Send + Sync {
    /// Wall-clock milliseconds since an epoch shared by every process (the Unix epoch for
    /// [`SystemClock`]). May jump.
    fn now_ms(&self) -> u64;
    /// Milliseconds since an arbitrary point fixed for this process; never goes backwards and does
    /// not follow wall-clock adjustments. Default: [`Clock::now_ms`] (right for virtual clocks).
    fn monotonic_ms(&self) -> u64 {
        self.now_ms()
    }
}

/// Wall-clock time (milliseconds since the Unix epoch) and a monotonic reading from
/// [`std::time::Instant`] (`CLOCK_MONOTONIC` on Linux: it does not advance while the machine is
/// suspended, so lifetimes measured with it err on the long side).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
    fn monotonic_ms(&self) -> u64 {
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_millis() as u64
    }
}

/// A virtual clock moved by hand (tests, trace replay). Its wall and monotonic readings are the
/// same value, so a test that moves it between two opens of a store simulates a clock jump.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `ms`.
    pub fn new(ms: u64) -> ManualClock {
        ManualClock(AtomicU64::new(ms))
    }
    /// Moves the clock to `ms` if that is later than now (time never goes backwards).
    pub fn set(&self, ms: u64) {
        self.0.fetch_max(ms, Ordering::AcqRel);
    }
    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// One hour in milliseconds.
pub const HOUR_MS: u64 = 3_600_000;
