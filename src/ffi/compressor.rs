//! The stateful KV compressor over the C ABI: an opaque per-request state handle, so the two tokens
//! of a ratio-2 group may arrive in different calls (a decode step after a prefill of odd length)
//! and still pool exactly as one call (docs/SPEC.md §2 "Compressor", §3 "compressor state").
//!
//! # Ownership and lifetimes
//! [`csa2_compressor_state_create`] returns a handle owned by the caller; free it once with
//! [`csa2_compressor_state_free`]. It holds no pointer into the geometry, the cache or any tensor.
//!
//! # Thread safety
//! A handle is internally locked: calls on it may come from any thread, and concurrent calls on one
//! handle are serialised (the engine should still feed one request's tokens in order, since the
//! order of two concurrent steps is not defined). `csa2_compressor_state_free` must not race
//! another call on that handle.

use super::cache::{cache, Csa2Cache};
use super::dlpack::{check_disjoint, host, host_opt, DLTensor, View};
use super::geometry::layer_plan;
use super::handle;
use super::{arg_out, guarded, guarded_free, Csa2Geometry, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::{KV_DIM, NVFP4_DS_BYTES};
use crate::geometry::RopeParams;
use crate::ops::compressor::signature::{INDEX_K_OUT, KV, K_NORM, MAIN_KV_OUT, NORM, SCORE, WK};
use crate::ops::compressor::{
    CompressViews, Compressor, CompressorParams, CompressorState, PooledWeights,
};
use crate::ops::rope::Rope;
use crate::shape::Dims;
use parking_lot::Mutex;

/// Opaque compressor state of one request and one Full layer: the next token position and the
/// open group's carried rows. Free with [`csa2_compressor_state_free`]. Internally locked.
pub struct Csa2CompressorState {
    layer: u32,
    ratio: usize,
    st: Mutex<CompressorState>,
}

handle_type!(Csa2CompressorState, 0xC4);

fn group_start(start_pos: u64, m: usize) -> Result<()> {
    if !start_pos.is_multiple_of(m as u64) {
        return Err(Error::invalid(
            "start_pos",
            format!(
                "{start_pos} is not a multiple of the ratio {m} (a fresh state starts a group)"
            ),
        ));
    }
    Ok(())
}

/// The live state behind handle `s` (checked: see `handle`).
///
/// # Safety
/// None (every value is checked); `unsafe` only so the call sites read like the other arguments.
unsafe fn state(s: *const Csa2CompressorState) -> Result<std::sync::Arc<Csa2CompressorState>> {
    handle::get(s, "state")
}

/// Creates a compressor state for Full layer `layer` of `geometry` whose next token is at
/// `start_pos` (a multiple of the layer's ratio) with no open group.
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_ARGUMENT` (layer past the backbone or without
/// a compressor, `start_pos` not a multiple of the ratio). `*out` is untouched on error.
///
/// # Safety
/// `geometry` must be a live geometry handle (it may be freed after the call); `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_compressor_state_create(
    geometry: *const Csa2Geometry,
    layer: u32,
    start_pos: u64,
    out: *mut *mut Csa2CompressorState,
) -> Csa2Status {
    guarded("csa2_compressor_state_create", || {
        let gl = layer_plan(geometry, layer)?;
        let plan = gl.plan();
        // SAFETY: `out` is the caller's writable slot (null checked).
        let out = unsafe { arg_out(out, "out") }?;
        let m = plan.ratio;
        if !(m == 1 || m == 2) {
            return Err(Error::invalid(
                "layer",
                format!("layer {layer} has no compressor (ratio {m}; Full layers have 1 or 2)"),
            ));
        }
        group_start(start_pos, m)?;
        *out = handle::register(Csa2CompressorState {
            layer,
            ratio: m,
            st: Mutex::new(CompressorState::new(start_pos)),
        })?;
        Ok(())
    })
}

/// Frees a compressor state. Null is a no-op (`CSA2_OK`). A call on the state still in flight
/// finishes first; later calls get `CSA2_ERR_INVALID_HANDLE`.
///
/// Errors: `CSA2_ERR_INVALID_HANDLE` (already freed, garbage, another handle type). A successful
/// free leaves the thread's last error alone.
///
/// # Safety
/// None beyond the C ABI's: any value of `s` is checked (kept `unsafe` for source compatibility).
#[no_mangle]
pub unsafe extern "C" fn csa2_compressor_state_free(s: *mut Csa2CompressorState) -> Csa2Status {
    guarded_free("csa2_compressor_state_free", || handle::free(s, "state"))
}

/// Drops any open group and sets the next position to `start_pos` (a multiple of the ratio), e.g.
/// when the request is preempted and recomputed.
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_ARGUMENT` (misaligned `start_pos`; the state
/// is then unchanged).
///
/// # Safety
/// `s` must be a live state handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_compressor_state_reset(
    s: *const Csa2CompressorState,
    start_pos: u64,
) -> Csa2Status {
    guarded("csa2_compressor_state_reset", || {
        // SAFETY: the caller's contract.
        let s = unsafe { state(s) }?;
        group_start(start_pos, s.ratio)?;
        *s.st.lock() = CompressorState::new(start_pos);
        Ok(())
    })
}

/// Writes the position of the next token the state expects to `*next_pos` and the tokens of its
/// open group (0 or, for ratio 2, 1) to `*pending`, and the state's layer to `*layer` (each output
/// may be null when not wanted).
///
/// # Safety
/// `s` must be a live state handle; non-null outputs writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_compressor_state_query(
    s: *const Csa2CompressorState,
    next_pos: *mut u64,
    pending: *mut u64,
    layer: *mut u32,
) -> Csa2Status {
    guarded("csa2_compressor_state_query", || {
        // SAFETY: the caller's contract.
        let s = unsafe { state(s) }?;
        let st = s.st.lock();
        // SAFETY: non-null outputs are writable (caller's contract).
        unsafe {
            if let Some(p) = next_pos.as_mut() {
                *p = st.next_pos();
            }
            if let Some(p) = pending.as_mut() {
                *p = st.pending_tokens() as u64;
            }
            if let Some(p) = layer.as_mut() {
                *p = s.layer;
            }
        }
        Ok(())
    })
}

/// Arguments of [`csa2_compress_step`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2CompressStepArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2CompressStepArgs {
    /// `sizeof(Csa2CompressStepArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// Live geometry handle (the state's own).
    pub geometry: *const Csa2Geometry,
    /// The state's layer.
    pub layer: u32,
    /// Live compressor state of the request.
    pub state: *const Csa2CompressorState,
    /// `(T, 512)` float KV projections of the next T tokens.
    pub kv: *const DLTensor,
    /// `(T, 512)` float gate for ratio 2; null for ratio 1.
    pub score: *const DLTensor,
    /// `(512)` float KV RMSNorm weight.
    pub norm: *const DLTensor,
    /// `(128, 512)` float index-K projection.
    pub wk: *const DLTensor,
    /// `(128)` float index-K RMSNorm weight.
    pub k_norm: *const DLTensor,
    /// Output `(E, 288)` uint8 NVFP4-DS main-KV records.
    pub main_kv_out: *const DLTensor,
    /// Output `(E, 68)` uint8 MXFP4 index-K records.
    pub index_k_out: *const DLTensor,
    /// Output: the id of the first entry written.
    pub first_entry: *mut u64,
}

args_struct!(Csa2CompressStepArgs);

/// Feeds the next `T` tokens of a request to the compressor of the state's layer: `kv` `(T, 512)`
/// float (and, for ratio 2, `score` `(T, 512)` float; null for ratio 1), tokens
/// `next_pos .. next_pos + T`. The groups these tokens complete — together with the group carried
/// from earlier calls — are written as NVFP4-DS main-KV records to `main_kv_out` `(E, 288)` uint8
/// and MXFP4 index-K records to `index_k_out` `(E, 68)` uint8, where `E` must be exactly
/// `(pending + T) div ratio` (`csa2_compressor_state_query` gives `pending`); the first entry's id
/// is written to `*first_entry` (may be null). A trailing odd token is carried into the next call.
/// Weights: `norm` `(512)`, `wk` `(128, 512)`, `k_norm` `(128)` float — those of the state's layer.
///
/// A pair split across two calls pools exactly as one call over both tokens.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (`layer` is not the state's layer, `score` given or missing,
/// non-finite values, an output overlapping another argument), `CSA2_ERR_SHAPE` (wrong `E`), plus
/// the common errors of `csa2_compress`. On error the state and the outputs are unchanged.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2CompressStepArgs`. Its members:
/// `geometry` and `state` must be live handles; each tensor pointer null or a readable `DLTensor`
/// whose memory stays valid and unused by other threads for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_compress_step(args: *const Csa2CompressStepArgs) -> Csa2Status {
    guarded("csa2_compress_step", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2CompressStepArgs {
            struct_size: _,
            geometry,
            layer,
            state: s,
            kv,
            score,
            norm,
            wk,
            k_norm,
            main_kv_out,
            index_k_out,
            first_entry,
        } = unsafe { super::read_args(args) }?;
        let gl = layer_plan(geometry, layer)?;
        let (plan, eps) = (gl.plan(), gl.eps());
        // SAFETY: the caller's contract.
        let s = unsafe { state(s) }?;
        if layer != s.layer || plan.ratio != s.ratio {
            return Err(Error::invalid(
                "layer",
                format!(
                    "{layer} (ratio {}) is not the state's layer {} (ratio {})",
                    plan.ratio, s.layer, s.ratio
                ),
            ));
        }
        let m = s.ratio;
        // SAFETY: caller's contract (see above).
        let (kv, score, norm, wk, k_norm, mut main_out, mut index_out) =
            unsafe { compress_views(kv, score, norm, wk, k_norm, main_kv_out, index_k_out) }?;
        let mut inputs = vec![&kv, &norm, &wk, &k_norm];
        inputs.extend(score.as_ref());
        check_disjoint(&inputs, &[&main_out, &index_out])?;
        with_compressor(
            m,
            eps,
            &plan.rope,
            [&norm, &wk, &k_norm],
            &kv,
            score.as_ref(),
            |c, kvv, sv| {
                let t = kv.shape()[0];
                let mut guard = s.st.lock();
                let e = (guard.pending_tokens() + t) / m;
                if main_out.shape()[0] != e {
                    return Err(Error::shape(
                        "main_kv_out",
                        format!("[E={e}, {NVFP4_DS_BYTES}] ((pending + T) / ratio)"),
                        format!("{:?}", main_out.shape()),
                    ));
                }
                // Work on a copy so that an error leaves the caller's state as it was.
                let mut next = guard.clone();
                let out = c.compress(&mut next, kvv, sv)?;
                if out.count != e {
                    return Err(Error::Internal(format!(
                        "compressor emitted {} entries, expected {e}",
                        out.count
                    )));
                }
                main_out.bytes_mut()?.copy_from_slice(&out.main_kv_nvfp4);
                index_out.bytes_mut()?.copy_from_slice(&out.index_k_mxfp4);
                // SAFETY: a non-null `first_entry` is writable (caller's contract).
                if let Some(p) = unsafe { first_entry.as_mut() } {
                    *p = out.first_entry as u64;
                }
                *guard = next;
                Ok(())
            },
        )
    })
}

/// Stores the state's open group into request `id`'s compressor slot of the state's layer in cache
/// `c` (or clears the slot when no group is open), so the cache holds everything needed to resume
/// the request (e.g. after the engine drops the handle). The cache copies the rows.
///
/// A ratio-1 state never carries rows (each token closes its own group) and the cache keeps no
/// slot for its layer, so saving it stores nothing and succeeds: everything needed to resume is
/// the request's token count, which [`csa2_compressor_state_load`] takes as `next_pos`.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (request, for any ratio), `CSA2_ERR_INVALID_ARGUMENT` (a ratio-2
/// state whose layer is not a KV source of ratio > 1 in this cache).
///
/// # Safety
/// `s` and `c` must be live handles.
#[no_mangle]
pub unsafe extern "C" fn csa2_compressor_state_save(
    s: *const Csa2CompressorState,
    c: *const Csa2Cache,
    id: u64,
) -> Csa2Status {
    guarded("csa2_compressor_state_save", || {
        // SAFETY: the caller's contract.
        let (s, m) = unsafe { (state(s)?, cache(c)?) };
        if s.ratio == 1 {
            // Nothing to store; still refuse an unknown request as every other save does.
            return m.block_table(id).map(drop);
        }
        let st = s.st.lock();
        let (kv, score) = st.pending();
        let flat: Option<Vec<f32>> = (!kv.is_empty()).then(|| [kv, score].concat());
        m.set_compressor_state(id, s.layer as usize, flat.as_deref())
    })
}

/// Replaces the state by request `id`'s carried group of the state's layer in cache `c` (none when
/// the slot is empty), with the next token at `next_pos` (the request's token count). A ratio-1
/// state has no slot to read (see [`csa2_compressor_state_save`]): it becomes a state at
/// `next_pos` with no open group.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (request, for any ratio), `CSA2_ERR_INVALID_ARGUMENT` (a ratio-2
/// state whose layer is not a ratio > 1 KV source of the cache; `next_pos` inconsistent with the carried tokens: with a group open,
/// `next_pos − 1` must start a group, otherwise `next_pos` must). The state is unchanged on error.
///
/// # Safety
/// `s` and `c` must be live handles.
#[no_mangle]
pub unsafe extern "C" fn csa2_compressor_state_load(
    s: *const Csa2CompressorState,
    c: *const Csa2Cache,
    id: u64,
    next_pos: u64,
) -> Csa2Status {
    guarded("csa2_compressor_state_load", || {
        // SAFETY: the caller's contract.
        let (s, m) = unsafe { (state(s)?, cache(c)?) };
        let carried = if s.ratio == 1 {
            m.block_table(id)?;
            None
        } else {
            m.compressor_state(id, s.layer as usize)?
        };
        let (kv, score) = match carried {
            Some(v) => {
                let h = v.len() / 2;
                (v[..h].to_vec(), v[h..].to_vec())
            }
            None => (Vec::new(), Vec::new()),
        };
        let pending = (kv.len() / KV_DIM) as u64;
        if pending > next_pos || !(next_pos - pending).is_multiple_of(s.ratio as u64) {
            return Err(Error::invalid(
                "next_pos",
                format!(
                    "{next_pos} with {pending} carried tokens does not start a group of ratio {}",
                    s.ratio
                ),
            ));
        }
        let fresh = CompressorState::with_pending(next_pos, kv, score)?;
        *s.st.lock() = fresh;
        Ok(())
    })
}

/// The compressor of both compress exports, built from their checked views: reads the weights
/// `[norm, wk, k_norm]`, `kv` and the optional `score` as float and runs `body` with the
/// compressor of ratio `m` and those inputs (the weights outlive the compressor, which borrows
/// them).
fn with_compressor<R>(
    m: usize,
    eps: f64,
    rope: &RopeParams,
    [norm, wk, k_norm]: [&View<'_>; 3],
    kv: &View<'_>,
    score: Option<&View<'_>>,
    body: impl FnOnce(&Compressor<'_>, &[f32], Option<&[f32]>) -> Result<R>,
) -> Result<R> {
    let (normv, wkv, knv) = (norm.f32s()?, wk.f32s()?, k_norm.f32s()?);
    let c = Compressor::new(
        m,
        eps,
        Rope::new(rope)?,
        PooledWeights {
            norm: &normv,
            wk: &wkv,
            k_norm: &knv,
        },
    )?;
    let kvv = kv.f32s()?;
    let sv = score.map(|x| x.f32s()).transpose()?;
    body(&c, &kvv, sv.as_deref())
}

/// The validated host views of a compressor call (`csa2_compress`, `csa2_compress_step`): `kv`
/// `(T, 512)` float, optional `score` `(T, 512)` float, `norm` `(512)`, `wk` `(128, 512)`, `k_norm`
/// `(128)` float, and the record outputs `(E, 288)` / `(E, 68)` uint8.
///
/// # Safety
/// Each pointer null or a readable `DLTensor` whose memory stays valid for `'a`.
#[allow(clippy::type_complexity)]
pub(super) unsafe fn compress_views<'a>(
    kv: *const DLTensor,
    score: *const DLTensor,
    norm: *const DLTensor,
    wk: *const DLTensor,
    k_norm: *const DLTensor,
    main_kv_out: *const DLTensor,
    index_k_out: *const DLTensor,
) -> Result<(
    View<'a>,
    Option<View<'a>>,
    View<'a>,
    View<'a>,
    View<'a>,
    View<'a>,
    View<'a>,
)> {
    // SAFETY: forwarded caller contract.
    let (kv, score, norm, wk, k_norm, main_out, index_out) = unsafe {
        (
            host(kv, KV.name)?,
            host_opt(score, SCORE.name)?,
            host(norm, NORM.name)?,
            host(wk, WK.name)?,
            host(k_norm, K_NORM.name)?,
            host(main_kv_out, MAIN_KV_OUT.name)?,
            host(index_k_out, INDEX_K_OUT.name)?,
        )
    };
    let mut dims = Dims::default();
    kv.expect(&KV, &mut dims)?;
    if let Some(s) = &score {
        s.expect(&SCORE, &mut dims)?;
    }
    norm.expect(&NORM, &mut dims)?;
    wk.expect(&WK, &mut dims)?;
    k_norm.expect(&K_NORM, &mut dims)?;
    main_out.expect(&MAIN_KV_OUT, &mut dims)?;
    index_out.expect(&INDEX_K_OUT, &mut dims)?;
    Ok((kv, score, norm, wk, k_norm, main_out, index_out))
}

/// Arguments of [`csa2_compress`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2CompressArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2CompressArgs {
    /// `sizeof(Csa2CompressArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// Live geometry handle.
    pub geometry: *const Csa2Geometry,
    /// A Full layer of `geometry`.
    pub layer: u32,
    /// `(T, 512)` float KV projections.
    pub kv: *const DLTensor,
    /// `(T, 512)` float gate for ratio 2; null for ratio 1.
    pub score: *const DLTensor,
    /// `(512)` float KV RMSNorm weight.
    pub norm: *const DLTensor,
    /// `(128, 512)` float index-K projection.
    pub wk: *const DLTensor,
    /// `(128)` float index-K RMSNorm weight.
    pub k_norm: *const DLTensor,
    /// Position of the first token, a multiple of the ratio.
    pub start_pos: i64,
    /// Output `(E, 288)` uint8 NVFP4-DS main-KV records.
    pub main_kv_out: *const DLTensor,
    /// Output `(E, 68)` uint8 MXFP4 index-K records.
    pub index_k_out: *const DLTensor,
    /// `kDLCUDA` tensors only: the `cudaStream_t` / `CUstream` to launch on (0 = the legacy
    /// default stream). Ignored for host tensors. Added after the first version: a caller
    /// compiled without it gets 0.
    pub stream: u64,
}

args_struct!(Csa2CompressArgs, grown_at = stream);

/// KV compressor of Full layer `layer` (docs/SPEC.md §2 "Compressor"): turns `kv` `(T, 512)` float (and, for
/// ratio 2, the gate `score` `(T, 512)` float; null for ratio 1) of tokens `start_pos ..
/// start_pos + T` into `E = T / ratio` compressed entries, written as NVFP4-DS main-KV records
/// `main_kv_out` `(E, 288)` uint8 and MXFP4 index-K records `index_k_out` `(E, 68)` uint8.
/// Weights: `norm` `(512)`, `wk` `(128, 512)`, `k_norm` `(128)` float.
///
/// Stateless: `start_pos` and `T` must be multiples of the ratio (a caller that splits a pair across
/// calls keeps the odd token and sends it with the next call).
///
/// Devices ([`crate::ops::compressor::compress_view`]): all tensors in host memory, or all on one
/// CUDA device (`kDLCUDA`; a build with the `cuda` feature): then csa2's kernel runs on `stream`
/// and the call returns after the launch (the records are ready in stream order). The CUDA path
/// takes float32 tensors and positions below 2³¹, and does not scan the inputs for NaN / ±∞.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (not a compressed layer, misaligned `start_pos`/`T`,
/// `score` given or missing, non-finite values, tensors on different devices),
/// `CSA2_ERR_NO_CUDA_BUILD` (a CUDA tensor in a build without CUDA), `CSA2_ERR_UNSUPPORTED` (a
/// CUDA call the kernel does not cover), plus the common ones.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2CompressArgs`. Its members:
/// As [`csa2_rope`]; a `kDLCUDA` tensor's memory is a live allocation of its device's primary
/// context, and `stream` a live stream of that context.
#[no_mangle]
pub unsafe extern "C" fn csa2_compress(args: *const Csa2CompressArgs) -> Csa2Status {
    guarded("csa2_compress", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2CompressArgs {
            struct_size: _,
            geometry,
            layer,
            kv,
            score,
            norm,
            wk,
            k_norm,
            start_pos,
            main_kv_out,
            index_k_out,
            stream,
        } = unsafe { super::read_args(args) }?;
        let gl = layer_plan(geometry, layer)?;
        let (plan, eps) = (gl.plan(), gl.eps());
        let m = plan.ratio;
        if m == 0 {
            return Err(Error::invalid(
                "layer",
                format!("layer {layer} has no compressor (ratio 0)"),
            ));
        }
        // SAFETY: caller's contract (see above).
        let (kv, score, norm, wk, k_norm, mut main_out, mut index_out) = unsafe {
            (
                View::from_raw(kv, KV.name)?,
                View::from_raw_opt(score, SCORE.name)?,
                View::from_raw(norm, NORM.name)?,
                View::from_raw(wk, WK.name)?,
                View::from_raw(k_norm, K_NORM.name)?,
                View::from_raw(main_kv_out, MAIN_KV_OUT.name)?,
                View::from_raw(index_k_out, INDEX_K_OUT.name)?,
            )
        };
        let mut inputs = vec![&kv, &norm, &wk, &k_norm];
        inputs.extend(score.as_ref());
        check_disjoint(&inputs, &[&main_out, &index_out])?;
        let p = CompressorParams {
            ratio: m,
            eps,
            rope: Rope::new(&plan.rope)?,
        };
        let views = CompressViews {
            kv: kv.tensor(),
            score: score.as_ref().map(|s| s.tensor()),
            norm: norm.tensor(),
            wk: wk.tensor(),
            k_norm: k_norm.tensor(),
        };
        crate::ops::compressor::compress_view(
            &p,
            &views,
            start_pos,
            stream,
            &mut main_out.tensor_mut()?,
            &mut index_out.tensor_mut()?,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::dlpack::{DType, K_DL_CUDA};
    use crate::ffi::test_support::{geometry, host_tensor, last_error};

    /// `csa2_compress` over descriptors; `cuda` lists the arguments (0 kv … 6 index_k_out) whose
    /// descriptor claims `kDLCUDA` memory (never dereferenced: every call here fails first).
    fn compress_on(cuda: &[usize], struct_size: Option<usize>) -> Csa2Status {
        let g = geometry();
        let layer = crate::geometry::Geometry::embedded()
            .layers
            .iter()
            .position(|l| l.ratio == 1)
            .unwrap() as u32;
        let t = 2usize;
        let mut bufs: Vec<Vec<f32>> = [t * 512, 512, 128 * 512, 128]
            .iter()
            .map(|&n| vec![0.5f32; n])
            .collect();
        let (mut main, mut index) = (vec![0u8; t * 288], vec![0u8; t * 68]);
        let mut shapes = [
            vec![t as i64, 512],
            vec![512],
            vec![128, 512],
            vec![128],
            vec![t as i64, 288],
            vec![t as i64, 68],
        ];
        let (f, u) = (DType::F32.code_bits(), DType::U8.code_bits());
        let [s0, s1, s2, s3, s4, s5] = &mut shapes;
        let [b0, b1, b2, b3] = &mut bufs[..] else {
            unreachable!()
        };
        let mut d = [
            host_tensor(b0.as_mut_ptr().cast(), f.0, f.1, s0, None),
            host_tensor(b1.as_mut_ptr().cast(), f.0, f.1, s1, None),
            host_tensor(b2.as_mut_ptr().cast(), f.0, f.1, s2, None),
            host_tensor(b3.as_mut_ptr().cast(), f.0, f.1, s3, None),
            host_tensor(main.as_mut_ptr().cast(), u.0, u.1, s4, None),
            host_tensor(index.as_mut_ptr().cast(), u.0, u.1, s5, None),
        ];
        for &i in cuda {
            d[i].device.device_type = K_DL_CUDA;
        }
        let mut a = Csa2CompressArgs {
            geometry: g,
            layer,
            kv: &d[0],
            norm: &d[1],
            wk: &d[2],
            k_norm: &d[3],
            main_kv_out: &d[4],
            index_k_out: &d[5],
            ..Default::default()
        };
        if let Some(s) = struct_size {
            a.struct_size = s;
        }
        let st = unsafe { csa2_compress(&a) };
        unsafe { crate::ffi::csa2_geometry_free(g) };
        st
    }

    /// One `kDLCUDA` tensor among host ones names the odd one out as a device mismatch (it was
    /// "built without CUDA" / "needs host memory" before the export dispatched by device).
    #[test]
    fn compress_refuses_mixed_devices() {
        assert_eq!(compress_on(&[], None), Csa2Status::Csa2Ok);
        assert_eq!(compress_on(&[3], None), Csa2Status::Csa2ErrInvalidArgument);
        let msg = last_error();
        assert!(
            msg.contains("k_norm") && msg.contains("share a device"),
            "{msg}"
        );
    }

    /// All tensors on CUDA in a build without the feature: unsupported, saying how to get it.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn compress_on_cuda_without_the_feature_says_rebuild() {
        assert_eq!(
            compress_on(&[0, 1, 2, 3, 4, 5], None),
            Csa2Status::Csa2ErrNoCudaBuild
        );
        assert!(last_error().contains("--features cuda"), "{}", last_error());
    }

    /// A caller compiled against the first version (no `stream`) still works: the struct grew.
    #[test]
    fn compress_accepts_the_first_version_of_its_args() {
        let v1 = std::mem::offset_of!(Csa2CompressArgs, stream);
        assert_eq!(compress_on(&[], Some(v1)), Csa2Status::Csa2Ok);
        assert_eq!(
            compress_on(&[], Some(v1 - 1)),
            Csa2Status::Csa2ErrInvalidArgument
        );
    }
}
