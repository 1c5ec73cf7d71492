//! The emulated CUDA device of feature `cuda-emu`: the part of cudarc's driver API that csa2's
//! launch code uses, over host memory and the kernels of `kernels/*.cu` compiled as host C++ for
//! the host SIMT harness (`kernels/simt/`, docs/ARCHITECTURE.md § "The host SIMT harness").
//!
//! Everything above this module — `CudaDevice`, every `ops/*/cuda.rs` launch function, the C ABI
//! entries that take CUDA DLPack tensors — is the same code a GPU build runs; only the driver
//! underneath differs. "Device memory" is host memory; a CUDA tensor view is a host pointer tagged
//! `Device::Cuda(0)`. A launch runs synchronously on the calling thread, after the harness checked
//! the launch the way a driver would (kernel name, argument count and sizes, block and grid limits,
//! `__launch_bounds__`); a divergent barrier fails the launch with a message.
//!
//! Environment: `CSA2_EMU_CC=9.0|10.0` picks the compute capability the device reports, and with
//! it the module build (10.0 compiles the kernels' SM100 branches, e.g. the hardware E2M1
//! conversion, whose PTX instruction the harness emulates); `CSA2_EMU_SCHEDULE=reverse` runs each
//! block's threads in reverse order.
//!
//! Streams can be captured and the captured work replayed (`graph`): a capture refuses what the
//! driver refuses in one (allocation, host copies, synchronisation, module loads), so a test shows
//! a call holds no host work.
// The items mirror cudarc's driver API of the same names and are documented there.
#![allow(clippy::missing_safety_doc, missing_docs)]

use std::ffi::{c_char, c_void, CString};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

mod graph;
pub use graph::CudaGraph;

/// Driver-level types with cudarc's names.
pub mod sys {
    /// A stream handle (the emulator never dereferences it).
    #[allow(non_camel_case_types)]
    pub type CUstream = *mut std::ffi::c_void;
    /// A device address: a host address on the emulated device.
    #[allow(non_camel_case_types)]
    pub type CUdeviceptr = u64;
    /// The device attributes the emulated device answers.
    #[allow(non_camel_case_types)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CUdevice_attribute {
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    }
    /// A stream's capture status.
    #[allow(non_camel_case_types)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CUstreamCaptureStatus {
        CU_STREAM_CAPTURE_STATUS_NONE,
        CU_STREAM_CAPTURE_STATUS_ACTIVE,
        CU_STREAM_CAPTURE_STATUS_INVALIDATED,
    }
    /// How strictly a capture refuses the calls a graph cannot hold (see `graph`).
    #[allow(non_camel_case_types)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CUstreamCaptureMode {
        CU_STREAM_CAPTURE_MODE_GLOBAL,
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CU_STREAM_CAPTURE_MODE_RELAXED,
    }
    /// Graph instantiation flags (accepted, ignored), cudarc's newtype with its constants.
    #[allow(non_camel_case_types)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct CUgraphInstantiate_flags(pub u32);
    impl CUgraphInstantiate_flags {
        pub const CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: Self = Self(1);
        pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: Self = Self(2);
    }
    /// Event flags (accepted, ignored).
    #[allow(non_camel_case_types)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CUevent_flags {
        CU_EVENT_DEFAULT,
        CU_EVENT_BLOCKING_SYNC,
        CU_EVENT_DISABLE_TIMING,
    }
}

/// An error of the emulated driver (a refused launch, a module that does not load).
#[derive(Debug, Clone)]
pub struct DriverError(pub String);

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "emulated device: {}", self.0)
    }
}
impl std::error::Error for DriverError {}

/// Plain data that may be a kernel argument or live in device memory.
///
/// # Safety
/// Every bit pattern the kernels see must be a valid value (as cudarc's trait of the same name).
pub unsafe trait DeviceRepr: Copy {}
/// Types for which all-zero bits are a valid value.
///
/// # Safety
/// As cudarc's trait of the same name.
pub unsafe trait ValidAsZeroBits {}

macro_rules! repr {
    ($($t:ty),*) => { $(unsafe impl DeviceRepr for $t {} unsafe impl ValidAsZeroBits for $t {})* };
}
repr!(
    u8,
    i8,
    u16,
    i16,
    u32,
    i32,
    u64,
    i64,
    usize,
    isize,
    f32,
    f64,
    half::f16,
    half::bf16,
    bool
);

/// The emulated GPU: compute capability and the modules it loaded.
#[derive(Debug)]
pub struct CudaContext {
    ordinal: usize,
    cc: (i32, i32),
}

impl PartialEq for CudaContext {
    fn eq(&self, o: &Self) -> bool {
        self.ordinal == o.ordinal
    }
}

/// The compute capability the emulated device reports (`CSA2_EMU_CC`, default 9.0).
fn emulated_cc() -> Result<(i32, i32), DriverError> {
    match std::env::var("CSA2_EMU_CC").ok().as_deref() {
        None | Some("") | Some("9.0") => Ok((9, 0)),
        Some("10.0") => Ok((10, 0)),
        Some(o) => Err(DriverError(format!(
            "CSA2_EMU_CC={o}: the emulator has module builds for 9.0 and 10.0"
        ))),
    }
}

impl CudaContext {
    /// One emulated device.
    pub fn device_count() -> Result<i32, DriverError> {
        Ok(1)
    }
    /// Opens the emulated device `ordinal` (only 0 exists).
    pub fn new(ordinal: usize) -> Result<Arc<Self>, DriverError> {
        if ordinal != 0 {
            return Err(DriverError(format!("no device {ordinal}")));
        }
        Ok(Arc::new(CudaContext {
            ordinal,
            cc: emulated_cc()?,
        }))
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn name(&self) -> Result<String, DriverError> {
        Ok(format!(
            "csa2 host SIMT emulator (compute capability {}.{})",
            self.cc.0, self.cc.1
        ))
    }
    pub fn compute_capability(&self) -> Result<(i32, i32), DriverError> {
        Ok(self.cc)
    }
    /// A device attribute: the emulated device reports an H100 SXM's / H200's 132 SMs.
    pub fn attribute(&self, attrib: sys::CUdevice_attribute) -> Result<i32, DriverError> {
        match attrib {
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => Ok(132),
        }
    }
    /// Launches run synchronously: nothing is ever pending (refused while capturing).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        graph::refuse("cuCtxSynchronize", None)
    }
    pub fn default_stream(self: &Arc<Self>) -> Arc<CudaStream> {
        Arc::new(CudaStream {
            ctx: self.clone(),
            handle: std::ptr::null_mut(),
        })
    }
    /// A new stream with a handle of its own (one that can be captured).
    pub fn new_stream(self: &Arc<Self>) -> Result<Arc<CudaStream>, DriverError> {
        static NEXT: AtomicUsize = AtomicUsize::new(0x1000);
        let h = NEXT.fetch_add(0x10, Ordering::Relaxed);
        Ok(Arc::new(CudaStream {
            ctx: self.clone(),
            handle: h as sys::CUstream,
        }))
    }
    /// A caller's stream handle (any value; launches are synchronous).
    pub unsafe fn wrap_borrowed_stream(self: &Arc<Self>, handle: sys::CUstream) -> Arc<CudaStream> {
        Arc::new(CudaStream {
            ctx: self.clone(),
            handle,
        })
    }
    pub fn new_event(
        self: &Arc<Self>,
        _flags: Option<sys::CUevent_flags>,
    ) -> Result<CudaEvent, DriverError> {
        Ok(CudaEvent {
            at: parking_lot::Mutex::new(None),
        })
    }
    /// Loads a host-compiled module image (see [`HostImage`]). Each image is loaded once per
    /// process and shared by every context: a loaded shared object cannot be told apart from a
    /// later one at the same descriptor path, and its shared-memory section is per image anyway.
    pub fn load_module(self: &Arc<Self>, image: HostImage) -> Result<Arc<CudaModule>, DriverError> {
        graph::refuse("cuModuleLoadData", None)?;
        static LOADED: parking_lot::Mutex<Vec<(usize, Arc<CudaModule>)>> =
            parking_lot::Mutex::new(Vec::new());
        let key = image.0.as_ptr() as usize;
        let mut loaded = LOADED.lock();
        if let Some((_, m)) = loaded.iter().find(|(k, _)| *k == key) {
            return Ok(m.clone());
        }
        let m = CudaModule::open(image.0)?;
        loaded.push((key, m.clone()));
        Ok(m)
    }
}

/// The sanitizer build the modules load as (`CSA2_EMU_SANITIZER=thread|address`), after checking
/// that its runtime is in the process (the test binary runs with it in `LD_PRELOAD`: a module
/// built with a sanitizer cannot load without it).
pub fn sanitizer() -> Result<Option<&'static str>, String> {
    let (name, symbol, lib) = match std::env::var("CSA2_EMU_SANITIZER").ok().as_deref() {
        None | Some("") => return Ok(None),
        Some("thread") => ("thread", "__tsan_init", "libtsan.so"),
        Some("address") => ("address", "__asan_init", "libasan.so"),
        Some(o) => {
            return Err(format!(
                "CSA2_EMU_SANITIZER={o}: expected thread or address"
            ))
        }
    };
    let c = CString::new(symbol).expect("no NUL");
    // SAFETY: a symbol lookup in the process's global scope.
    if unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) }.is_null() {
        return Err(format!(
            "CSA2_EMU_SANITIZER={name} needs the sanitizer runtime in the process: run with \
             LD_PRELOAD=$(c++ -print-file-name={lib})"
        ));
    }
    Ok(Some(name))
}

/// A host-compiled kernel module's shared object, as embedded by build.rs.
#[derive(Debug, Clone, Copy)]
pub struct HostImage(pub &'static [u8]);

/// A timing event (host clock).
#[derive(Debug)]
pub struct CudaEvent {
    at: parking_lot::Mutex<Option<std::time::Instant>>,
}

impl CudaEvent {
    pub fn record(&self, _stream: &CudaStream) -> Result<(), DriverError> {
        *self.at.lock() = Some(std::time::Instant::now());
        Ok(())
    }
    pub fn synchronize(&self) -> Result<(), DriverError> {
        Ok(())
    }
    pub fn elapsed_ms(&self, end: &Self) -> Result<f32, DriverError> {
        match (*self.at.lock(), *end.at.lock()) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3),
            _ => Err(DriverError("an event was never recorded".into())),
        }
    }
}

/// A stream of the emulated device; work on it runs when it is submitted.
#[derive(Debug)]
pub struct CudaStream {
    ctx: Arc<CudaContext>,
    handle: sys::CUstream,
}

// SAFETY: the handle is an opaque number the emulator never dereferences.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

/// A host allocation standing for device memory, 256-byte aligned as cudaMalloc's.
pub struct CudaSlice<T> {
    ptr: u64,
    len: usize,
    owned: Option<std::alloc::Layout>,
    _t: PhantomData<T>,
}

// SAFETY: the slice is a plain allocation, like cudarc's CudaSlice.
unsafe impl<T> Send for CudaSlice<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for CudaSlice<T> {}

impl<T> std::fmt::Debug for CudaSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaSlice({:#x}, {})", self.ptr, self.len)
    }
}

impl<T> CudaSlice<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    /// Gives up ownership without freeing (cudarc's `leak`).
    pub fn leak(self) -> sys::CUdeviceptr {
        let p = self.ptr;
        std::mem::forget(self);
        p
    }
}

impl<T> Drop for CudaSlice<T> {
    fn drop(&mut self) {
        if let Some(layout) = self.owned {
            // Freeing while this thread captures invalidates the capture (end_capture says so).
            let _ = graph::refuse("cuMemFree", None);
            // SAFETY: allocated in `alloc` with this layout and not freed since (`leak` forgets).
            unsafe { std::alloc::dealloc(self.ptr as usize as *mut u8, layout) }
        }
    }
}

/// Keeps cudarc's `(pointer, guard)` shape of `device_ptr`.
pub struct SyncOnDrop<'a>(PhantomData<&'a ()>);

/// Read access to a device allocation's address.
pub trait DevicePtr<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>);
}
/// Write access to a device allocation's address.
pub trait DevicePtrMut<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>);
}
impl<T> DevicePtr<T> for CudaSlice<T> {
    fn device_ptr<'a>(&'a self, _s: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop(PhantomData))
    }
}
impl<T> DevicePtrMut<T> for CudaSlice<T> {
    fn device_ptr_mut<'a>(&'a mut self, _s: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop(PhantomData))
    }
}

fn alloc<T>(n: usize) -> Result<CudaSlice<T>, DriverError> {
    graph::refuse("cuMemAlloc", None)?;
    let bytes = n
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| DriverError(format!("an allocation of {n} elements overflows")))?;
    let layout = std::alloc::Layout::from_size_align(bytes.max(1), 256)
        .map_err(|e| DriverError(format!("allocation of {bytes} bytes: {e}")))?;
    // SAFETY: a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(DriverError(format!(
            "out of memory allocating {bytes} bytes"
        )));
    }
    Ok(CudaSlice {
        ptr: p as usize as u64,
        len: n,
        owned: Some(layout),
        _t: PhantomData,
    })
}

impl CudaStream {
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn cu_stream(&self) -> sys::CUstream {
        self.handle
    }
    pub fn capture_status(&self) -> Result<sys::CUstreamCaptureStatus, DriverError> {
        Ok(graph::status(self.handle as usize))
    }
    /// Starts capturing this stream (see [`graph`]).
    pub fn begin_capture(&self, mode: sys::CUstreamCaptureMode) -> Result<(), DriverError> {
        graph::begin(self.handle as usize, mode)
    }
    /// Ends the capture: the graph of what was recorded, or the reason it is invalid.
    pub fn end_capture(
        self: &Arc<Self>,
        _flags: sys::CUgraphInstantiate_flags,
    ) -> Result<Option<CudaGraph>, DriverError> {
        let nodes = graph::end(self.handle as usize)?;
        Ok(Some(CudaGraph::new(nodes, self.clone())))
    }
    /// Nothing is ever pending (refused while capturing).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        graph::refuse("cuStreamSynchronize", Some(self.handle as usize))
    }
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, DriverError> {
        alloc(n)
    }
    pub fn clone_htod<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>, DriverError> {
        let s = alloc::<T>(src.len())?;
        // SAFETY: `s` holds src.len() elements; the regions do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), s.ptr as usize as *mut T, src.len()) };
        Ok(s)
    }
    pub fn clone_dtoh<T: DeviceRepr, S: DevicePtr<T> + HasLen>(
        &self,
        src: &S,
    ) -> Result<Vec<T>, DriverError> {
        graph::refuse("cuMemcpyDtoH", Some(self.handle as usize))?;
        let (p, _g) = src.device_ptr(self);
        // SAFETY: `src` is a live allocation of `len` T's (its own contract).
        Ok(unsafe { std::slice::from_raw_parts(p as usize as *const T, src.elements()) }.to_vec())
    }
    pub fn memcpy_dtod<T, S: DevicePtr<T> + HasLen, D: DevicePtrMut<T> + HasLen>(
        &self,
        src: &S,
        dst: &mut D,
    ) -> Result<(), DriverError> {
        let n = src.elements();
        if dst.elements() < n {
            return Err(DriverError(format!(
                "copy of {n} elements into {}",
                dst.elements()
            )));
        }
        let (s, _a) = src.device_ptr(self);
        let (d, _b) = dst.device_ptr_mut(self);
        let node = graph::Node::Copy {
            src: s,
            dst: d,
            bytes: n * std::mem::size_of::<T>(),
        };
        // Recorded while the stream is captured, run now otherwise.
        match graph::record(self.handle as usize, node)? {
            Some(node) => node.run(),
            None => Ok(()),
        }
    }
    /// A slice over caller memory (released with [`CudaSlice::leak`]; never freed here).
    pub unsafe fn upgrade_device_ptr<T>(
        self: &Arc<Self>,
        p: sys::CUdeviceptr,
        len: usize,
    ) -> CudaSlice<T> {
        CudaSlice {
            ptr: p,
            len,
            owned: None,
            _t: PhantomData,
        }
    }
    pub fn launch_builder<'a>(&'a self, func: &'a CudaFunction) -> LaunchArgs<'a> {
        LaunchArgs {
            func,
            stream: self.handle as usize,
            args: Vec::new(),
        }
    }
}

/// Element count of a device buffer (what `clone_dtoh` copies).
pub trait HasLen {
    fn elements(&self) -> usize;
}
impl<T> HasLen for CudaSlice<T> {
    fn elements(&self) -> usize {
        self.len
    }
}

/// A loaded host module (`dlopen` of the embedded shared object through a memfd).
pub struct CudaModule {
    /// The kernels the module exports (its harness table).
    kernels: Vec<String>,
    /// The memfd holding the image, open for the module's life: glibc identifies a loaded object
    /// by its path, so a reused descriptor number would hand back an earlier module.
    _image: std::fs::File,
    handle: *mut c_void,
    launch: LaunchFn,
    schedule: Option<unsafe extern "C" fn(i32)>,
}

// SAFETY: the module's entry points take a lock around every launch.
unsafe impl Send for CudaModule {}
// SAFETY: as above.
unsafe impl Sync for CudaModule {}

impl std::fmt::Debug for CudaModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaModule({:p})", self.handle)
    }
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    u32,
    *mut *mut c_void,
    *const usize,
    i32,
    *mut c_char,
    usize,
) -> i32;

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dl error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { std::ffi::CStr::from_ptr(e) }
            .to_string_lossy()
            .into_owned()
    }
}

impl CudaModule {
    fn open(image: &[u8]) -> Result<Arc<CudaModule>, DriverError> {
        use std::io::Write;
        let name = CString::new("csa2-simt-module").expect("no NUL");
        // SAFETY: a plain syscall with a valid C string.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(DriverError(format!(
                "memfd_create: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: a fresh descriptor this function owns.
        let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.write_all(image)
            .map_err(|e| DriverError(format!("writing the module image: {e}")))?;
        let path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
        // SAFETY: dlopen of a complete shared object; RTLD_LOCAL keeps each module's symbols apart
        // (every module exports the same entry names).
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(DriverError(format!("dlopen: {}", dl_error())));
        }
        let sym = |n: &str| {
            let c = CString::new(n).expect("no NUL");
            // SAFETY: a live handle and a C string.
            unsafe { libc::dlsym(handle, c.as_ptr()) }
        };
        let launch = sym("csa2_simt_launch");
        if launch.is_null() {
            return Err(DriverError("the module has no csa2_simt_launch".into()));
        }
        let schedule = sym("csa2_simt_set_schedule");
        let names = sym("csa2_simt_kernel_names");
        if names.is_null() {
            return Err(DriverError("the module has no kernel table".into()));
        }
        // SAFETY: `csa2_simt_kernel_names` returns a static, null-terminated array of C strings.
        let kernels = unsafe {
            let f = std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn() -> *const *const c_char,
            >(names);
            let mut v = Vec::new();
            let mut p = f();
            while !(*p).is_null() {
                v.push(std::ffi::CStr::from_ptr(*p).to_string_lossy().into_owned());
                p = p.add(1);
            }
            v
        };
        // SAFETY: the symbols have these signatures (kernels/simt/runtime.cpp).
        let m = unsafe {
            CudaModule {
                kernels,
                _image: file,
                handle,
                launch: std::mem::transmute::<*mut c_void, LaunchFn>(launch),
                schedule: (!schedule.is_null()).then(|| {
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i32)>(schedule)
                }),
            }
        };
        if let Some(f) = m.schedule {
            let reverse = std::env::var("CSA2_EMU_SCHEDULE").is_ok_and(|v| v == "reverse");
            // SAFETY: sets a flag of the module.
            unsafe { f(i32::from(reverse)) };
        }
        Ok(Arc::new(m))
    }

    /// The kernel `name` of this module (an unknown name is an error, as from the driver).
    pub fn load_function(self: &Arc<Self>, name: &str) -> Result<CudaFunction, DriverError> {
        graph::refuse("cuModuleGetFunction", None)?;
        if !self.kernels.iter().any(|k| k == name) {
            return Err(DriverError(format!(
                "no kernel named `{name}` in this module (it has {})",
                self.kernels.join(", ")
            )));
        }
        Ok(CudaFunction {
            module: self.clone(),
            name: CString::new(name).map_err(|_| DriverError("a NUL in a kernel name".into()))?,
        })
    }
}

/// One kernel of a loaded module.
#[derive(Debug, Clone)]
pub struct CudaFunction {
    module: Arc<CudaModule>,
    name: CString,
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid_dim: (u32, u32, u32),
    pub block_dim: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

enum Arg {
    /// A value the caller keeps alive for the builder's lifetime (scalars).
    Borrowed(*const u8, usize),
    /// A device address (a buffer argument), stored here until launch.
    Address(u64),
}

/// A launch being built: the kernel and its arguments in order.
pub struct LaunchArgs<'a> {
    func: &'a CudaFunction,
    /// The stream's handle (a launch on a captured stream is recorded, not run).
    stream: usize,
    args: Vec<Arg>,
}

/// Pushes one kernel argument (cudarc's trait of the same name).
///
/// # Safety
/// The pushed value must match the kernel's parameter (the harness checks its size).
pub unsafe trait PushKernelArg<T> {
    fn arg(&mut self, arg: T) -> &mut Self;
}

// SAFETY: the value outlives the builder ('b: 'a).
unsafe impl<'a, 'b: 'a, T: DeviceRepr> PushKernelArg<&'b T> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b T) -> &mut Self {
        self.args.push(Arg::Borrowed(
            a as *const T as *const u8,
            std::mem::size_of::<T>(),
        ));
        self
    }
}
// SAFETY: a buffer argument is its address.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaSlice<T>> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b CudaSlice<T>) -> &mut Self {
        self.args.push(Arg::Address(a.ptr));
        self
    }
}
// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaSlice<T>> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b mut CudaSlice<T>) -> &mut Self {
        self.args.push(Arg::Address(a.ptr));
        self
    }
}

impl LaunchArgs<'_> {
    /// Runs the kernel now, on this thread, through the host SIMT harness — or, on a stream being
    /// captured, records it with its argument values as they are now.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let args = self
            .args
            .iter()
            .map(|a| match *a {
                Arg::Address(p) => p.to_ne_bytes().to_vec(),
                // SAFETY: the value outlives the builder (`PushKernelArg`'s bound).
                Arg::Borrowed(p, n) => unsafe { std::slice::from_raw_parts(p, n) }.to_vec(),
            })
            .collect();
        let node = graph::Node::Kernel {
            func: self.func.clone(),
            cfg,
            args,
        };
        match graph::record(self.stream, node)? {
            Some(node) => node.run(),
            None => Ok(()),
        }
    }
}

/// Runs `func` over `cfg` with the argument bytes `args` through the host SIMT harness.
fn run_kernel(func: &CudaFunction, cfg: LaunchConfig, args: &[Vec<u8>]) -> Result<(), DriverError> {
    let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.as_ptr() as *mut c_void).collect();
    let sizes: Vec<usize> = args.iter().map(Vec::len).collect();
    let grid = [cfg.grid_dim.0, cfg.grid_dim.1, cfg.grid_dim.2];
    let block = [cfg.block_dim.0, cfg.block_dim.1, cfg.block_dim.2];
    let mut msg = vec![0u8; 1024];
    // SAFETY: the module's launch entry reads `ptrs.len()` argument pointers and sizes (copying
    // each argument's bytes) and writes at most `msg.len()` bytes; every argument outlives the call.
    let rc = unsafe {
        (func.module.launch)(
            func.name.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            cfg.shared_mem_bytes,
            ptrs.as_mut_ptr(),
            sizes.as_ptr(),
            ptrs.len() as i32,
            msg.as_mut_ptr() as *mut c_char,
            msg.len(),
        )
    };
    if rc != 0 {
        let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
        return Err(DriverError(
            String::from_utf8_lossy(&msg[..end]).into_owned(),
        ));
    }
    log_launch(&func.name.to_string_lossy());
    Ok(())
}

/// With `CSA2_EMU_LAUNCH_LOG=<file>`, appends each kernel's name the first time this process runs
/// it to completion (the test command checks that every kernel in `kernels/` appears).
fn log_launch(name: &str) {
    use std::io::Write;
    static SEEN: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());
    let Some(path) = std::env::var_os("CSA2_EMU_LAUNCH_LOG") else {
        return;
    };
    let mut seen = SEEN.lock();
    if seen.iter().any(|n| n == name) {
        return;
    }
    seen.push(name.to_string());
    // O_APPEND writes of one short line do not interleave between processes.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{name}");
    }
}
