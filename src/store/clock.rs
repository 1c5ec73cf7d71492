//! Injected time. The tiers never read the wall clock themselves: tests and the trace simulator
//! drive a [`ManualClock`], production uses [`SystemClock`].

use std::sync::atomic::{AtomicU64, Ordering};

/// A source of time in milliseconds since an arbitrary fixed epoch (must not go backwards).
pub trait Clock: Send + Sync {
    /// Milliseconds now.
    fn now_ms(&self) -> u64;
}

/// Wall-clock time (milliseconds since the Unix epoch); persisted timestamps stay meaningful
/// across restarts.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A virtual clock moved by hand (tests, trace replay).
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
