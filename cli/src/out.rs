//! The output conventions every subcommand shares.
//!
//! - `--json PATH` writes the command's numbers as one JSON document; `--json -` writes it to
//!   stdout, and the human-readable report then goes to stderr so stdout parses as JSON.
//! - `--plots DIR` writes the command's SVG plots into DIR (created if missing).
//! - Progress goes to stderr: a bar on a terminal (ticking, so the clock moves during a long
//!   step); plain `progress:` lines every few seconds when stderr is a log file or a pipe
//!   (`CSA2_PROGRESS_SECS`, default 10), because a bar is invisible there.
//! - A closed stdout (`csa2 geometry --json - | head`) ends the process quietly: main restores the
//!   default SIGPIPE action, as `cat` or `grep` behave, instead of a panic in `println!`.

use csa2::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where `--json` goes: a file, or stdout for `-`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonOut {
    /// `--json -`.
    Stdout,
    /// `--json PATH`.
    File(PathBuf),
}

impl std::str::FromStr for JsonOut {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<JsonOut, String> {
        match s {
            "" => Err("give a file path, or `-` for stdout".into()),
            "-" => Ok(JsonOut::Stdout),
            p => Ok(JsonOut::File(PathBuf::from(p))),
        }
    }
}

static HUMAN_TO_STDERR: AtomicBool = AtomicBool::new(false);

/// Runs `f` on a rayon pool of `threads` workers (`--threads`; 0: one per core, rayon's default),
/// so the kernels' parallel loops use the count the command was given.
///
/// Errors: [`Error::Invalid`] naming `threads` when the pool cannot be built.
pub fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::invalid("threads", e.to_string()))?;
    pool.install(f)
}

/// Call first in a command with a `--json` flag: with `--json -` the human report moves to stderr.
/// A file destination is checked before any work (a long run must not end on an unwritable path).
///
/// Errors: [`Error::Io`] naming the path when it cannot be written.
pub fn json_dest(j: &Option<JsonOut>) -> Result<()> {
    HUMAN_TO_STDERR.store(matches!(j, Some(JsonOut::Stdout)), Ordering::Relaxed);
    match j {
        Some(JsonOut::File(p)) => check_writable_file(p),
        _ => Ok(()),
    }
}

/// Call first in a command with a `--plots` flag: creates the directory and checks that a file
/// can be written in it, before any work.
///
/// Errors: [`Error::Io`] naming the directory when it cannot be created or written.
pub fn plots_dest(dir: &Option<PathBuf>) -> Result<()> {
    let Some(dir) = dir else { return Ok(()) };
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let probe = dir.join(format!(".csa2-write-check-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(|e| Error::io(dir, e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Opens `p` for writing without truncating it; a file that did not exist is removed again.
fn check_writable_file(p: &Path) -> Result<()> {
    if p.is_dir() {
        return Err(Error::io(
            p,
            std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory"),
        ));
    }
    let existed = p.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
        .map_err(|e| Error::io(p, e))?;
    if !existed {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// `n` and the noun, plural unless `n` is 1 ("1 block", "2 blocks").
pub fn plural(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// Value parser of a count that must be ≥ 1 (`--chunk`, `--limit`, ...): says so for 0 and for a
/// negative number (the flag takes `allow_negative_numbers`, so clap hands `-5` over as a value).
pub fn positive_count(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if v >= 1 => usize::try_from(v).map_err(|_| format!("{v} is too large")),
        Ok(v) => Err(format!("must be a positive whole number (≥ 1), found {v}")),
        Err(_) => Err(format!("expected a positive whole number, found `{s}`")),
    }
}

/// Value parser of a count that may be 0 (`--threads`, `--warmup`, a seed, ...): says so for a
/// negative number.
pub fn count<T: TryFrom<i128>>(s: &str) -> std::result::Result<T, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if v >= 0 => T::try_from(v).map_err(|_| format!("{v} is too large")),
        Ok(v) => Err(format!("must be 0 or more, found {v}")),
        Err(_) => Err(format!("expected a whole number ≥ 0, found `{s}`")),
    }
}

/// Value parser of a finite quantity > 0 (GiB, seconds, scales).
pub fn positive_f64(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("must be a positive number, found {v}")),
        Err(_) => Err(format!("expected a positive number, found `{s}`")),
    }
}

/// Value parser of a finite quantity ≥ 0.
pub fn non_negative_f64(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("must be a number ≥ 0, found {v}")),
        Err(_) => Err(format!("expected a number ≥ 0, found `{s}`")),
    }
}

/// Whether human-readable lines go to stderr (stdout carries the JSON document).
pub fn human_to_stderr() -> bool {
    HUMAN_TO_STDERR.load(Ordering::Relaxed)
}

/// `println!` for the human-readable report: stdout, or stderr when stdout carries `--json -`.
macro_rules! say {
    () => {
        if $crate::out::human_to_stderr() { eprintln!() } else { println!() }
    };
    ($($t:tt)*) => {
        if $crate::out::human_to_stderr() { eprintln!($($t)*) } else { println!($($t)*) }
    };
}

/// Writes `v` as pretty JSON to the `--json` destination; a file write says where it went.
pub fn write_json<T: Serialize + ?Sized>(dest: &Option<JsonOut>, v: &T) -> Result<()> {
    let Some(dest) = dest else { return Ok(()) };
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Error::Internal(format!("report to JSON: {e}")))?;
    match dest {
        JsonOut::Stdout => {
            use std::io::Write;
            let mut so = std::io::stdout().lock();
            writeln!(so, "{text}")
                .and_then(|_| so.flush())
                .map_err(|e| Error::io(Path::new("<stdout>"), e))?;
        }
        JsonOut::File(p) => {
            std::fs::write(p, text).map_err(|e| Error::io(p, e))?;
            say!("wrote {}", p.display());
        }
    }
    Ok(())
}

/// Creates the `--plots` directory and returns the path of `name` in it.
pub fn plot_path(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    Ok(dir.join(name))
}

/// Seconds between plain progress lines when stderr is not a terminal.
fn plain_interval() -> Duration {
    let secs = std::env::var("CSA2_PROGRESS_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(10.0);
    Duration::from_secs_f64(secs)
}

struct Plain {
    label: String,
    pos: u64,
    len: u64,
    msg: String,
    last_line: Instant,
}

impl Plain {
    fn line(&mut self, started: Instant) {
        eprintln!(
            "progress: {} {}/{} {:.0} s{}{}",
            self.label,
            self.pos,
            self.len,
            started.elapsed().as_secs_f64(),
            if self.msg.is_empty() { "" } else { "  " },
            self.msg
        );
        self.last_line = Instant::now();
    }
}

/// Progress on stderr: an indicatif bar on a terminal, periodic plain lines otherwise.
pub struct Progress {
    bar: Option<ProgressBar>,
    plain: Arc<Mutex<Plain>>,
    started: Instant,
    stop: Arc<AtomicBool>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    /// `label` names the work in plain lines; `template` is the bar's indicatif template.
    pub fn new(label: &str, len: u64, template: &str) -> Progress {
        let started = Instant::now();
        let plain = Arc::new(Mutex::new(Plain {
            label: label.to_string(),
            pos: 0,
            len,
            msg: String::new(),
            last_line: started,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(len);
            bar.set_style(
                ProgressStyle::with_template(template)
                    .expect("static template")
                    .progress_chars("=> "),
            );
            // Redraw on a timer so `{elapsed}` moves while one long step runs.
            bar.enable_steady_tick(Duration::from_millis(500));
            return Progress {
                bar: Some(bar),
                plain,
                started,
                stop,
                ticker: None,
            };
        }
        let every = plain_interval();
        let (p, s) = (plain.clone(), stop.clone());
        let ticker = std::thread::Builder::new()
            .name("csa2-progress".into())
            .spawn(move || {
                let nap = every.min(Duration::from_millis(200));
                while !s.load(Ordering::Relaxed) {
                    std::thread::park_timeout(nap);
                    let mut g = p.lock().unwrap_or_else(|e| e.into_inner());
                    if !s.load(Ordering::Relaxed) && g.last_line.elapsed() >= every {
                        g.line(started);
                    }
                }
            })
            .ok();
        Progress {
            bar: None,
            plain,
            started,
            stop,
            ticker,
        }
    }

    fn with<F: FnOnce(&mut Plain)>(&self, f: F) {
        let mut g = self.plain.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g);
    }

    /// The current stage; a plain line is printed at once when it changes (at most one a second).
    pub fn set_message(&self, m: impl Into<String>) {
        let m = m.into();
        if let Some(b) = &self.bar {
            b.set_message(m);
            return;
        }
        let started = self.started;
        self.with(|g| {
            if g.msg != m {
                g.msg = m;
                if g.last_line.elapsed() >= Duration::from_secs(1) || g.pos == 0 {
                    g.line(started);
                }
            }
        });
    }

    /// Advances by `n`.
    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc(n);
        }
        self.with(|g| g.pos += n);
    }

    /// Sets the position.
    pub fn set_position(&self, p: u64) {
        if let Some(b) = &self.bar {
            b.set_position(p);
        }
        self.with(|g| g.pos = p);
    }

    /// Clears the bar (terminal) or prints a last plain line, and stops the ticker.
    pub fn finish(mut self) {
        self.stop_ticker();
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None => {
                let started = self.started;
                self.with(|g| {
                    g.msg = "done".into();
                    g.line(started)
                });
            }
        }
    }

    fn stop_ticker(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop_ticker();
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// The harness's A/B driver reports its stages and steps on the bar.
impl csa2_harness::ab::Progress for Progress {
    fn stage(&self, what: &str) {
        self.set_message(what);
    }
    fn step(&self) {
        self.inc(1);
    }
}
