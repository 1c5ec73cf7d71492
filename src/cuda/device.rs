//! CudaDevice handle, per-device module store and launch helpers.

use super::modules::{EmbeddedModule, LoadPath, MODULES};
use crate::cuda::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use crate::error::{Error, Result};
use crate::tensor::{Device, Element, TensorView, TensorViewMut};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// A device buffer (what the `_dev` wrappers take and return).
pub type DeviceBuffer<T> = CudaSlice<T>;

/// One open GPU: its context, one stream every wrapper launches on, and the modules loaded so far.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cc: (i32, i32),
    sm_count: usize,
    name: String,
    /// Scratch of the split attention kernel (see
    /// [`CudaDevice::attention_workspace`]); outgrown buffers are kept until the device drops.
    workspace: Mutex<Workspaces>,
    /// Held from a split launch's workspace lookup until its combine is queued.
    split_launch: Mutex<()>,
    modules: Mutex<HashMap<&'static str, Arc<Loaded>>>,
    sync_each_launch: bool,
}

#[derive(Default)]
struct Workspaces {
    current: Option<CudaSlice<f32>>,
    retired: Vec<CudaSlice<f32>>,
}

struct Loaded {
    module: Arc<CudaModule>,
    path: LoadPath,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("compute_capability", &self.cc)
            .finish()
    }
}

pub(crate) fn cuda_error(op: impl Into<String>, e: impl std::fmt::Display) -> Error {
    Error::Cuda {
        op: op.into(),
        reason: e.to_string(),
    }
}

impl CudaDevice {
    /// Whether a CUDA driver library (libcuda) can be loaded on this machine. Never panics.
    pub fn driver_present() -> bool {
        #[cfg(feature = "cuda-emu")]
        return true;
        // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports success; it
        // touches no CUDA state.
        #[cfg(not(feature = "cuda-emu"))]
        unsafe {
            cudarc::driver::sys::is_culib_present()
        }
    }

    /// Whether an NVRTC library can be loaded (the last-resort module load path).
    pub fn nvrtc_present() -> bool {
        #[cfg(feature = "cuda-emu")]
        return false;
        // SAFETY: as above, a dlopen probe of libnvrtc.
        #[cfg(not(feature = "cuda-emu"))]
        unsafe {
            cudarc::nvrtc::sys::is_culib_present()
        }
    }

    /// Opens GPU `ordinal`.
    ///
    /// Errors: [`Error::Unsupported`] when no CUDA driver library is present (checked first: cudarc
    /// panics when it cannot load libcuda), when the driver reports no device, or when the ordinal
    /// does not exist; [`Error::Cuda`] when the driver fails to create the context.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        if !Self::driver_present() {
            return Err(Error::Unsupported(
                "no CUDA driver library (libcuda.so) could be loaded; the CUDA kernels need an NVIDIA \
                 driver — use the CPU path"
                    .into(),
            ));
        }
        // A driver library without a usable device (CUDA_ERROR_NO_DEVICE, a container without the
        // GPU mapped in) is the same situation as no driver for the caller: use the CPU.
        let count = CudaContext::device_count().map_err(|e| {
            Error::Unsupported(format!(
                "a CUDA driver is installed but reports no usable device: {e}"
            ))
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} requested but the driver reports {count} device(s)"
            )));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| {
                Error::Unsupported("the CUDA driver panicked while opening a device".into())
            })?
            .map_err(|e| cuda_error(format!("open device {ordinal}"), e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| cuda_error("compute capability", e))?;
        let name = ctx.name().map_err(|e| cuda_error("device name", e))?;
        let sm_count = ctx
            .attribute(
                crate::cuda::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| cuda_error("multiprocessor count", e))?
            .max(1) as usize;
        let stream = ctx.default_stream();
        Ok(CudaDevice {
            ctx,
            stream,
            cc,
            sm_count,
            name,
            workspace: Mutex::new(Workspaces::default()),
            split_launch: Mutex::new(()),
            modules: Mutex::new(HashMap::new()),
            sync_each_launch: std::env::var_os("CSA2_CUDA_SYNC").is_some_and(|v| v != "0"),
        })
    }

    /// The device's marketing name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }
    /// Streaming multiprocessors (the driver's count; 132 on the emulated device).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }
    /// The lock a split attention launch holds from [`CudaDevice::attention_workspace`] until its
    /// combine launch is queued, so that two host threads launching on one stream queue their
    /// (split, combine) pairs one after the other, never interleaved over the shared workspace.
    pub(crate) fn split_launch_lock(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.split_launch.lock()
    }
    /// A device address of at least `floats` f32 of scratch for the split attention kernel: one
    /// buffer per device, kept for the device's life, so every request that fits gets the same
    /// address and a captured graph replays against it. The launch code asks for the room of
    /// every default plan (`reserved_workspace_floats`), which [`csa2_cuda_preload`] reserves, so
    /// only a larger request (a pinned split plan) allocates a new buffer — host work and a
    /// synchronization of the device's stream — keeping the outgrown one, since queued or
    /// captured work may still use it. The buffer is shared by every stream: launches on one
    /// stream are ordered (and the pair lock keeps each split + combine together); split attention
    /// on two streams of one device running at the same time is outside the contract (vLLM runs
    /// attention on one stream).
    ///
    /// [`csa2_cuda_preload`]: crate::ffi::csa2_cuda_preload
    ///
    /// Errors: [`Error::Invalid`] when the request needs an allocation and `may_allocate` is false
    /// (the caller's stream is being captured); [`Error::Cuda`] when the allocation fails.
    pub fn attention_workspace(&self, floats: usize, may_allocate: bool) -> Result<u64> {
        use crate::cuda::driver::DevicePtr;
        let mut w = self.workspace.lock();
        let have = w.current.as_ref().map_or(0, |b| b.len());
        if let Some(b) = &w.current {
            if have >= floats {
                return Ok(b.device_ptr(&self.stream).0);
            }
        }
        if !may_allocate {
            return Err(Error::invalid(
                "stream",
                format!(
                    "split attention needs {floats} f32 of workspace and the device holds {have}; \
                     nothing may be allocated while the stream is being captured: call \
                     csa2_cuda_preload before the capture (it reserves the workspace of every \
                     default split plan)"
                ),
            ));
        }
        let grown = floats.max(2 * have);
        let b = self.zeros::<f32>(grown)?;
        self.synchronize()?;
        let addr = b.device_ptr(&self.stream).0;
        if let Some(old) = w.current.replace(b) {
            w.retired.push(old);
        }
        Ok(addr)
    }
    /// f32 of split-attention workspace the device holds now (0 before the first reservation).
    pub fn attention_workspace_len(&self) -> usize {
        self.workspace
            .lock()
            .current
            .as_ref()
            .map_or(0, |b| b.len())
    }
    /// The SASS image this device runs ([`sass_arch`]), if the fatbin has one for it.
    pub fn arch(&self) -> Option<&'static str> {
        sass_arch(self.cc)
    }
    /// The stream every wrapper launches on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for all queued work and reports any asynchronous kernel error.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("stream synchronize", e))
    }

    /// Loads every embedded module now and resolves every kernel function of each
    /// ([`EXPECTED_KERNELS`](super::modules::EXPECTED_KERNELS)), so no later launch loads, JITs or
    /// compiles anything (a CUDA-graph capture must not); returns how each module was loaded.
    pub fn preload_all(&self) -> Result<Vec<(&'static str, LoadPath)>> {
        let paths = MODULES
            .iter()
            .map(|m| Ok((m.name, self.module(m.name)?.path)))
            .collect::<Result<Vec<_>>>()?;
        for (module, kernels) in super::modules::EXPECTED_KERNELS {
            for kernel in *kernels {
                self.function(module, kernel)?;
            }
        }
        Ok(paths)
    }

    /// The kernel functions resolved so far, as `module::kernel`, sorted.
    pub fn resolved_functions(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .modules
            .lock()
            .iter()
            .flat_map(|(m, l)| {
                l.functions
                    .lock()
                    .keys()
                    .map(|f| format!("{m}::{f}"))
                    .collect::<Vec<_>>()
            })
            .collect();
        v.sort();
        v
    }

    /// Kernel `func` of embedded module `module` (loaded once per device, then cached).
    pub(crate) fn function(
        &self,
        module: &'static str,
        func: &'static str,
    ) -> Result<CudaFunction> {
        let loaded = self.module(module)?;
        let mut fs = loaded.functions.lock();
        if let Some(f) = fs.get(func) {
            return Ok(f.clone());
        }
        let f = loaded
            .module
            .load_function(func)
            .map_err(|e| cuda_error(format!("load kernel {module}::{func}"), e))?;
        fs.insert(func, f.clone());
        Ok(f)
    }

    fn module(&self, name: &'static str) -> Result<Arc<Loaded>> {
        let mut mods = self.modules.lock();
        if let Some(m) = mods.get(name) {
            return Ok(m.clone());
        }
        let em = EmbeddedModule::get(name)
            .ok_or_else(|| Error::Internal(format!("no embedded kernel module `{name}`")))?;
        let forced = std::env::var("CSA2_CUDA_LOAD").ok();
        let forced = match forced.as_deref() {
            None | Some("") => None,
            Some(s) => Some(LoadPath::from_name(s).ok_or_else(|| {
                Error::invalid(
                    "CSA2_CUDA_LOAD",
                    format!("`{s}` is not one of fatbin, ptx, compat, nvrtc"),
                )
            })?),
        };
        let mut tried = Vec::new();
        for &path in LoadPath::ORDER {
            if forced.is_some_and(|f| f != path) {
                continue;
            }
            match self.try_load(em, path) {
                Ok(module) => {
                    let l = Arc::new(Loaded {
                        module,
                        path,
                        functions: Mutex::new(HashMap::new()),
                    });
                    mods.insert(name, l.clone());
                    return Ok(l);
                }
                Err(e) => tried.push(format!("{path}: {e}")),
            }
        }
        Err(Error::CudaModule(format!(
            "kernel module `{name}` cannot be loaded on {} (compute capability {}.{}): {}",
            self.name,
            self.cc.0,
            self.cc.1,
            tried.join("; ")
        )))
    }

    #[cfg(feature = "cuda-emu")]
    fn try_load(
        &self,
        em: &EmbeddedModule,
        path: LoadPath,
    ) -> std::result::Result<Arc<CudaModule>, String> {
        use crate::cuda::driver::HostImage;
        if path != LoadPath::HostSimt {
            return Err("the emulated device loads host images only".into());
        }
        let arch = self
            .arch()
            .ok_or("no host image for this compute capability")?;
        let sanitizer = crate::cuda::emu::sanitizer()?;
        let mut image = em
            .host_image(arch, sanitizer)
            .ok_or_else(|| format!("no host image for {arch} with sanitizer {sanitizer:?}"))?;
        // CSA2_EMU_MUTANT=<module>:<mutant> loads a deliberately broken build of one module (the
        // mutation tests run a check in a child process with it and expect a failure).
        if let Ok(m) = std::env::var("CSA2_EMU_MUTANT") {
            if let Some((module, mutant)) = m.split_once(':') {
                if module == em.name {
                    image = super::modules::MUTANTS
                        .iter()
                        .find(|(k, n, _)| *k == module && *n == mutant)
                        .map(|(_, _, img)| *img)
                        .ok_or_else(|| format!("CSA2_EMU_MUTANT={m}: no such mutant"))?;
                }
            }
        }
        self.ctx
            .load_module(HostImage(image))
            .map_err(|e| e.to_string())
    }

    #[cfg(not(feature = "cuda-emu"))]
    fn try_load(
        &self,
        em: &EmbeddedModule,
        path: LoadPath,
    ) -> std::result::Result<Arc<CudaModule>, String> {
        use cudarc::nvrtc::{CompileOptions, Ptx};
        let arch = self.arch();
        if self.cc < super::shapes::MIN_COMPUTE_CAPABILITY {
            let (a, b) = super::shapes::MIN_COMPUTE_CAPABILITY;
            return Err(format!(
                "the kernels need compute capability {a}.{b} or newer (bf16 mma.sync)"
            ));
        }
        // The exact arch's PTX where embedded, else the portable sm_80 PTX.
        let exact =
            |f: &dyn Fn(&str) -> Option<&'static str>| arch.and_then(f).or_else(|| f("sm_80"));
        let image = match path {
            // SASS for the table's GPUs, the driver's JIT of the sm_80 PTX for the others.
            LoadPath::Fatbin => Ptx::from_binary(em.fatbin.to_vec()),
            LoadPath::Ptx => Ptx::from_src(exact(&|a| em.ptx(a)).ok_or("no PTX embedded")?),
            LoadPath::CompatPtx => {
                Ptx::from_src(exact(&|a| em.compat_ptx(a)).ok_or("no compat PTX embedded")?)
            }
            LoadPath::Nvrtc => {
                if !Self::nvrtc_present() {
                    return Err("no NVRTC library found".into());
                }
                // The table's arch, else the device's own (NVRTC knows what it can target).
                let arch =
                    arch.map_or_else(|| format!("sm_{}{}", self.cc.0, self.cc.1), String::from);
                let opts = CompileOptions {
                    options: vec!["-std=c++17".into(), format!("--gpu-architecture={arch}")],
                    ..Default::default()
                };
                std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(em.source, opts))
                    .map_err(|_| "NVRTC panicked".to_string())?
                    .map_err(|e| format!("NVRTC: {e}"))?
            }
            LoadPath::HostSimt => {
                return Err("the host SIMT harness exists in cuda-emu builds only".into())
            }
        };
        self.ctx.load_module(image).map_err(|e| e.to_string())
    }

    /// How each module loaded so far was loaded.
    pub fn load_paths(&self) -> Vec<(&'static str, LoadPath)> {
        let mut v: Vec<_> = self
            .modules
            .lock()
            .iter()
            .map(|(k, l)| (*k, l.path))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Copies a host slice to a new device buffer (a 1-element buffer for an empty slice, so the
    /// kernel always gets a valid pointer).
    pub fn upload<T: DeviceRepr + Default + Clone>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        let r = if host.is_empty() {
            self.stream.clone_htod(&[T::default()])
        } else {
            self.stream.clone_htod(host)
        };
        r.map_err(|e| cuda_error("copy host → device", e))
    }

    /// Copies a device buffer back (synchronizes the stream, so it also reports kernel errors).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(dev)
            .map_err(|e| cuda_error("copy device → host (or an earlier kernel)", e))
    }

    /// A zeroed device buffer of `n` elements (at least one).
    pub fn zeros<T: DeviceRepr + crate::cuda::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(|e| cuda_error(format!("allocate {n} elements"), e))
    }

    pub(crate) fn after_launch(&self, what: &str) -> Result<()> {
        if self.sync_each_launch {
            self.stream
                .synchronize()
                .map_err(|e| cuda_error(format!("kernel {what} (synchronized)"), e))?;
        }
        Ok(())
    }
}

/// The SASS image csa2 ships for compute capability `cc`
/// ([`SASS_ARCHS`](super::shapes::SASS_ARCHS)); `None` for a GPU without one (the fatbin's PTX is
/// JIT-compiled there if `cc` is at least [`MIN_COMPUTE_CAPABILITY`](super::shapes::MIN_COMPUTE_CAPABILITY)).
pub fn sass_arch(cc: (i32, i32)) -> Option<&'static str> {
    super::shapes::SASS_ARCHS
        .iter()
        .find(|(c, _)| *c == cc)
        .map(|(_, a)| *a)
}

/// The devices this process opened through [`CudaDevice::shared`], one per ordinal.
static SHARED: Mutex<Vec<(usize, Arc<CudaDevice>)>> = Mutex::new(Vec::new());

impl CudaDevice {
    /// The process-wide handle of GPU `ordinal`, opened on first use (an op dispatched on a CUDA
    /// tensor uses it; opening a context per call would cost milliseconds).
    ///
    /// Errors: those of [`CudaDevice::open`].
    pub fn shared(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let mut all = SHARED.lock();
        if let Some((_, d)) = all.iter().find(|(o, _)| *o == ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(CudaDevice::open(ordinal)?);
        all.push((ordinal, d.clone()));
        Ok(d)
    }

    /// The process-wide handle of the GPU a CUDA tensor view lives on (`what` names the view).
    ///
    /// Errors: [`Error::Internal`] for a host view (a dispatch took its CUDA branch for host
    /// tensors), [`Error::Invalid`] for a negative ordinal, those of [`CudaDevice::open`].
    pub fn of_view(v: &crate::tensor::TensorView<'_>, what: &str) -> Result<Arc<CudaDevice>> {
        let crate::tensor::Device::Cuda(ordinal) = v.device() else {
            return Err(Error::Internal(format!(
                "CUDA branch called with `{what}` in host memory"
            )));
        };
        let ordinal = usize::try_from(ordinal)
            .map_err(|_| Error::invalid(what, format!("CUDA device {ordinal} does not exist")))?;
        CudaDevice::shared(ordinal)
    }

    /// Waits for all work on the device's context (every stream), so memory a framework wrote on
    /// its own stream is complete before a csa2 launch reads it.
    pub fn synchronize_context(&self) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(|e| cuda_error("context synchronize", e))
    }

    /// A dense CUDA tensor view's memory as a device buffer of `T` for one call; csa2 never frees
    /// it (dropping the [`Borrowed`] gives it back untouched).
    ///
    /// Errors: [`Error::Invalid`] for a view on another device or the host, [`Error::Shape`] for
    /// another dtype or a strided view.
    ///
    /// # Safety
    /// The view's memory must be a live allocation of this device's context for as long as the
    /// returned buffer is used (the view's own contract).
    pub unsafe fn borrow<T: crate::tensor::Element + DeviceRepr>(
        &self,
        v: &crate::tensor::TensorView<'_>,
        what: &str,
    ) -> Result<Borrowed<T>> {
        match v.device() {
            Device::Cuda(n) if n >= 0 && n as usize == self.ctx.ordinal() => {}
            other => {
                return Err(Error::invalid(
                    what,
                    format!("is on {other}, not on CUDA device {}", self.ctx.ordinal()),
                ))
            }
        }
        if v.dtype() != T::DTYPE || !v.is_contiguous() {
            return Err(Error::shape(
                what,
                format!("a dense {} tensor", T::DTYPE.name()),
                format!("{} with strides {:?}", v.dtype().name(), v.strides()),
            ));
        }
        // SAFETY: the caller guarantees a live allocation of this context holding `numel` T's at
        // the view's address; the slice is never freed (Borrowed leaks it on drop).
        let slice = unsafe {
            self.stream
                .upgrade_device_ptr::<T>(v.addr() as u64, v.numel().max(1))
        };
        Ok(Borrowed {
            slice: std::mem::ManuallyDrop::new(slice),
        })
    }
}

/// Caller-owned device memory seen as a [`CudaSlice`] for one call (see [`CudaDevice::borrow`]).
pub struct Borrowed<T: DeviceRepr> {
    slice: std::mem::ManuallyDrop<CudaSlice<T>>,
}

impl<T: DeviceRepr> std::ops::Deref for Borrowed<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T: DeviceRepr> std::ops::DerefMut for Borrowed<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T: DeviceRepr> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `leak` gives the pointer back without freeing the caller's
        // memory.
        let s = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
        s.leak();
    }
}

/// Launches `func` with the listed arguments on the device's stream and checks the launch.
///
/// Use: `launch!(dev, "module", "kernel", cfg, arg, ...)`; every argument is a reference (`&buf`,
/// `&mut buf`, `&scalar`); a null pointer is `&0u64`.
macro_rules! launch {
    ($dev:expr, $module:expr, $func:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let dev: &$crate::cuda::CudaDevice = $dev;
        let f = dev.function($module, $func)?;
        let mut b = dev.stream().launch_builder(&f);
        $( crate::cuda::driver::PushKernelArg::arg(&mut b, $arg); )*
        // SAFETY: the wrapper calling this passes the arguments in the order and with the types of
        // the kernel's signature (documented at the call) and has validated every buffer length
        // against the launch shape, so the kernel stays in bounds.
        unsafe { b.launch($cfg) }
            .map_err(|e| $crate::cuda::device::cuda_error(format!("launch {}", $func), e))?;
        dev.after_launch($func)?;
    }};
}
pub(crate) use launch;

/// Grid/block configuration helper.
pub(crate) fn cfg(grid: (u32, u32), block: u32) -> crate::cuda::driver::LaunchConfig {
    crate::cuda::driver::LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The largest `gridDim.y` (and `z`) a CUDA launch may use.
pub(crate) const MAX_GRID_Y: usize = 65_535;

/// A row count that becomes `gridDim.y` (one block row per row), or [`Error::Invalid`] naming
/// `what` when it exceeds [`MAX_GRID_Y`] — refused before anything is read or launched.
pub(crate) fn grid_rows(what: &str, rows: usize) -> Result<u32> {
    if rows > MAX_GRID_Y {
        return Err(Error::invalid(
            what,
            format!(
                "{rows} rows in one call; this kernel launches one grid row per row and CUDA \
                 allows at most {MAX_GRID_Y}: split the call"
            ),
        ));
    }
    Ok(rows as u32)
}

/// Checks a length and converts a count to the kernel's `int`.
pub(crate) fn check_len(what: &str, found: usize, expected: usize) -> Result<()> {
    if found != expected {
        return Err(Error::shape(what, expected, found));
    }
    Ok(())
}

/// A count as the kernels' 32-bit `int`, or an error naming it.
pub(crate) fn as_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::invalid(what, format!("{v} does not fit the kernel's 32-bit int")))
}

/// Errors with [`Error::Shape`] naming the first buffer shorter than its launch needs; `lens` are
/// `(name, elements found, elements needed)`, `family` prefixes the name ("mHC x").
pub(crate) fn check_lens<'n>(
    family: &str,
    lens: impl IntoIterator<Item = (&'n str, usize, usize)>,
) -> Result<()> {
    match lens.into_iter().find(|(_, found, want)| found < want) {
        Some((what, found, want)) => Err(Error::shape(
            format!("{family} {what}"),
            format!("≥ {want} elements"),
            found,
        )),
        None => Ok(()),
    }
}

/// An optional device buffer as a kernel's pointer argument: the buffer's device pointer, or
/// null (`launch!(…, &OrNull(opt), …)`; bind it to a local first, the launch borrows it).
pub(crate) struct OrNull<'b, T>(pub Option<&'b CudaSlice<T>>);

/// The null device pointer [`OrNull`] passes for `None`.
static NULL_DEVICE_PTR: u64 = 0;

// SAFETY: pushes exactly what the two existing impls push — the slice's own argument (with its
// stream-synchronization events) or a pointer to a static zero `CUdeviceptr` — both valid for 'b.
unsafe impl<'a, 'b: 'a, T> crate::cuda::driver::PushKernelArg<&'b OrNull<'b, T>>
    for crate::cuda::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, a: &'b OrNull<'b, T>) -> &mut Self {
        match a.0 {
            Some(s) => self.arg(s),
            None => self.arg(&NULL_DEVICE_PTR),
        }
    }
}

/// A tensor's memory as a device buffer for one launch: a host tensor's copy, or a device
/// tensor's memory borrowed in place ([`CudaDevice::stage`], [`CudaDevice::stage_out`]): what lets one
/// launch function serve host and device tensor views.
pub(crate) enum Staged<T: DeviceRepr> {
    Copied(CudaSlice<T>),
    Borrowed(Borrowed<T>),
}

impl<T: DeviceRepr> std::ops::Deref for Staged<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        match self {
            Staged::Copied(s) => s,
            Staged::Borrowed(b) => b,
        }
    }
}

impl<T: DeviceRepr> std::ops::DerefMut for Staged<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        match self {
            Staged::Copied(s) => s,
            Staged::Borrowed(b) => b,
        }
    }
}

impl CudaDevice {
    /// `v` on this device: uploaded from the host, or borrowed in place (dense `T` only).
    pub(crate) fn stage<T: Element + DeviceRepr + Default>(
        &self,
        v: &TensorView<'_>,
        what: &str,
    ) -> Result<Staged<T>> {
        match v.device() {
            Device::Cpu => Ok(Staged::Copied(self.upload(v.as_slice::<T>(what)?)?)),
            // SAFETY: a device view's contract (TensorView::from_raw_parts) is live memory of
            // its device for the view's lifetime, which outlives this call; `borrow` checks the
            // device, dtype and density.
            Device::Cuda(_) => Ok(Staged::Borrowed(unsafe { self.borrow::<T>(v, what)? })),
        }
    }

    /// An output `v` on this device: a zeroed buffer for a host tensor (copied back by
    /// [`CudaDevice::unstage`]), or the device tensor borrowed in place.
    pub(crate) fn stage_out<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        v: &TensorViewMut<'_>,
        what: &str,
    ) -> Result<Staged<T>> {
        match v.device() {
            Device::Cpu => {
                if v.dtype() != T::DTYPE || !v.is_contiguous() {
                    return Err(Error::shape(
                        what,
                        format!("a dense {} tensor", T::DTYPE.name()),
                        format!("{} with strides {:?}", v.dtype().name(), v.strides()),
                    ));
                }
                Ok(Staged::Copied(self.zeros::<T>(v.numel())?))
            }
            // SAFETY: as in `stage`; the mutable view's contract also makes it exclusive.
            Device::Cuda(_) => Ok(Staged::Borrowed(unsafe {
                self.borrow::<T>(&v.as_view(), what)?
            })),
        }
    }

    /// Copies a staged host output back into its tensor (waits for the stream); nothing for a
    /// device tensor.
    pub(crate) fn unstage<T: Element + DeviceRepr + Default + Clone>(
        &self,
        s: &Staged<T>,
        v: &mut TensorViewMut<'_>,
        what: &str,
    ) -> Result<()> {
        if let Staged::Copied(buf) = s {
            let host = self.download(buf)?;
            let dst = v.as_mut_slice::<T>(what)?;
            dst.copy_from_slice(&host[..dst.len()]);
        }
        Ok(())
    }
}

#[cfg(test)]
impl CudaDevice {
    /// A device buffer of this device as a CUDA tensor view of `shape` (unit tests of the CUDA
    /// branches; the buffer must outlive every use of the view).
    pub(crate) fn test_view<T: Element + DeviceRepr>(
        &self,
        b: &CudaSlice<T>,
        shape: &[usize],
    ) -> TensorView<'static> {
        use crate::cuda::driver::DevicePtr;
        let (p, _sync) = b.device_ptr(&self.stream);
        // SAFETY: `b` is live memory of this device holding `shape`'s elements (the caller's
        // contract above).
        unsafe {
            TensorView::from_raw_parts(
                p as usize as *const u8,
                shape,
                &crate::tensor::row_major_strides(shape),
                T::DTYPE,
                Device::Cuda(self.ctx.ordinal() as i32),
            )
        }
        .expect("a dense device view")
    }

    /// [`CudaDevice::test_view`] for an output.
    pub(crate) fn test_view_mut<T: Element + DeviceRepr>(
        &self,
        b: &CudaSlice<T>,
        shape: &[usize],
    ) -> TensorViewMut<'static> {
        use crate::cuda::driver::DevicePtr;
        let (p, _sync) = b.device_ptr(&self.stream);
        // SAFETY: as `test_view`; the test leaves `b` alone while the view is used.
        unsafe {
            TensorViewMut::from_raw_parts(
                p as usize as *mut u8,
                shape,
                &crate::tensor::row_major_strides(shape),
                T::DTYPE,
                Device::Cuda(self.ctx.ordinal() as i32),
            )
        }
        .expect("a dense device view")
    }
}

/// The device address of `v` for a kernel argument: `v` must be one of `dtypes` and dense
/// (row-major, no gaps), since the kernels index it as a flat array. `what` names the tensor in
/// the error. The device itself is checked by the caller's signature.
pub(crate) fn dense_device_addr(
    v: &crate::tensor::TensorView<'_>,
    dtypes: &[crate::tensor::DType],
    what: &str,
) -> Result<u64> {
    if !dtypes.contains(&v.dtype()) || !v.is_contiguous() {
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        return Err(Error::shape(
            what,
            format!("a dense {} tensor on the GPU", names.join(" or ")),
            format!("{} with strides {:?}", v.dtype().name(), v.strides()),
        ));
    }
    Ok(v.addr() as u64)
}
