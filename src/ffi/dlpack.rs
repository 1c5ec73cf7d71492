//! DLPack at the C ABI: a `repr(C)` mirror of `dlpack.h` (v1.x) and the checks that turn a
//! caller's borrowed `DLTensor*` into a typed, bounds-known view.
//!
//! Why our own mirror rather than a crate: the ABI is five plain structs fixed by the header, and the
//! value we add is the validation of *borrowed* descriptors (null data with a non-zero size, shape
//! products that overflow, device pointers where host memory is expected, strides, aliasing between
//! outputs and inputs). `tests/dlpack_layout.rs` checks every size and offset here against the real
//! header (`include/dlpack/dlpack.h`) compiled by the system C compiler. See docs/DESIGN.md.
//!
//! Ownership: csa2 never takes ownership of a `DLTensor`. Every export that receives one borrows it
//! (and the memory it points to) for the duration of the call only; nothing is retained.

use crate::error::{Error, Result};
use crate::shape::{Arg, Dims};
pub use crate::tensor::{DType, Device};
use crate::tensor::{TensorView, TensorViewMut};
use half::bf16;
use std::ffi::c_void;

// ---- the mirror of dlpack.h ---------------------------------------------------------------------

/// `DLPACK_MAJOR_VERSION` of the header this mirror was checked against.
pub const DLPACK_MAJOR_VERSION: u32 = 1;

/// `DLDeviceType::kDLCPU`: system memory the host can read.
pub const K_DL_CPU: i32 = 1;
/// `kDLCUDA`: memory on a CUDA device (not host-readable).
pub const K_DL_CUDA: i32 = 2;
/// `kDLCUDAHost`: pinned host memory (`cudaMallocHost`); host-readable.
pub const K_DL_CUDA_HOST: i32 = 3;
/// `kDLROCM`: memory on a ROCm device.
pub const K_DL_ROCM: i32 = 10;
/// `kDLCUDAManaged`: CUDA unified memory (`cudaMallocManaged`); host-readable.
pub const K_DL_CUDA_MANAGED: i32 = 13;

/// `DLDataTypeCode::kDLInt`.
pub const K_DL_INT: u8 = 0;
/// `kDLUInt`.
pub const K_DL_UINT: u8 = 1;
/// `kDLFloat` (IEEE binary16/32/64).
pub const K_DL_FLOAT: u8 = 2;
/// `kDLBfloat` (bfloat16).
pub const K_DL_BFLOAT: u8 = 4;
/// `kDLBool`.
pub const K_DL_BOOL: u8 = 6;

/// `DLDevice`: where a tensor's memory lives. `device_type` is kept as a plain `i32` (not a Rust
/// enum) because a caller may send any value and reading an unknown enum discriminant would be UB.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    /// One of the `K_DL_*` device codes.
    pub device_type: i32,
    /// Device ordinal (0 for the host).
    pub device_id: i32,
}

/// `DLDataType`: element type as (type code, bits, lanes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    /// One of the `K_DL_*` type codes.
    pub code: u8,
    /// Bits per lane (32 for float32).
    pub bits: u8,
    /// Lanes per element; csa2 accepts 1 only.
    pub lanes: u16,
}

/// `DLTensor`: a borrowed, non-owning descriptor of an n-d array.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLTensor {
    /// Base pointer (host or device address); element 0 is at `data + byte_offset`.
    pub data: *mut c_void,
    /// Where `data` lives.
    pub device: DLDevice,
    /// Number of dimensions (0 = scalar).
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` sizes, outermost first.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for compact row-major.
    pub strides: *mut i64,
    /// Bytes from `data` to element 0.
    pub byte_offset: u64,
}

/// `DLManagedTensor` (pre-1.0 capsule payload, still what `torch.utils.dlpack.to_dlpack` makes).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// Producer's context for `deleter`.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor; called once by the consumer when done (may be null).
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLPackVersion {
    /// ABI-breaking version.
    pub major: u32,
    /// Compatible additions.
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack ≥ 1.0 capsule payload).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// Version of the producer's header.
    pub version: DLPackVersion,
    /// Producer's context for `deleter`.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor (may be null).
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*` bits (read-only, is-copied, ...).
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the consumer must not write through this tensor.
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1;

// ---- validation ---------------------------------------------------------------------------------

/// Largest `ndim` csa2 accepts (every op uses ≤ 4; 8 leaves room and bounds the shape read).
pub const MAX_NDIM: i32 = 8;

// DLPack's encoding of the crate's dtypes and devices (inherent impls beside the mirror, so the
// types themselves stay defined once, in `crate::tensor`).
impl DType {
    /// The DLPack (code, bits) pair of this type.
    pub fn code_bits(self) -> (u8, u8) {
        match self {
            DType::F32 => (K_DL_FLOAT, 32),
            DType::Bf16 => (K_DL_BFLOAT, 16),
            DType::F16 => (K_DL_FLOAT, 16),
            DType::U8 => (K_DL_UINT, 8),
            DType::I32 => (K_DL_INT, 32),
            DType::I64 => (K_DL_INT, 64),
        }
    }
    fn from_dl(t: DLDataType) -> Option<DType> {
        if t.lanes != 1 {
            return None;
        }
        DType::ALL
            .into_iter()
            .find(|d| d.code_bits() == (t.code, t.bits))
    }
}

fn dl_type_name(t: DLDataType) -> String {
    let base = match t.code {
        K_DL_INT => "int",
        K_DL_UINT => "uint",
        K_DL_FLOAT => "float",
        K_DL_BFLOAT => "bfloat",
        K_DL_BOOL => "bool",
        _ => return format!("dtype(code={}, bits={}, lanes={})", t.code, t.bits, t.lanes),
    };
    if t.lanes == 1 {
        format!("{base}{}", t.bits)
    } else {
        format!("{base}{}x{}", t.bits, t.lanes)
    }
}

impl Device {
    fn from_dl(d: DLDevice) -> Result<Device> {
        match d.device_type {
            K_DL_CPU | K_DL_CUDA_HOST | K_DL_CUDA_MANAGED => Ok(Device::Cpu),
            K_DL_CUDA => Ok(Device::Cuda(d.device_id)),
            other => Err(Error::Unsupported(format!(
                "DLPack device type {other} ({}) — csa2 reads host (kDLCPU=1, kDLCUDAHost=3, \
                 kDLCUDAManaged=13) or CUDA (kDLCUDA=2) memory",
                device_name(other)
            ))),
        }
    }
}

fn device_name(t: i32) -> &'static str {
    match t {
        K_DL_CPU => "kDLCPU",
        K_DL_CUDA => "kDLCUDA",
        K_DL_CUDA_HOST => "kDLCUDAHost",
        4 => "kDLOpenCL",
        7 => "kDLVulkan",
        8 => "kDLMetal",
        9 => "kDLVPI",
        K_DL_ROCM => "kDLROCM",
        11 => "kDLROCMHost",
        12 => "kDLExtDev",
        K_DL_CUDA_MANAGED => "kDLCUDAManaged",
        14 => "kDLOneAPI",
        15 => "kDLWebGPU",
        16 => "kDLHexagon",
        _ => "unknown",
    }
}

/// Reads and validates the descriptor at `t` into a [`TensorView`] (strided views allowed), naming
/// it `name` in every error.
///
/// Guarantees on success: `ndim ∈ [0, 8]`; every dim ≥ 0; every stride ≥ 0 (null strides mean
/// row-major); the element count and the byte span (offset of the last element + 1, times the
/// element size) fit `isize`, so any product of dims is safe; the dtype is one of [`DType`] with
/// one lane; `data` is non-null and aligned to the element size whenever the tensor is non-empty;
/// `data + byte_offset + span` does not wrap.
///
/// Errors: [`Error::NullPointer`] (null descriptor, or null shape with `ndim > 0`, or null data
/// with a non-zero size), [`Error::Shape`] (ndim, negative dim or stride, overflow, misalignment),
/// [`Error::Invalid`] (dtype), [`Error::Unsupported`] (device type).
///
/// # Safety
/// `t` must be null or point to a readable `DLTensor` whose `shape` (and `strides`, if
/// non-null) point to `ndim` readable `i64`s, and whose data span stays valid (on its device) and
/// unaliased by other threads for `'a`. Everything else (values inside the struct) is checked.
pub unsafe fn tensor_from_dlpack<'a>(
    t: *const DLTensor,
    name: &'static str,
) -> Result<TensorView<'a>> {
    // SAFETY: forwarded contract.
    let (ptr, shape, strides, dtype, device) = unsafe { read_descriptor(t, name) }?;
    // SAFETY: `read_descriptor` checked pointer, alignment and span; validity for 'a is the
    // caller's contract.
    unsafe { TensorView::from_raw_parts(ptr, &shape, &strides, dtype, device) }
}

/// [`tensor_from_dlpack`] for an output tensor.
///
/// # Safety
/// As [`tensor_from_dlpack`], and the span must be writable and not accessed by anyone else for
/// `'a`.
pub unsafe fn tensor_mut_from_dlpack<'a>(
    t: *const DLTensor,
    name: &'static str,
) -> Result<TensorViewMut<'a>> {
    // SAFETY: forwarded contract.
    let (ptr, shape, strides, dtype, device) = unsafe { read_descriptor(t, name) }?;
    // SAFETY: as in `tensor_from_dlpack`, plus writability and exclusivity from the contract.
    unsafe { TensorViewMut::from_raw_parts(ptr, &shape, &strides, dtype, device) }
}

type Descriptor = (*mut u8, Vec<usize>, Vec<usize>, DType, Device);

/// The checks of [`tensor_from_dlpack`]; returns (element 0 address, shape, element strides,
/// dtype, device).
///
/// # Safety
/// As [`tensor_from_dlpack`].
unsafe fn read_descriptor(t: *const DLTensor, name: &'static str) -> Result<Descriptor> {
    if t.is_null() {
        return Err(Error::NullPointer(name));
    }
    // SAFETY: non-null and readable per this function's contract; DLTensor is plain data.
    let t = unsafe { std::ptr::read_unaligned(t) };
    if !(0..=MAX_NDIM).contains(&t.ndim) {
        return Err(Error::shape(
            format!("{name}.ndim"),
            format!("0..={MAX_NDIM}"),
            t.ndim,
        ));
    }
    let ndim = t.ndim as usize;
    if ndim > 0 && t.shape.is_null() {
        return Err(Error::NullPointer(name));
    }
    let dtype = DType::from_dl(t.dtype).ok_or_else(|| {
        Error::invalid(
            format!("{name}.dtype"),
            format!(
                "{} is not an element type csa2 accepts (float32, bfloat16, float16, uint8, \
                 int32, int64; one lane)",
                dl_type_name(t.dtype)
            ),
        )
    })?;
    let device = Device::from_dl(t.device)?;
    let raw_shape: Vec<i64> = (0..ndim)
        // SAFETY: `shape` points to `ndim` readable i64s per the contract (checked non-null).
        .map(|i| unsafe { std::ptr::read_unaligned(t.shape.add(i)) })
        .collect();
    let mut shape = Vec::with_capacity(ndim);
    for (i, &d) in raw_shape.iter().enumerate() {
        let d = usize::try_from(d)
            .map_err(|_| Error::shape(format!("{name}.shape[{i}]"), "a size ≥ 0", d))?;
        shape.push(d);
    }
    // The product skips zero dims: an empty tensor of shape [0, 2^62] would otherwise pass
    // and hand the ops a dim whose products with the others overflow (found by
    // tests/ffi_fuzz.rs). The element count is zero exactly when some dim is zero.
    let numel = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| {
            n.checked_mul(dtype.size())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| {
            Error::shape(
                format!("{name}.shape"),
                format!("a size whose {} byte count fits isize", dtype.name()),
                format!("{raw_shape:?} (element count overflows)"),
            )
        })?;
    let numel = if shape.contains(&0) { 0 } else { numel };
    let strides: Vec<usize> = if t.strides.is_null() {
        crate::tensor::row_major_strides(&shape)
    } else {
        let raw: Vec<i64> = (0..ndim)
            // SAFETY: non-null `strides` points to `ndim` readable i64s per the contract.
            .map(|k| unsafe { std::ptr::read_unaligned(t.strides.add(k)) })
            .collect();
        let mut v = Vec::with_capacity(ndim);
        for (i, &st) in raw.iter().enumerate() {
            // A size-1 dim (or any dim of an empty tensor) never steps, so its stride is
            // irrelevant: torch gives such dims arbitrary strides. Any other negative stride is
            // refused.
            let st = if shape[i] <= 1 || numel == 0 {
                st.max(0)
            } else {
                st
            };
            v.push(usize::try_from(st).map_err(|_| {
                Error::shape(
                    format!("{name}.strides"),
                    "non-negative strides (call .contiguous())",
                    format!("{raw:?}"),
                )
            })?);
        }
        v
    };
    // Byte span: offset of the last element + 1, in bytes (checked again by TensorView).
    let span = if numel == 0 {
        Some(0)
    } else {
        shape
            .iter()
            .zip(&strides)
            .try_fold(0usize, |a, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| a.checked_add(x))
            })
            .and_then(|l| l.checked_add(1))
            .and_then(|n| n.checked_mul(dtype.size()))
            .filter(|&b| b <= isize::MAX as usize)
    };
    let Some(bytes) = span else {
        return Err(Error::shape(
            format!("{name}.strides"),
            format!("strides whose {} byte span fits isize", dtype.name()),
            format!("shape {shape:?}, strides {strides:?} (overflows)"),
        ));
    };
    let ptr = if numel == 0 {
        std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8
    } else {
        if t.data.is_null() {
            return Err(Error::NullPointer(name));
        }
        let base = t.data as usize;
        let offset = usize::try_from(t.byte_offset).ok();
        let start = offset.and_then(|o| base.checked_add(o));
        let end = start.and_then(|s| s.checked_add(bytes));
        let (Some(start), Some(_)) = (start, end) else {
            return Err(Error::shape(
                format!("{name}.byte_offset"),
                "data + byte_offset + size within the address space",
                format!(
                    "data={base:#x}, byte_offset={}, bytes={bytes}",
                    t.byte_offset
                ),
            ));
        };
        if start % dtype.size() != 0 {
            return Err(Error::shape(
                format!("{name}.data"),
                format!(
                    "an address aligned to {} bytes ({})",
                    dtype.size(),
                    dtype.name()
                ),
                format!("{start:#x}"),
            ));
        }
        start as *mut u8
    };
    Ok((ptr, shape, strides, dtype, device))
}

/// A validated, borrowed, compact row-major view of a caller's `DLTensor` as the op exports take
/// it: a [`TensorView`] with its argument name, with the guarantees [`View::from_raw`] lists.
#[derive(Debug)]
pub struct View<'a> {
    name: &'static str,
    t: TensorView<'a>,
}

impl<'a> View<'a> {
    /// Reads and validates the descriptor at `t`, naming it `name` in every error.
    ///
    /// Guarantees on success: those of [`tensor_from_dlpack`], and the layout is compact row-major
    /// (null strides, or strides equal to the row-major ones — size-1 dims may carry any stride,
    /// as torch gives them).
    ///
    /// Errors: those of [`tensor_from_dlpack`], and [`Error::Shape`] for non-contiguous strides.
    ///
    /// # Safety
    /// As [`tensor_from_dlpack`].
    pub unsafe fn from_raw(t: *const DLTensor, name: &'static str) -> Result<View<'a>> {
        // SAFETY: forwarded contract.
        let tv = unsafe { tensor_from_dlpack(t, name) }?;
        if !tv.is_contiguous() {
            return Err(Error::shape(
                format!("{name}.strides"),
                format!(
                    "compact row-major strides for shape {:?} (call .contiguous())",
                    tv.shape()
                ),
                format!("{:?}", tv.strides()),
            ));
        }
        Ok(View { name, t: tv })
    }

    /// [`View::from_raw`] for an optional argument: a null pointer is `None`.
    ///
    /// # Safety
    /// As [`View::from_raw`].
    pub unsafe fn from_raw_opt(t: *const DLTensor, name: &'static str) -> Result<Option<View<'a>>> {
        if t.is_null() {
            return Ok(None);
        }
        // SAFETY: forwarded contract.
        unsafe { View::from_raw(t, name) }.map(Some)
    }

    /// The tensor view (pointer, shape, strides, dtype, device).
    pub fn tensor(&self) -> &TensorView<'a> {
        &self.t
    }

    /// Argument name used in errors.
    pub fn name(&self) -> &'static str {
        self.name
    }
    /// Shape, outermost first.
    pub fn shape(&self) -> &[usize] {
        self.t.shape()
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.t.dtype()
    }
    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.t.device()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.t.numel()
    }
    /// Byte range `[start, end)` of the elements (empty for an empty tensor).
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.t.byte_range()
    }

    /// Checks dtype and shape against `arg` of the op's signature (binding free names in
    /// `dims`). Errors: [`Error::Shape`] naming this argument, expected and found.
    pub fn expect(&self, arg: &Arg, dims: &mut Dims) -> Result<()> {
        arg.check_as(self.name, self.t.dtype(), self.t.shape(), dims)
    }

    /// Errors unless the memory is host-readable: [`Error::Unsupported`] for a CUDA tensor (this
    /// call has no CUDA path in any build, so `CSA2_ERR_NO_CUDA_BUILD` would send the caller to
    /// rebuild for nothing; calls that do have one report a missing `cuda` feature themselves).
    pub fn require_host(&self) -> Result<()> {
        match self.t.device() {
            Device::Cpu => Ok(()),
            d => Err(Error::Unsupported(format!(
                "`{}` is on {d}, but this call needs host memory (it has no CUDA path)",
                self.name
            ))),
        }
    }

    /// Host memory of element type `want`: what a typed slice of the view needs.
    fn require_host_of(&self, want: DType) -> Result<()> {
        self.require_host()?;
        if self.t.dtype() != want {
            return Err(Error::shape(
                format!("{}.dtype", self.name),
                want.name(),
                self.t.dtype().name(),
            ));
        }
        Ok(())
    }

    fn typed<T>(&self, want: DType) -> Result<&'a [T]> {
        self.require_host_of(want)?;
        // SAFETY: `from_raw` checked non-null (or dangling for empty), alignment for the element
        // size, the byte count and no wrap-around; the caller's contract keeps the memory valid
        // for 'a; host-readable was checked just above.
        Ok(unsafe { std::slice::from_raw_parts(self.t.addr() as *const T, self.t.numel()) })
    }

    fn typed_mut<T>(&mut self, want: DType) -> Result<&'a mut [T]> {
        self.require_host_of(want)?;
        // SAFETY: as in `typed`; exclusivity against the other arguments of the same call is
        // established by `check_disjoint`, which every export runs before taking a mutable view.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.t.addr() as *mut T, self.t.numel()) })
    }

    /// The elements as `f32`: borrowed for float32, converted (one pass) for bfloat16/float16.
    pub fn f32s(&self) -> Result<std::borrow::Cow<'a, [f32]>> {
        self.require_host()?;
        self.t.to_f32(self.name)
    }

    /// The elements as `i64` indices/positions (int32 or int64 accepted; always copied).
    pub fn i64s(&self) -> Result<Vec<i64>> {
        self.require_host()?;
        self.t.to_i64(self.name)
    }

    /// The writable view of an output argument, for an op entry that dispatches on the device.
    /// Exclusivity against the call's other arguments is what `check_disjoint` establishes; the
    /// `&mut` borrow keeps this the only writer while it lives.
    pub fn tensor_mut(&mut self) -> Result<TensorViewMut<'_>> {
        // SAFETY: the descriptor was validated by `from_raw` (span, alignment, device); the
        // caller's contract makes the memory valid and unused by others for the call, and
        // `check_disjoint` (run by every export before taking an output) keeps it apart from the
        // other arguments.
        unsafe {
            TensorViewMut::from_raw_parts(
                self.t.addr() as *mut u8,
                self.t.shape(),
                self.t.strides(),
                self.t.dtype(),
                self.t.device(),
            )
        }
    }

    /// Borrowed `i32` elements (int32 only).
    pub fn i32s(&self) -> Result<&'a [i32]> {
        self.typed(DType::I32)
    }
    /// Borrowed `bf16` elements (bfloat16 only).
    pub fn bf16s(&self) -> Result<&'a [bf16]> {
        self.typed(DType::Bf16)
    }
    /// Mutable `bf16` elements (bfloat16 only).
    pub fn bf16s_mut(&mut self) -> Result<&'a mut [bf16]> {
        self.typed_mut(DType::Bf16)
    }
    /// Address of element 0 (`data + byte_offset`) on the tensor's device, for a kernel
    /// argument; never dereferenced on the host for device memory.
    pub fn addr(&self) -> u64 {
        self.t.addr() as u64
    }
    /// Borrowed bytes (uint8 only).
    pub fn bytes(&self) -> Result<&'a [u8]> {
        self.typed(DType::U8)
    }
    /// Mutable `i32` elements (int32 only).
    pub fn i32s_mut(&mut self) -> Result<&'a mut [i32]> {
        self.typed_mut(DType::I32)
    }
    /// Mutable `f32` elements (float32 only).
    pub fn f32s_mut(&mut self) -> Result<&'a mut [f32]> {
        self.typed_mut(DType::F32)
    }
    /// Mutable `i64` elements (int64 only).
    pub fn i64s_mut(&mut self) -> Result<&'a mut [i64]> {
        self.typed_mut(DType::I64)
    }
    /// Mutable bytes (uint8 only).
    pub fn bytes_mut(&mut self) -> Result<&'a mut [u8]> {
        self.typed_mut(DType::U8)
    }

    /// Writes `src` (f32, one value per element) into this tensor, rounding to its float dtype
    /// (round-to-nearest-even for bfloat16/float16). Errors on a length or dtype mismatch.
    pub fn write_f32s(&mut self, src: &[f32]) -> Result<()> {
        self.require_host()?;
        let name = self.name;
        self.tensor_mut()?.write_f32s(name, src)
    }
}

/// Errors if any output's byte range overlaps any other argument's (inputs or outputs).
///
/// Outputs are written through `&mut` slices, so an overlap would be undefined behaviour on our
/// side and a silent wrong answer on the caller's; we refuse it with [`Error::Invalid`] naming
/// both arguments. Also requires all tensors to be on the same [`Device`].
pub fn check_disjoint(inputs: &[&View<'_>], outputs: &[&View<'_>]) -> Result<()> {
    let all: Vec<&View<'_>> = inputs.iter().chain(outputs).copied().collect();
    if let Some(first) = all.first() {
        if let Some(other) = all.iter().find(|v| v.device() != first.device()) {
            return Err(Error::invalid(
                other.name,
                format!(
                    "is on {} but `{}` is on {}; all tensors of one call must share a device",
                    other.device(),
                    first.name,
                    first.device()
                ),
            ));
        }
    }
    for (k, o) in outputs.iter().enumerate() {
        let r = o.byte_range();
        if r.is_empty() {
            continue;
        }
        let others = inputs.iter().chain(outputs.iter().take(k));
        for x in others {
            let q = x.byte_range();
            if !q.is_empty() && r.start < q.end && q.start < r.end {
                return Err(Error::invalid(
                    o.name,
                    format!(
                        "output memory overlaps `{}` (bytes {:#x}..{:#x} vs {:#x}..{:#x}); \
                         outputs must not alias other arguments",
                        x.name, r.start, r.end, q.start, q.end
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Validates a `DLTensor` exactly as every csa2 op does and writes a one-line description
/// (`"float32[2, 3] host"`) into `buf` (capacity `len` bytes, NUL-terminated, truncated if short).
///
/// For bindings to check what they hand over before calling an op; costs no more than the check.
/// `t` is borrowed for the call only. Thread-safe. Errors: every error of [`View::from_raw`]
/// (`CSA2_ERR_NULL_POINTER`, `CSA2_ERR_SHAPE`, `CSA2_ERR_INVALID_ARGUMENT`, `CSA2_ERR_UNSUPPORTED`),
/// with the reason in the last error.
///
/// # Safety
/// `t` must be null or point to a readable `DLTensor` whose `shape`/`strides` arrays hold `ndim`
/// entries; `buf` must be null or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn csa2_dlpack_describe(
    t: *const DLTensor,
    buf: *mut std::ffi::c_char,
    len: usize,
) -> super::Csa2Status {
    super::guarded("csa2_dlpack_describe", || {
        // SAFETY: forwarded caller contract (see above).
        let v = unsafe { View::from_raw(t, "tensor") }?;
        let place = match v.device() {
            Device::Cpu => "host".to_string(),
            Device::Cuda(i) => format!("cuda:{i}"),
        };
        let text = format!("{}{:?} {place}", v.dtype().name(), v.shape());
        if !buf.is_null() && len > 0 {
            let n = text.len().min(len - 1);
            // SAFETY: `buf` is writable for `len` ≥ n + 1 bytes (caller's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        Ok(())
    })
}

/// A required host tensor.
///
/// # Safety
/// As [`View::from_raw`].
pub(super) unsafe fn host<'a>(t: *const DLTensor, name: &'static str) -> Result<View<'a>> {
    // SAFETY: forwarded caller contract.
    let v = unsafe { View::from_raw(t, name) }?;
    v.require_host()?;
    Ok(v)
}

/// An optional host tensor (null → `None`).
///
/// # Safety
/// As [`View::from_raw`].
pub(super) unsafe fn host_opt<'a>(
    t: *const DLTensor,
    name: &'static str,
) -> Result<Option<View<'a>>> {
    if t.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded caller contract.
    unsafe { host(t, name) }.map(Some)
}

/// Writes `f`'s f32 results into a float output: straight into float32 memory, through a temporary
/// for bfloat16/float16.
pub(super) fn fill_floats(out: &mut View, f: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    if out.dtype() == DType::F32 {
        f(out.f32s_mut()?)
    } else {
        let mut tmp = vec![0.0f32; out.numel()];
        f(&mut tmp)?;
        out.write_f32s(&tmp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(
        data: *mut c_void,
        dtype: DType,
        shape: &mut [i64],
        strides: Option<&mut [i64]>,
    ) -> DLTensor {
        let (code, bits) = dtype.code_bits();
        crate::ffi::test_support::host_tensor(data, code, bits, shape, strides)
    }

    #[test]
    fn contiguous_f32_view_reads_values() {
        let mut buf = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut shape = [2i64, 3];
        let mut strides = [3i64, 1];
        let t = desc(
            buf.as_mut_ptr().cast(),
            DType::F32,
            &mut shape,
            Some(&mut strides),
        );
        let v = unsafe { View::from_raw(&t, "x") }.unwrap();
        assert_eq!(v.shape(), &[2, 3]);
        assert_eq!(&*v.f32s().unwrap(), &buf);
        let mut dims = Dims::default();
        // topk's logits [T, N] bind T = 2; mHC's pre_prev [T, 4] then fails, naming this view.
        v.expect(&crate::ops::topk::signature::LOGITS, &mut dims)
            .unwrap();
        assert_eq!(dims.get("T"), Some(2));
        let e = v
            .expect(&crate::ops::mhc::signature::PRE_PREV, &mut dims)
            .unwrap_err();
        assert!(
            e.to_string().contains("x: expected [T=2, 4], found [2, 3]"),
            "{e}"
        );
    }

    #[test]
    fn size_one_dims_may_carry_any_stride_and_transposes_are_refused() {
        let mut buf = [0.0f32; 6];
        let mut shape = [1i64, 6];
        let mut strides = [99i64, 1];
        let t = desc(
            buf.as_mut_ptr().cast(),
            DType::F32,
            &mut shape,
            Some(&mut strides),
        );
        assert!(unsafe { View::from_raw(&t, "x") }.is_ok());
        let mut shape = [2i64, 3];
        let mut strides = [1i64, 2];
        let t = desc(
            buf.as_mut_ptr().cast(),
            DType::F32,
            &mut shape,
            Some(&mut strides),
        );
        let e = unsafe { View::from_raw(&t, "x") }.unwrap_err().to_string();
        assert!(e.contains("x.strides") && e.contains("[1, 2]"), "{e}");
    }

    #[test]
    fn malformed_descriptors_are_typed_errors() {
        let mut buf = [0u8; 16];
        // Null descriptor.
        let e = unsafe { View::from_raw(std::ptr::null(), "q") }.unwrap_err();
        assert!(matches!(e, Error::NullPointer("q")));
        // Null data with a non-zero size.
        let mut shape = [4i64];
        let t = desc(std::ptr::null_mut(), DType::F32, &mut shape, None);
        assert!(matches!(
            unsafe { View::from_raw(&t, "q") },
            Err(Error::NullPointer("q"))
        ));
        // Null data with zero size is a valid empty tensor.
        let mut shape = [0i64, 512];
        let t = desc(std::ptr::null_mut(), DType::F32, &mut shape, None);
        let v = unsafe { View::from_raw(&t, "q") }.unwrap();
        assert_eq!(v.numel(), 0);
        assert!(v.f32s().unwrap().is_empty());
        // Negative dimension.
        let mut shape = [2i64, -1];
        let t = desc(buf.as_mut_ptr().cast(), DType::U8, &mut shape, None);
        let e = unsafe { View::from_raw(&t, "q") }.unwrap_err().to_string();
        assert!(e.contains("q.shape[1]") && e.contains("-1"), "{e}");
        // Shape product overflow.
        let mut shape = [1i64 << 40, 1 << 40];
        let t = desc(buf.as_mut_ptr().cast(), DType::F32, &mut shape, None);
        let e = unsafe { View::from_raw(&t, "q") }.unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        // An empty tensor whose other dims multiply past isize (the ops multiply dims).
        let mut shape = [0i64, i64::MAX, 64];
        let t = desc(buf.as_mut_ptr().cast(), DType::F32, &mut shape, None);
        let e = unsafe { View::from_raw(&t, "q") }.unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let mut shape = [0i64, 1 << 20, 64];
        let t = desc(std::ptr::null_mut(), DType::F32, &mut shape, None);
        assert_eq!(unsafe { View::from_raw(&t, "q") }.unwrap().numel(), 0);
        // Byte count overflows isize even though the element count fits.
        let mut shape = [(isize::MAX as i64) / 2];
        let t = desc(buf.as_mut_ptr().cast(), DType::F32, &mut shape, None);
        assert!(unsafe { View::from_raw(&t, "q") }.is_err());
        // ndim out of range and null shape.
        let mut shape = [1i64];
        let mut t = desc(buf.as_mut_ptr().cast(), DType::U8, &mut shape, None);
        t.ndim = 9;
        assert!(unsafe { View::from_raw(&t, "q") }
            .unwrap_err()
            .to_string()
            .contains("q.ndim"));
        t.ndim = -1;
        assert!(unsafe { View::from_raw(&t, "q") }.is_err());
        t.ndim = 1;
        t.shape = std::ptr::null_mut();
        assert!(matches!(
            unsafe { View::from_raw(&t, "q") },
            Err(Error::NullPointer("q"))
        ));
        // Unknown dtype, multi-lane dtype.
        let mut shape = [2i64];
        let mut t = desc(buf.as_mut_ptr().cast(), DType::U8, &mut shape, None);
        t.dtype = DLDataType {
            code: 5,
            bits: 64,
            lanes: 1,
        };
        let e = unsafe { View::from_raw(&t, "q") }.unwrap_err().to_string();
        assert!(e.contains("q.dtype"), "{e}");
        t.dtype = DLDataType {
            code: K_DL_FLOAT,
            bits: 32,
            lanes: 4,
        };
        assert!(unsafe { View::from_raw(&t, "q") }
            .unwrap_err()
            .to_string()
            .contains("float32x4"));
        // Misaligned f32 pointer (through byte_offset; the u32 buffer is 4-aligned).
        let mut words = [0u32; 4];
        let mut t = desc(words.as_mut_ptr().cast(), DType::F32, &mut shape, None);
        t.byte_offset = 1;
        let e = unsafe { View::from_raw(&t, "q") }.unwrap_err().to_string();
        assert!(e.contains("aligned to 4"), "{e}");
        // byte_offset that wraps the address space.
        t.byte_offset = u64::MAX - 2;
        assert!(unsafe { View::from_raw(&t, "q") }
            .unwrap_err()
            .to_string()
            .contains("byte_offset"));
        // Unknown device type.
        let mut t = desc(buf.as_mut_ptr().cast(), DType::U8, &mut shape, None);
        t.device.device_type = 8;
        let e = unsafe { View::from_raw(&t, "q") }.unwrap_err().to_string();
        assert!(e.contains("kDLMetal"), "{e}");
    }

    #[test]
    fn strided_descriptors_become_tensor_views_but_not_op_views() {
        // One layer of a vLLM-style pool: [blocks=3, slots=4, record=8] u8 inside per-block slabs
        // of 2 layers (block stride 64 bytes), starting at layer 1 (byte_offset 32).
        let mut pool = [0u8; 3 * 64];
        let mut shape = [3i64, 4, 8];
        let mut strides = [64i64, 8, 1];
        let mut t = desc(
            pool.as_mut_ptr().cast(),
            DType::U8,
            &mut shape,
            Some(&mut strides),
        );
        t.byte_offset = 32;
        let v = unsafe { tensor_from_dlpack(&t, "pool") }.unwrap();
        assert_eq!(v.shape(), &[3, 4, 8]);
        assert_eq!(v.strides(), &[64, 8, 1]);
        assert_eq!(v.addr(), pool.as_ptr() as usize + 32);
        assert_eq!(v.byte_range().len(), 2 * 64 + 3 * 8 + 8);
        let e = unsafe { View::from_raw(&t, "pool") }
            .unwrap_err()
            .to_string();
        assert!(e.contains("pool.strides"), "{e}");
        // Negative strides are refused; so is a span that overflows.
        let mut strides = [-64i64, 8, 1];
        t.strides = strides.as_mut_ptr();
        let e = unsafe { tensor_from_dlpack(&t, "pool") }
            .unwrap_err()
            .to_string();
        assert!(e.contains("non-negative"), "{e}");
        let mut strides = [i64::MAX / 2, 8, 1];
        t.strides = strides.as_mut_ptr();
        let e = unsafe { tensor_from_dlpack(&t, "pool") }
            .unwrap_err()
            .to_string();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn cuda_pointer_where_host_memory_is_needed_is_refused() {
        let mut shape = [4i64];
        // A device address is never dereferenced: the check happens before any slice is made.
        let mut t = desc(
            0x7f00_0000_0000usize as *mut c_void,
            DType::F32,
            &mut shape,
            None,
        );
        t.device = DLDevice {
            device_type: K_DL_CUDA,
            device_id: 1,
        };
        let v = unsafe { View::from_raw(&t, "kv") }.unwrap();
        assert_eq!(v.device(), Device::Cuda(1));
        let e = v.f32s().unwrap_err().to_string();
        assert!(e.contains("`kv` is on CUDA device 1"), "{e}");
    }

    #[test]
    fn bf16_in_and_out_round_to_nearest_even() {
        let mut buf = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        let mut shape = [2i64];
        let t = desc(buf.as_mut_ptr().cast(), DType::Bf16, &mut shape, None);
        let mut v = unsafe { View::from_raw(&t, "y") }.unwrap();
        assert_eq!(&*v.f32s().unwrap(), &[1.5, -2.0]);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down to 1.0).
        v.write_f32s(&[1.0 + 1.0 / 256.0, 3.0]).unwrap();
        assert_eq!(buf[0].to_f32(), 1.0);
        assert_eq!(buf[1].to_f32(), 3.0);
    }

    #[test]
    fn overlapping_output_is_refused() {
        let mut buf = [0.0f32; 8];
        let base = buf.as_mut_ptr();
        let mut s1 = [4i64];
        let mut s2 = [4i64];
        let a = desc(base.cast(), DType::F32, &mut s1, None);
        let mut b = desc(base.cast(), DType::F32, &mut s2, None);
        b.byte_offset = 8; // elements 2..6 overlap a's 0..4
        let (va, vb) = unsafe {
            (
                View::from_raw(&a, "x").unwrap(),
                View::from_raw(&b, "out").unwrap(),
            )
        };
        let e = check_disjoint(&[&va], &[&vb]).unwrap_err().to_string();
        assert!(e.contains("`out`") && e.contains("overlaps `x`"), "{e}");
        b.byte_offset = 16; // elements 4..8: adjacent, not overlapping
        let vb = unsafe { View::from_raw(&b, "out") }.unwrap();
        check_disjoint(&[&va], &[&vb]).unwrap();
    }
}
