//! Stream capture and graph replay on the emulated device, with the driver's rules for what a
//! capture may contain, so that a test on the host shows a call can be captured in a CUDA graph.
//!
//! `CudaStream::begin_capture` starts recording the stream (the legacy NULL stream cannot be
//! captured). While it records, a kernel launched on it — through any wrapper of the same handle,
//! as the entries wrap the caller's stream — is recorded with its argument values as they are at
//! that moment, not run; a device-to-device copy is recorded too. On the thread that began a
//! capture in `GLOBAL` or `THREAD_LOCAL` mode, the calls the driver refuses while capturing —
//! allocation, freeing, a copy to or from the host, a synchronisation, a module or kernel load —
//! fail with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidate the capture, and
//! `end_capture` then fails with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` naming the first such
//! call. (The driver applies `GLOBAL` to every thread; the emulator checks the capturing thread
//! only, so tests running beside a capture are not affected. It is stricter than the driver on
//! stream-ordered allocation, which cudarc uses where available and a capture may hold as graph
//! memory nodes: csa2's calls must allocate nothing at all.) `RELAXED` refuses nothing.
//! `CudaGraph::launch` replays the recorded operations in order against the same addresses.

use super::{sys, CudaFunction, CudaStream, DriverError, LaunchConfig};
use parking_lot::Mutex;
use std::sync::Arc;
use std::thread::ThreadId;

/// One recorded operation.
pub(super) enum Node {
    /// A kernel launch: the kernel, its shape, and each argument's bytes at capture time.
    Kernel {
        func: CudaFunction,
        cfg: LaunchConfig,
        args: Vec<Vec<u8>>,
    },
    /// A device-to-device copy of `bytes` bytes.
    Copy { src: u64, dst: u64, bytes: usize },
}

impl Node {
    /// Runs the operation now.
    pub(super) fn run(&self) -> Result<(), DriverError> {
        match self {
            Node::Kernel { func, cfg, args } => super::run_kernel(func, *cfg, args),
            Node::Copy { src, dst, bytes } => {
                // SAFETY: both were live device allocations of at least `bytes` bytes when the
                // copy was recorded; a graph's caller keeps its buffers alive while it replays.
                unsafe {
                    std::ptr::copy(*src as usize as *const u8, *dst as usize as *mut u8, *bytes)
                };
                Ok(())
            }
        }
    }
}

struct Capture {
    stream: usize,
    thread: ThreadId,
    strict: bool,
    nodes: Vec<Node>,
    /// The first refused call, once the capture is invalidated.
    invalidated: Option<String>,
}

static CAPTURES: Mutex<Vec<Capture>> = Mutex::new(Vec::new());

/// Starts capturing `stream`.
pub(super) fn begin(stream: usize, mode: sys::CUstreamCaptureMode) -> Result<(), DriverError> {
    if stream == 0 {
        return Err(DriverError(
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: the legacy NULL stream cannot be captured"
                .into(),
        ));
    }
    let mut caps = CAPTURES.lock();
    if caps.iter().any(|c| c.stream == stream) {
        return Err(DriverError(
            "CUDA_ERROR_ILLEGAL_STATE: the stream is already being captured".into(),
        ));
    }
    caps.push(Capture {
        stream,
        thread: std::thread::current().id(),
        strict: mode != sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        nodes: Vec::new(),
        invalidated: None,
    });
    Ok(())
}

/// Ends capturing `stream`: its recorded operations, or the reason the capture is invalid.
pub(super) fn end(stream: usize) -> Result<Vec<Node>, DriverError> {
    let mut caps = CAPTURES.lock();
    let i = caps
        .iter()
        .position(|c| c.stream == stream)
        .ok_or_else(|| {
            DriverError("CUDA_ERROR_ILLEGAL_STATE: the stream is not being captured".into())
        })?;
    let c = caps.remove(i);
    match c.invalidated {
        Some(why) => Err(DriverError(format!(
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: the capture was invalidated by {why}"
        ))),
        None => Ok(c.nodes),
    }
}

/// `stream`'s capture status.
pub(super) fn status(stream: usize) -> sys::CUstreamCaptureStatus {
    use sys::CUstreamCaptureStatus as S;
    match CAPTURES.lock().iter().find(|c| c.stream == stream) {
        None => S::CU_STREAM_CAPTURE_STATUS_NONE,
        Some(c) if c.invalidated.is_some() => S::CU_STREAM_CAPTURE_STATUS_INVALIDATED,
        Some(_) => S::CU_STREAM_CAPTURE_STATUS_ACTIVE,
    }
}

/// Records `node` if `stream` is being captured (`Ok(None)`: recorded); otherwise hands it back
/// to be run. Work on an invalidated capture is refused.
pub(super) fn record(stream: usize, node: Node) -> Result<Option<Node>, DriverError> {
    let mut caps = CAPTURES.lock();
    match caps.iter_mut().find(|c| c.stream == stream) {
        None => Ok(Some(node)),
        Some(c) if c.invalidated.is_some() => Err(DriverError(
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: the stream's capture was invalidated".into(),
        )),
        Some(c) => {
            c.nodes.push(node);
            Ok(None)
        }
    }
}

/// A call the driver refuses while this thread captures a stream (`op`, e.g. `cuMemAlloc`), or
/// while `stream` itself is captured: invalidates those captures and returns the driver's error.
pub(super) fn refuse(op: &str, stream: Option<usize>) -> Result<(), DriverError> {
    let me = std::thread::current().id();
    let mut caps = CAPTURES.lock();
    let mut hit = false;
    for c in caps
        .iter_mut()
        .filter(|c| (c.strict && c.thread == me) || Some(c.stream) == stream)
    {
        hit = true;
        c.invalidated.get_or_insert_with(|| op.to_string());
    }
    if hit {
        Err(DriverError(format!(
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: {op} is not permitted while a stream is being \
             captured"
        )))
    } else {
        Ok(())
    }
}

/// A captured stream's work, replayable (cudarc's `CudaGraph`; neither `Send` nor `Sync`, as
/// cudarc's is not).
pub struct CudaGraph {
    nodes: Vec<Node>,
    _stream: Arc<CudaStream>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaGraph({} nodes)", self.nodes.len())
    }
}

impl CudaGraph {
    pub(super) fn new(nodes: Vec<Node>, stream: Arc<CudaStream>) -> CudaGraph {
        CudaGraph {
            nodes,
            _stream: stream,
            _not_send: std::marker::PhantomData,
        }
    }
    /// Replays the recorded operations in order.
    pub fn launch(&self) -> Result<(), DriverError> {
        self.nodes.iter().try_for_each(Node::run)
    }
    /// Nothing to upload on the emulated device.
    pub fn upload(&self) -> Result<(), DriverError> {
        Ok(())
    }
    /// The recorded kernels' names, in order (what a test can check the capture held).
    pub fn kernel_names(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter_map(|n| match n {
                Node::Kernel { func, .. } => Some(func.name.to_string_lossy().into_owned()),
                Node::Copy { .. } => None,
            })
            .collect()
    }
}
