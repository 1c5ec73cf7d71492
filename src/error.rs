//! One error type for the whole crate, grouped by theme.
//!
//! Inside the crate every fallible function returns [`Result`]; at the C ABI the variant maps to a
//! flat status code (see `ffi`) and the `Display` text becomes the thread-local last error.

use std::path::PathBuf;

/// Every error csa2 can report. Messages carry the offending values so a user can act on them.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- configuration -------------------------------------------------------------------
    /// The config is not JSON at all.
    #[error("config is not valid JSON: {0}")]
    ConfigJson(String),
    /// A required config field is absent.
    #[error("config field `{field}` is missing")]
    ConfigMissing {
        /// JSON path of the field.
        field: String,
    },
    /// A config field has the wrong type or an invalid value.
    #[error("config field `{field}` is invalid: {reason}")]
    ConfigInvalid {
        /// JSON path of the field.
        field: String,
        /// What is wrong, with the value found.
        reason: String,
    },

    // ---- shapes and arguments ---------------------------------------------------------------
    /// A tensor or buffer has the wrong shape or length.
    #[error("{what}: expected {expected}, found {found}")]
    Shape {
        /// Which argument.
        what: String,
        /// What was expected (shape, length, dtype).
        expected: String,
        /// What was found.
        found: String,
    },
    /// An argument is outside its valid range.
    #[error("invalid argument `{name}`: {reason}")]
    Invalid {
        /// Argument name.
        name: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A null pointer was passed where a valid one is required (C ABI).
    #[error("null pointer passed for `{0}`")]
    NullPointer(&'static str),
    /// A C ABI handle is not a live handle of the expected type: already freed, never created,
    /// of another handle type, or a garbage value.
    #[error("invalid handle: {0}")]
    InvalidHandle(String),

    // ---- cache and store -----------------------------------------------------------------
    /// The block pool has no free block left and nothing can be evicted.
    #[error("out of KV blocks: {requested} requested, {free} free, {evictable} evictable")]
    OutOfBlocks {
        /// Blocks asked for.
        requested: usize,
        /// Blocks free now.
        free: usize,
        /// Cached blocks that could be evicted.
        evictable: usize,
    },
    /// A persisted record failed its checksum or is truncated.
    #[error("corrupt record in {path}: {reason}")]
    Corrupt {
        /// File holding the record.
        path: PathBuf,
        /// What check failed.
        reason: String,
    },
    /// A handle, request id or key does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The tier refused a write (admission control: full with nothing evictable).
    #[error("write refused: {0}")]
    Refused(String),
    /// A directory is held by another owner (the SSD tier's writer lock); the message names the
    /// holder. The one error a caller may answer by opening the tier read-only.
    #[error("in use: {0}")]
    Busy(String),

    // ---- io and environment ----------------------------------------------------------------
    /// An I/O error, with the path involved.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// Path involved.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A data file (npy, safetensors, trace) could not be parsed.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// File involved.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A memory allocation whose size came from the caller failed (the process keeps running and
    /// nothing changed).
    #[error("out of memory: {what} needs {bytes} bytes")]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A feature needs something this build or machine lacks (e.g. a CUDA driver).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor on a CUDA device reached an op in a build without the `cuda` feature (the C ABI
    /// reports it as `CSA2_ERR_NO_CUDA_BUILD`; the message says to rebuild with `--features cuda`).
    #[error("built without CUDA support: {0}")]
    NoCudaBuild(String),
    /// A CUDA build whose kernel module cannot be loaded on the device in use (no image for its
    /// compute capability, a driver too old for the PTX, a JIT failure): `CSA2_ERR_CUDA_MODULE`.
    /// Never a reason to move work to the host silently.
    #[error("CUDA kernel module: {0}")]
    CudaModule(String),
    /// A CUDA driver, NVRTC or kernel-launch call failed (feature `cuda`).
    #[error("CUDA {op} failed: {reason}")]
    Cuda {
        /// What was being done (kernel name, copy, module load).
        op: String,
        /// The driver's error text.
        reason: String,
    },
    /// A bug in csa2 (a caught panic, a broken invariant).
    #[error("internal error: {0}")]
    Internal(String),
}

/// Crate-wide result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for a [`Error::Shape`] error.
    pub fn shape(what: impl Into<String>, expected: impl ToString, found: impl ToString) -> Self {
        Error::Shape {
            what: what.into(),
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }
    /// Shorthand for a [`Error::Invalid`] error.
    pub fn invalid(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Invalid {
            name: name.into(),
            reason: reason.into(),
        }
    }
    /// Shorthand for an [`Error::OutOfMemory`] error.
    pub fn oom(what: impl Into<String>, bytes: usize) -> Self {
        Error::OutOfMemory {
            what: what.into(),
            bytes,
        }
    }
    /// Shorthand for an [`Error::Io`] error.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// A vector of `n` copies of `value`, allocated fallibly: [`Error::OutOfMemory`] (naming `what` and
/// the byte count) instead of aborting the process when `n` comes from a caller and is too large.
pub fn try_vec<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| Error::oom(what, bytes))?;
    v.resize(n, value);
    Ok(v)
}
