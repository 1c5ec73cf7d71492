//! The engine over the C ABI: [`crate::backend::Backend`] (the 40-layer stack with mHC, layer
//! modes over the KV cache) with its own KV cache, the same Rust engine `csa2 run` drives.
//!
//! A C caller creates an engine from a scale and weights ([`csa2_engine_create`]: synthetic
//! weights generated in memory, or a checkpoint directory in the released naming), then runs steps
//! of prefill chunks and decode tokens of many requests ([`csa2_engine_step`]: token ids in, the
//! final hidden state of the step's output rows out, both as borrowed DLPack tensors checked
//! against the step's one signature, `backend::signature::STEP`). Between turns of a request the caller either
//! keeps everything (the next step continues), suspends it ([`csa2_engine_suspend`]: the encoder
//! layers' SWA windows and the compressor carries are kept aside, every live window and carry is
//! dropped, global KV stays; [`csa2_engine_resume`] restores them or discards them on a snapshot
//! miss), or frees it ([`csa2_engine_free_request`]).
//!
//! # Rows, positions and replay
//! A step is a list of [`Csa2EngineSeq`]s, one per request, each `len` rows at positions
//! `first_pos ..`; the tokens are laid out request after request. What the fields mean and which
//! combinations are valid is `replay::SeqStep` (docs/SPEC.md §3): a prefix hit is
//! `cached_until`, an encoder bounded replay starts the prefill at `prefill_start` with window floor
//! `replay_start`. With decoder bounded replay on (the CSA2 default), a prefill chunk outputs only
//! its last `min(len, window)` rows; decode rows always output.
//!
//! # Errors and state
//! Every argument is checked before the step runs (the handle, the args struct, the enum values,
//! the step's rows against the geometry, the token count, the output capacity): such an error
//! changes nothing. An error raised while the step runs (`CSA2_ERR_OUT_OF_BLOCKS` when the paged
//! pool is full, a request whose stored entries the step's rows do not continue) may leave the
//! requests of that step partly advanced: free them ([`csa2_engine_free_request`]) before reusing
//! their ids. A panic inside the engine (a csa2 bug) is reported as `CSA2_ERR_PANIC` and the
//! engine refuses every later call but `csa2_engine_free` with `CSA2_ERR_INTERNAL`, since its
//! cache may be half written.
//!
//! # Thread safety
//! Calls on one engine are serialized by its lock (a step uses the crate's thread pool inside);
//! calls on different engines run concurrently. `csa2_engine_free` may race other calls, as for
//! every handle.

use super::dlpack::{check_disjoint, fill_floats, DLTensor, View};
use super::geometry::Csa2Geometry;
use super::handle;
use super::{arg_out, arg_slice, guarded, guarded_free, read_args, Csa2Status};
use crate::backend::cache::SwaSnapshot;
use crate::backend::launch_day::LAUNCH_DAY;
use crate::backend::signature as sig;
use crate::backend::timing::Timings;
use crate::backend::{
    Backend, BackendConfig, ContiguousCache, KvCache, Model, PagedCache, Phase, SeqStep, StepPlan,
};
use crate::cache::{CacheManager, RequestId};
use crate::error::{Error, Result};
use crate::ops::compressor::CompressorState;
use crate::replay::ReplayMode;
use crate::shape::Dims;
use crate::store::TierPolicy;
use crate::weights::Scale;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::path::Path;
use std::sync::Arc;

/// Model scale of [`Csa2EngineCreateArgs::scale`] (pass as `int32_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2ModelScale {
    /// hidden 256, 4 query heads; head dims, record formats and the 40-layer plan as released.
    Csa2ScaleTiny = 0,
    /// The released DeepSeek-V4.1-Flash geometry (hidden 5120, 64 heads).
    Csa2ScaleFull = 1,
}

/// Backend configuration of [`Csa2EngineCreateArgs::backend`] (pass as `int32_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2BackendKind {
    /// The V4.1 design: NVFP4-DS main KV, MXFP4 index K, MXFP8 SWA, pooled Reindex, fused mHC.
    Csa2BackendCsa2 = 0,
    /// The configuration vLLM first shipped (docs/SPEC.md §5).
    Csa2BackendLaunchDay = 1,
}

/// KV cache of [`Csa2EngineCreateArgs::cache`] (pass as `int32_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2EngineCacheKind {
    /// The paged block manager (block tables, slot mapping, block-planar pages, 256-token blocks).
    Csa2EngineCachePaged = 0,
    /// One growing buffer per request and layer (same outputs bit for bit).
    Csa2EngineCacheContiguous = 1,
}

/// Phase of a [`Csa2EngineSeq`] (pass as `int32_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2EnginePhase {
    /// A chunk of prompt rows.
    Csa2PhasePrefill = 0,
    /// One generated token (`len` = 1).
    Csa2PhaseDecode = 1,
}

/// Arguments of [`csa2_engine_create`]. Set `struct_size` to `sizeof(Csa2EngineCreateArgs)`
/// (rules: "Args structs", header top); members left zero take the defaults `csa2 run` uses.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2EngineCreateArgs {
    /// `sizeof(Csa2EngineCreateArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `Csa2ModelScale` (0 = tiny).
    pub scale: i32,
    /// NUL-terminated UTF-8 path of a checkpoint directory (released naming; its `config.json`, if
    /// present, must describe `scale`'s geometry), or null for synthetic weights.
    pub weights_dir: *const c_char,
    /// Seed of the synthetic weights (ignored with `weights_dir`; `csa2 run` uses 1).
    pub seed: u64,
    /// `Csa2BackendKind` (0 = CSA2).
    pub backend: i32,
    /// Non-zero: decoder bounded replay off (every decoder row of a prefill runs).
    pub no_decoder_replay: i32,
    /// `Csa2EngineCacheKind` (0 = paged).
    pub cache: i32,
    /// Paged cache: blocks of 256 tokens in the pool (1 ..= 2^24; needed unless contiguous).
    pub num_blocks: usize,
}
args_struct!(Csa2EngineCreateArgs);

/// The rows of one request in a step (see `replay::SeqStep`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2EngineSeq {
    /// Request id (opened in the engine's cache on its first step).
    pub req: u64,
    /// Absolute position of the first row.
    pub first_pos: u64,
    /// Rows in this step (1 for decode).
    pub len: u64,
    /// `Csa2EnginePhase`.
    pub phase: i32,
    /// Prefill: one past the last prompt position (the prompt length). Decode: ignored.
    pub prompt_end: u64,
    /// Prefill: the first position this prefill computes (0 cold; H − window on an encoder
    /// replay; H on a prefix hit whose snapshot was restored). Decode: ignored.
    pub prefill_start: u64,
    /// Window floor from an encoder replay; 0 when none.
    pub replay_start: u64,
    /// Tokens below this position already have their global entries in the cache.
    pub cached_until: u64,
}

/// Arguments of [`csa2_engine_step`]. Set `struct_size` to `sizeof(Csa2EngineStepArgs)`.
/// Tensors are borrowed DLPack descriptors (signature: `backend::signature::STEP`), host memory,
/// compact row-major, no output overlapping another argument.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2EngineStepArgs {
    /// `sizeof(Csa2EngineStepArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `n_seqs` requests of the step (each request at most once).
    pub seqs: *const Csa2EngineSeq,
    /// Entries at `seqs` (≥ 1).
    pub n_seqs: usize,
    /// `[T]` int32 or int64 token ids (`0 ..= UINT32_MAX`), one per row (T = the sum of the
    /// `len`s), requests in `seqs` order, each request's rows in position order.
    pub tokens: *const DLTensor,
    /// Output `[rows, hidden_size]` float32 (bit-exact) or bfloat16 / float16 (rounded to
    /// nearest even): the final hidden state of the output rows, requests in `seqs` order,
    /// positions ascending. Null: count only (the step is planned, not run; `positions` and
    /// `requests`, if given, are still written).
    pub hidden: *const DLTensor,
    /// Optional output `[rows]` int64: the position of each output row.
    pub positions: *const DLTensor,
    /// Optional output `[rows]` int64: the request id of each output row (the id's 64 bits).
    pub requests: *const DLTensor,
}
args_struct!(Csa2EngineStepArgs);

/// Bytes and counts of an engine's KV cache (`backend::cache::CacheUsage`, measured from the
/// allocations), plus the paged pool's blocks.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2EngineStats {
    /// Live requests.
    pub requests: u64,
    /// Main-KV record bytes in use.
    pub main_bytes: u64,
    /// Index-K record bytes in use.
    pub index_bytes: u64,
    /// Bytes allocated for global KV (paged: slab bytes of the blocks in use).
    pub global_allocated: u64,
    /// SWA window bytes allocated.
    pub swa_bytes: u64,
    /// Compressor carry bytes (the open groups' kv and score rows).
    pub carry_bytes: u64,
    /// Paged: blocks in the pool (0 for the contiguous cache).
    pub total_blocks: u64,
    /// Paged: blocks referenced by a live request (0 for the contiguous cache).
    pub used_blocks: u64,
    /// Requests suspended by [`csa2_engine_suspend`] and not yet resumed.
    pub suspended: u64,
}

/// The engine's KV cache, one of the two implementations of the engine's cache trait.
enum EngineCache {
    Paged(PagedCache),
    Contiguous(ContiguousCache),
}

impl EngineCache {
    fn get(&mut self) -> &mut dyn KvCache {
        match self {
            EngineCache::Paged(p) => p,
            EngineCache::Contiguous(c) => c,
        }
    }
    fn get_ref(&self) -> &dyn KvCache {
        match self {
            EngineCache::Paged(p) => p,
            EngineCache::Contiguous(c) => c,
        }
    }
    fn manager(&self) -> Option<&Arc<CacheManager>> {
        match self {
            EngineCache::Paged(p) => Some(p.manager()),
            EngineCache::Contiguous(_) => None,
        }
    }
}

/// What [`csa2_engine_suspend`] keeps of a request: its encoder windows and carries.
struct Suspended {
    swa: SwaSnapshot,
    carries: Vec<(usize, Option<CompressorState>)>,
}

struct EngineState {
    cache: EngineCache,
    suspended: HashMap<RequestId, Suspended>,
    /// Set while a call mutates the cache; still set afterwards only if that call panicked.
    dirty: bool,
}

/// Opaque engine handle: a `backend::Backend` and its KV cache. Free with [`csa2_engine_free`].
pub struct Csa2Engine {
    backend: Backend,
    /// Layers whose windows a suspend keeps (the tier policy's snapshot layers: the encoder).
    snapshot_layers: Vec<usize>,
    /// KV-source layers (those with a compressor carry).
    kv_layers: Vec<usize>,
    state: Mutex<EngineState>,
}

handle_type!(Csa2Engine, 0xC8);

impl Csa2Engine {
    /// Runs `f` on the engine's state under its lock; refuses an engine a panic left half written.
    fn with<T>(&self, f: impl FnOnce(&Backend, &mut EngineState) -> Result<T>) -> Result<T> {
        let mut st = self.state.lock();
        if st.dirty {
            return Err(Error::Internal(
                "the engine's cache may be half written after a panic in an earlier call; \
                 free the engine"
                    .into(),
            ));
        }
        st.dirty = true;
        let r = f(&self.backend, &mut st);
        // Reached unless `f` panicked (then `dirty` stays set and the lock is released by unwinding).
        st.dirty = false;
        r
    }
}

fn engine(e: *const Csa2Engine) -> Result<Arc<Csa2Engine>> {
    handle::get(e, "engine")
}

fn enum_arg<T: Copy>(name: &str, v: i32, values: &[(i32, T)]) -> Result<T> {
    values
        .iter()
        .find(|(k, _)| *k == v)
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            Error::invalid(
                name,
                format!(
                    "unknown value {v} (expected one of {:?})",
                    values.iter().map(|(k, _)| *k).collect::<Vec<_>>()
                ),
            )
        })
}

/// Creates an engine: the model (synthetic weights of `scale` seeded `seed`, or the checkpoint at
/// `weights_dir`), the backend configuration and an empty KV cache, as `csa2 run` builds them
/// (synthetic full-scale layers of one role and ratio share weights, as there).
///
/// Errors: `CSA2_ERR_NULL_POINTER` (`args`, `out`), `CSA2_ERR_INVALID_ARGUMENT` (`struct_size`,
/// an unknown enum value, `num_blocks` 0 or above 2^24 for a paged cache, a path that is not
/// UTF-8), the checkpoint's errors (`CSA2_ERR_IO`, `CSA2_ERR_PARSE`, `CSA2_ERR_NOT_FOUND` naming a
/// missing tensor, `CSA2_ERR_INVALID_ARGUMENT` for a checkpoint of another geometry),
/// `CSA2_ERR_OUT_OF_MEMORY`. `*out` is untouched on error.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2EngineCreateArgs`; a non-null `weights_dir` a
/// NUL-terminated string; `out` a writable pointer slot.
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_create(
    args: *const Csa2EngineCreateArgs,
    out: *mut *mut Csa2Engine,
) -> Csa2Status {
    guarded("csa2_engine_create", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let a = unsafe { read_args(args) }?;
        // SAFETY: a writable slot is the caller's contract; null is checked.
        let out = unsafe { arg_out(out, "out") }?;
        let scale = enum_arg(
            "scale",
            a.scale,
            &[
                (Csa2ModelScale::Csa2ScaleTiny as i32, Scale::Tiny),
                (Csa2ModelScale::Csa2ScaleFull as i32, Scale::Full),
            ],
        )?;
        let cfg = enum_arg(
            "backend",
            a.backend,
            &[
                (Csa2BackendKind::Csa2BackendCsa2 as i32, BackendConfig::CSA2),
                (Csa2BackendKind::Csa2BackendLaunchDay as i32, LAUNCH_DAY),
            ],
        )?;
        let paged = enum_arg(
            "cache",
            a.cache,
            &[
                (Csa2EngineCacheKind::Csa2EngineCachePaged as i32, true),
                (Csa2EngineCacheKind::Csa2EngineCacheContiguous as i32, false),
            ],
        )?;
        let cfg = if a.no_decoder_replay != 0 {
            cfg.with_decoder_replay(false)
        } else {
            cfg
        };
        let dir = if a.weights_dir.is_null() {
            None
        } else {
            // SAFETY: a non-null `weights_dir` is NUL-terminated (caller's contract).
            let s = unsafe { CStr::from_ptr(a.weights_dir) };
            Some(
                s.to_str()
                    .map_err(|_| Error::invalid("weights_dir", "not UTF-8"))?
                    .to_owned(),
            )
        };
        let g = scale.geometry();
        // Checked before the weights are built (full scale takes a while).
        if paged && (a.num_blocks == 0 || a.num_blocks > crate::cache::MAX_NUM_BLOCKS) {
            return Err(Error::invalid(
                "num_blocks",
                format!(
                    "a paged cache needs 1..={} blocks, found {}",
                    crate::cache::MAX_NUM_BLOCKS,
                    a.num_blocks
                ),
            ));
        }
        let model = match &dir {
            Some(d) => Model::from_checkpoint(Path::new(d), g.clone())?,
            None => Model::synthetic(scale, a.seed, scale == Scale::Full)?,
        };
        let backend = Backend::new(Arc::new(model), cfg)?;
        let cache = if paged {
            EngineCache::Paged(PagedCache::host(&g, cfg.formats, a.num_blocks)?)
        } else {
            EngineCache::Contiguous(ContiguousCache::new(&g, cfg.formats))
        };
        let policy = TierPolicy::v41(&g, ReplayMode::Bounded);
        *out = handle::register(Csa2Engine {
            snapshot_layers: policy.snapshot_layers,
            kv_layers: g
                .layers_with(crate::geometry::Role::Full)
                .map(|l| l.id)
                .collect(),
            backend,
            state: Mutex::new(EngineState {
                cache,
                suspended: HashMap::new(),
                dirty: false,
            }),
        })?;
        Ok(())
    })
}

/// Frees an engine (its weights and KV cache). Null is a no-op.
///
/// Errors: `CSA2_ERR_INVALID_HANDLE` (freed twice, garbage, another handle type).
///
/// # Safety
/// None beyond passing the value `csa2_engine_create` returned (every value is checked).
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_free(e: *mut Csa2Engine) -> Csa2Status {
    guarded_free("csa2_engine_free", || handle::free(e, "engine"))
}

/// A new geometry handle of the engine's model (`hidden_size` sizes a step's output; free it with
/// `csa2_geometry_free`).
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `out` must be a writable pointer slot.
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_geometry(
    e: *const Csa2Engine,
    out: *mut *mut Csa2Geometry,
) -> Csa2Status {
    guarded("csa2_engine_geometry", || {
        // SAFETY: a writable slot is the caller's contract; null is checked.
        let (e, out) = (engine(e)?, unsafe { arg_out(out, "out") }?);
        *out = handle::register(Csa2Geometry {
            g: e.backend.geometry().clone(),
        })?;
        Ok(())
    })
}

/// What a caller sizes its calls by: the model's dimensions and the step rules in force.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2EngineInfo {
    /// Hidden size d: a step outputs `rows × d` float32.
    pub hidden_size: u64,
    /// Layers of the stack.
    pub num_layers: u64,
    /// SWA window in tokens (a prefill chunk outputs at most this many rows with decoder replay).
    pub window: u64,
    /// 1 when decoder bounded replay is on (prefill chunks output their last `window` rows only).
    pub decoder_replay: i32,
    /// `Csa2BackendKind` of the engine.
    pub backend: i32,
}

/// Writes the engine's dimensions and rules to `*out`.
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_info(
    e: *const Csa2Engine,
    out: *mut Csa2EngineInfo,
) -> Csa2Status {
    guarded("csa2_engine_info", || {
        // SAFETY: a writable `out` is the caller's contract; null is checked.
        let (e, out) = (engine(e)?, unsafe { arg_out(out, "out") }?);
        let g = e.backend.geometry();
        *out = Csa2EngineInfo {
            hidden_size: g.hidden_size as u64,
            num_layers: g.num_layers as u64,
            window: g.window as u64,
            decoder_replay: e.backend.cfg.decoder_replay as i32,
            backend: if e.backend.cfg.name == LAUNCH_DAY.name {
                Csa2BackendKind::Csa2BackendLaunchDay as i32
            } else {
                Csa2BackendKind::Csa2BackendCsa2 as i32
            },
        };
        Ok(())
    })
}

fn seq_arg(i: usize, s: &Csa2EngineSeq) -> Result<SeqStep> {
    let n = |what: &str, v: u64| -> Result<usize> {
        usize::try_from(v)
            .ok()
            .filter(|&v| v < crate::cache::MAX_POSITION)
            .ok_or_else(|| {
                Error::invalid(
                    format!("seqs[{i}].{what}"),
                    format!("{v} is not below 2^62"),
                )
            })
    };
    let phase = match enum_arg(
        &format!("seqs[{i}].phase"),
        s.phase,
        &[(0, true), (1, false)],
    )? {
        true => Phase::Prefill {
            prompt_end: n("prompt_end", s.prompt_end)?,
            prefill_start: n("prefill_start", s.prefill_start)?,
        },
        false => Phase::Decode,
    };
    Ok(SeqStep {
        req: s.req,
        first_pos: n("first_pos", s.first_pos)?,
        len: n("len", s.len)?,
        phase,
        replay_start: n("replay_start", s.replay_start)?,
        cached_until: n("cached_until", s.cached_until)?,
    })
}

/// Runs one step of the engine: `n_seqs` requests' rows (prefill chunks and decode tokens), one
/// token id per row, through the 40-layer stack and the engine's KV cache, and writes the final
/// hidden state of the output rows to `hidden`, their positions and request ids to `positions` /
/// `requests` if given, and the row count to `*rows_out`. A request seen for the first time is
/// opened.
///
/// Count only: `hidden` null plans the step without running it; it writes `*rows_out` (and
/// `positions` / `requests` when given, which the plan alone fixes). A caller that does not know
/// the row count calls once without tensors, then with tensors of `rows` rows.
///
/// Errors, each before anything runs (nothing changes, no output is written):
/// `CSA2_ERR_NULL_POINTER` (`args`, `seqs` with `n_seqs` > 0, `tokens`, `rows_out`),
/// `CSA2_ERR_INVALID_HANDLE`, `CSA2_ERR_INVALID_ARGUMENT` (`struct_size`, `n_seqs` 0, a count
/// past the address space, an unknown phase, a position at or above 2^62, a step the planner
/// refuses: no rows, a request twice, a decode of
/// more than one row, a prefill past its prompt end, `cached_until` past the rows it may reach; a
/// token id outside `0 ..= UINT32_MAX`; an output overlapping another argument; tensors on
/// different devices), `CSA2_ERR_SHAPE` (a tensor whose dtype, shape or strides differ from the
/// signature: `tokens` `[T]`, `hidden` `[rows, hidden_size]`, the message giving the bound sizes),
/// `CSA2_ERR_UNSUPPORTED` (a CUDA tensor: the engine runs on the host; without the `cuda` feature
/// `CSA2_ERR_NO_CUDA_BUILD`). While the step runs: `CSA2_ERR_OUT_OF_BLOCKS`,
/// `CSA2_ERR_INVALID_ARGUMENT` (rows that do not continue a request's stored entries), naming the
/// layer; then the step's requests may be partly advanced (see the module docs) and the outputs
/// are not written.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2EngineStepArgs`, `seqs` covering `n_seqs`
/// entries, its tensors as in the op exports (`dlpack::tensor_from_dlpack`); `rows_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_step(
    e: *const Csa2Engine,
    args: *const Csa2EngineStepArgs,
    rows_out: *mut usize,
) -> Csa2Status {
    guarded("csa2_engine_step", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let a = unsafe { read_args(args) }?;
        let e = engine(e)?;
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (seqs, rows_out) = unsafe {
            (
                arg_slice(a.seqs, a.n_seqs, "seqs")?,
                arg_out(rows_out, "rows_out")?,
            )
        };
        // SAFETY: the descriptors are the caller's (validated by `View::from_raw`).
        let (tok, mut hid, mut pos, mut req) = unsafe {
            (
                View::from_raw(a.tokens, sig::TOKENS.name)?,
                View::from_raw_opt(a.hidden, sig::HIDDEN.name)?,
                View::from_raw_opt(a.positions, sig::POSITIONS.name)?,
                View::from_raw_opt(a.requests, sig::REQUESTS.name)?,
            )
        };
        // An empty step was planned as zero rows and returned OK (the contract says n_seqs ≥ 1;
        // found by tests/ffi_adversarial.rs).
        if seqs.is_empty() {
            return Err(Error::invalid(
                "n_seqs",
                "a step needs at least one sequence",
            ));
        }
        let steps = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| seq_arg(i, s))
            .collect::<Result<Vec<_>>>()?;
        // The rows against the tokens first: the planner then sizes nothing the caller did not
        // back with a tensor.
        let total = steps
            .iter()
            .try_fold(0usize, |t, s| t.checked_add(s.len))
            .ok_or_else(|| Error::invalid("seqs", "the sum of the len overflows"))?;
        let g = e.backend.geometry();
        let mut dims = Dims::default();
        dims.bind("T", total);
        tok.expect(&sig::TOKENS, &mut dims)?;
        let plan = StepPlan::new(g, &steps, e.backend.cfg.decoder_replay)?;
        debug_assert_eq!(plan.total_rows(), total);
        let rows = plan.output_rows().len();
        dims.bind("rows", rows);
        dims.bind("d", g.hidden_size);
        for (v, arg) in [
            (&hid, &sig::HIDDEN),
            (&pos, &sig::POSITIONS),
            (&req, &sig::REQUESTS),
        ] {
            if let Some(v) = v {
                v.expect(arg, &mut dims)?;
            }
        }
        let outputs: Vec<&View> = [&hid, &pos, &req].into_iter().flatten().collect();
        check_disjoint(&[&tok], &outputs)?;
        tok.require_host()?;
        for v in &outputs {
            v.require_host()?;
        }
        let tokens = tok
            .i64s()?
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                u32::try_from(t).map_err(|_| {
                    Error::invalid(
                        format!("tokens[{i}]"),
                        format!("token id {t} is outside 0..=4294967295"),
                    )
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        let (hidden, kept_pos, kept_req) = match hid.as_mut() {
            None => {
                let kept = plan.output_rows();
                let r: Vec<u64> = kept.seq.iter().map(|&si| plan.seqs[si].req).collect();
                (None, kept.pos.clone(), r)
            }
            Some(_) => {
                let out = e.with(|b, st| {
                    let mut tm = Timings::default();
                    b.run_plan(plan, &tokens, st.cache.get(), &mut tm, false, None)
                })?;
                let kept = out.plan.output_rows();
                let p = kept.pos.clone();
                let r: Vec<u64> = kept.seq.iter().map(|&si| out.plan.seqs[si].req).collect();
                (Some(out.hidden), p, r)
            }
        };
        if let (Some(v), Some(h)) = (hid.as_mut(), &hidden) {
            if h.len() != rows * g.hidden_size {
                return Err(Error::Internal(format!(
                    "the step returned {} floats for {rows} rows",
                    h.len()
                )));
            }
            fill_floats(v, |o| {
                o.copy_from_slice(h);
                Ok(())
            })?;
        }
        if let Some(v) = pos.as_mut() {
            v.i64s_mut()?.copy_from_slice(&kept_pos);
        }
        if let Some(v) = req.as_mut() {
            for (o, &r) in v.i64s_mut()?.iter_mut().zip(&kept_req) {
                *o = r as i64;
            }
        }
        *rows_out = rows;
        Ok(())
    })
}

/// Ends request `id` in the engine: its blocks (or buffers), windows and carries are freed, and a
/// suspended state of it is discarded.
///
/// Errors: `CSA2_ERR_INVALID_HANDLE`, `CSA2_ERR_NOT_FOUND` (no such live request; nothing changes).
///
/// # Safety
/// None (every value is checked).
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_free_request(e: *const Csa2Engine, id: u64) -> Csa2Status {
    guarded("csa2_engine_free_request", || {
        engine(e)?.with(|_, st| {
            st.cache.get().close(id)?;
            st.suspended.remove(&id);
            Ok(())
        })
    })
}

/// Suspends request `id` between two turns, as `csa2 run`'s session does at the end of a turn
/// (docs/SPEC.md §0): the SWA windows of the encoder layers and every compressor carry are kept
/// aside (the DRAM snapshot), then every live SWA window and carry is dropped; global KV stays
/// (the next turn's prefix hit). A state suspended before and not resumed is replaced.
///
/// Errors: `CSA2_ERR_INVALID_HANDLE`, `CSA2_ERR_NOT_FOUND` (no such live request; nothing changes).
///
/// # Safety
/// None (every value is checked).
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_suspend(e: *const Csa2Engine, id: u64) -> Csa2Status {
    guarded("csa2_engine_suspend", || {
        let e = engine(e)?;
        let all: Vec<usize> = (0..e.backend.geometry().num_layers).collect();
        e.with(|_, st| {
            let c = st.cache.get();
            let swa = c.swa_snapshot(id, &e.snapshot_layers)?;
            let carries = e
                .kv_layers
                .iter()
                .map(|&l| Ok((l, c.carry(id, l)?)))
                .collect::<Result<Vec<_>>>()?;
            c.swa_drop(id, &all)?;
            c.carry_drop(id)?;
            st.suspended.insert(id, Suspended { swa, carries });
            Ok(())
        })
    })
}

/// Resumes request `id` after [`csa2_engine_suspend`]: with `restore` non-zero (the snapshot is
/// still live) the kept windows and carries are restored, so the next prefill starts at the prefix
/// hit; with `restore` 0 (a snapshot miss) they are discarded and the next prefill replays the
/// encoder's last window (`prefill_start` = `replay_start` = hit − window). The request may have
/// been freed and stepped again meanwhile (it is then open anew).
///
/// Errors: `CSA2_ERR_INVALID_HANDLE`, `CSA2_ERR_NOT_FOUND` (nothing suspended for `id`, or `id` is
/// not a live request when restoring); nothing changes on error.
///
/// # Safety
/// None (every value is checked).
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_resume(
    e: *const Csa2Engine,
    id: u64,
    restore: i32,
) -> Csa2Status {
    guarded("csa2_engine_resume", || {
        engine(e)?.with(|_, st| {
            let s = st
                .suspended
                .get(&id)
                .ok_or_else(|| Error::NotFound(format!("request {id} is not suspended")))?;
            if restore != 0 {
                let c = st.cache.get();
                if !c.contains(id) {
                    c.open(id)?;
                }
                c.swa_restore(id, &s.swa)?;
                for (l, carry) in &s.carries {
                    c.set_carry(id, *l, carry.clone())?;
                }
            }
            st.suspended.remove(&id);
            Ok(())
        })
    })
}

/// Writes the engine's cache counts and bytes (measured from its allocations) to `*out`.
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_engine_stats(
    e: *const Csa2Engine,
    out: *mut Csa2EngineStats,
) -> Csa2Status {
    guarded("csa2_engine_stats", || {
        // SAFETY: a writable `out` is the caller's contract; null is checked.
        let (e, out) = (engine(e)?, unsafe { arg_out(out, "out") }?);
        let s = e.with(|_, st| {
            let u = st.cache.get_ref().usage();
            let m = st.cache.manager().map(|m| m.stats());
            Ok(Csa2EngineStats {
                requests: u.requests as u64,
                main_bytes: u.main_bytes as u64,
                index_bytes: u.index_bytes as u64,
                global_allocated: u.global_allocated as u64,
                swa_bytes: u.swa_bytes as u64,
                carry_bytes: u.carry_bytes as u64,
                total_blocks: m.map_or(0, |m| m.total_blocks as u64),
                used_blocks: m.map_or(0, |m| m.used_blocks as u64),
                suspended: st.suspended.len() as u64,
            })
        })?;
        *out = s;
        Ok(())
    })
}
