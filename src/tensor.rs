//! The one tensor view of the crate: a borrowed pointer with its shape, strides, element type and
//! device, and the shape signatures ops declare once and every face (C ABI, CLI, Rust) checks.
//!
//! - [`TensorView`] / [`TensorViewMut`] borrow memory for `'a` without owning it. They are made from
//!   a host slice ([`TensorView::from_host_slice`]: a dense row-major Rust or `.npy` tensor), from a
//!   DLPack descriptor (`ffi::dlpack`, host or CUDA memory, strided) or, unsafely, from raw parts
//!   (device buffers of the `cuda` feature).
//! - Strides are counted in **elements**, as DLPack and torch count them; the byte stride of dim i is
//!   `strides[i] · dtype.size()`. Strides are non-negative (csa2 refuses negative strides: no torch
//!   op the engines run produces them). A view is *contiguous* when its strides are the row-major
//!   ones (size-1 dims may carry any stride, as torch gives them). Strided views are representable
//!   because vLLM's KV pools are strided: the block stride of one layer's view is a per-block slab of
//!   all layers, not `slots × record`.
//! - [`Device`]: where the memory is. Host-readable memory (CPU, CUDA pinned, CUDA managed) is
//!   [`Device::Cpu`]; memory only a GPU can read is [`Device::Cuda`] with its ordinal. An op taking
//!   views dispatches on it (Cpu → `ops/<family>/cpu.rs`, Cuda → `ops/<family>/cuda.rs` with the
//!   `cuda` feature, [`Error::NoCudaBuild`] without it).
//! - [`TensorView::expect`] checks a view against one argument of an op's signature
//!   ([`crate::shape::Arg`]: `q [T, 64, 512]` float, T bound across arguments by
//!   [`crate::shape::Dims`]); [`one_device`] finds the one device of a call's tensors.

use crate::error::{Error, Result};
use crate::shape::{Arg, Dims};
use half::{bf16, f16};
use std::marker::PhantomData;

/// The element types csa2 reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// float32.
    F32,
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
    /// uint8 (packed records, raw bytes).
    U8,
    /// int32 (indices, −1 padded).
    I32,
    /// int64 (positions as torch produces them).
    I64,
}

impl DType {
    /// Every dtype, in the order messages list them.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::Bf16,
        DType::F16,
        DType::U8,
        DType::I32,
        DType::I64,
    ];
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }
    /// Name used in messages (NumPy/torch spelling).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }
}

/// The float element types an op argument accepts when it converts to f32 on entry.
pub const FLOATS: &[DType] = &[DType::F32, DType::Bf16, DType::F16];
/// The integer element types an index or position argument accepts.
pub const INTS: &[DType] = &[DType::I32, DType::I64];

/// A Rust element type with its [`DType`].
pub trait Element: Copy + 'static {
    /// The dtype of this type.
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

/// Where a tensor's memory lives, as far as csa2 is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host-readable memory: system memory, CUDA pinned host memory, CUDA managed memory.
    Cpu,
    /// Memory on CUDA device `ordinal` (not host-readable).
    Cuda(i32),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("host"),
            Device::Cuda(n) => write!(f, "CUDA device {n}"),
        }
    }
}

/// The error of a CUDA tensor reaching an op in a build without the `cuda` feature.
pub fn no_cuda_build(what: &str, d: Device) -> Error {
    Error::NoCudaBuild(format!(
        "`{what}` is on {d}; rebuild csa2 with `--features cuda` to run this op on the GPU, or pass \
         host memory"
    ))
}

/// The one device of a call's tensors (`(argument name, device)`, the first one sets it).
///
/// Errors: [`Error::Invalid`] naming the first tensor on another device and both devices; an empty
/// list is [`Device::Cpu`].
pub fn one_device(args: &[(&str, Device)]) -> Result<Device> {
    let Some(&(first, place)) = args.first() else {
        return Ok(Device::Cpu);
    };
    match args.iter().find(|(_, d)| *d != place) {
        None => Ok(place),
        Some((what, d)) => Err(Error::invalid(
            *what,
            format!(
                "is on {d} but `{first}` is on {place}; all tensors of one call share a device"
            ),
        )),
    }
}

/// An optional output of a call: when given, checked against its signature `arg` and its device
/// added to `devices` for [`one_device`].
///
/// Errors: as [`Arg::check`] (dtype, rank, a size that disagrees with `dims`).
pub fn expect_optional(
    t: Option<&TensorViewMut<'_>>,
    arg: &Arg,
    dims: &mut Dims,
    devices: &mut Vec<(&'static str, Device)>,
) -> Result<()> {
    if let Some(t) = t {
        t.expect(arg, dims)?;
        devices.push((arg.name, t.device()));
    }
    Ok(())
}

/// Row-major element strides of `shape`.
pub fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].saturating_mul(shape[i + 1]);
    }
    s
}

/// The parts shared by [`TensorView`] and [`TensorViewMut`].
#[derive(Debug, Clone)]
struct Parts {
    ptr: *mut u8,
    shape: Vec<usize>,
    strides: Vec<usize>,
    dtype: DType,
    device: Device,
    numel: usize,
    /// Bytes from `ptr` to one past the last element (0 for an empty view).
    span: usize,
}

impl Parts {
    /// Checks shape/stride arithmetic: element count and byte span fit `isize`.
    fn new(
        ptr: *mut u8,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Parts> {
        if shape.len() != strides.len() {
            return Err(Error::shape(
                "tensor strides",
                format!("{} strides (one per dim)", shape.len()),
                strides.len(),
            ));
        }
        let overflow = || {
            Error::shape(
                "tensor shape",
                format!("a size whose {} byte count fits isize", dtype.name()),
                format!("{shape:?} with strides {strides:?} (overflows)"),
            )
        };
        let empty = shape.contains(&0);
        let numel = if empty {
            0
        } else {
            shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(overflow)?
        };
        let span = if empty {
            0
        } else {
            // Offset of the last element, in elements, then + 1 element, in bytes.
            let last = shape
                .iter()
                .zip(strides)
                .try_fold(0usize, |a, (&d, &s)| {
                    (d - 1).checked_mul(s).and_then(|x| a.checked_add(x))
                })
                .ok_or_else(overflow)?;
            last.checked_add(1)
                .and_then(|n| n.checked_mul(dtype.size()))
                .filter(|&b| b <= isize::MAX as usize)
                .ok_or_else(overflow)?
        };
        if numel
            .checked_mul(dtype.size())
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(overflow());
        }
        Ok(Parts {
            ptr,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            dtype,
            device,
            numel,
            span,
        })
    }

    fn is_contiguous(&self) -> bool {
        let rm = row_major_strides(&self.shape);
        self.numel == 0
            || self
                .shape
                .iter()
                .zip(self.strides.iter().zip(&rm))
                .all(|(&d, (&s, &r))| d == 1 || s == r)
    }

    fn dense<T: Element>(&self, what: &str) -> Result<()> {
        if self.dtype != T::DTYPE {
            return Err(Error::shape(
                format!("{what}.dtype"),
                T::DTYPE.name(),
                self.dtype.name(),
            ));
        }
        if self.device != Device::Cpu {
            return Err(Error::Unsupported(format!(
                "`{what}` is on {}, but this call reads it from the host",
                self.device
            )));
        }
        if !self.is_contiguous() {
            return Err(Error::shape(
                format!("{what}.strides"),
                format!("compact row-major strides for shape {:?}", self.shape),
                format!("{:?}", self.strides),
            ));
        }
        Ok(())
    }
}

/// A borrowed, read-only tensor (see the module docs).
#[derive(Debug, Clone)]
pub struct TensorView<'a> {
    p: Parts,
    _borrow: PhantomData<&'a [u8]>,
}

/// A borrowed, writable tensor (see the module docs).
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    p: Parts,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: a view is a borrow of memory like `&[T]` / `&mut [T]`; the raw pointer is only
// dereferenced through the accessors, under the lifetime the constructor's contract gives.
unsafe impl Send for TensorView<'_> {}
// SAFETY: as above; shared views only read.
unsafe impl Sync for TensorView<'_> {}
// SAFETY: as above; a mutable view is exclusive like `&mut [T]`.
unsafe impl Send for TensorViewMut<'_> {}

macro_rules! view_common {
    () => {
        /// Shape, outermost first.
        pub fn shape(&self) -> &[usize] {
            &self.p.shape
        }
        /// Strides in elements, one per dim.
        pub fn strides(&self) -> &[usize] {
            &self.p.strides
        }
        /// Element type.
        pub fn dtype(&self) -> DType {
            self.p.dtype
        }
        /// Where the memory lives.
        pub fn device(&self) -> Device {
            self.p.device
        }
        /// Number of elements.
        pub fn numel(&self) -> usize {
            self.p.numel
        }
        /// Number of dims.
        pub fn ndim(&self) -> usize {
            self.p.shape.len()
        }
        /// Whether the strides are the row-major ones (size-1 dims may carry any stride).
        pub fn is_contiguous(&self) -> bool {
            self.p.is_contiguous()
        }
        /// The address of element 0 (dangling for an empty view). For a CUDA view, the device
        /// address a kernel takes.
        pub fn addr(&self) -> usize {
            self.p.ptr as usize
        }
        /// Byte range `[start, end)` the elements span (empty for an empty view); for aliasing
        /// checks between the arguments of one call.
        pub fn byte_range(&self) -> std::ops::Range<usize> {
            let s = self.p.ptr as usize;
            s..s + self.p.span
        }
        /// Checks dtype and shape against one argument of an op's signature, binding free names
        /// in `dims`.
        ///
        /// Errors: [`Error::Shape`] naming the argument, the expected and the found dtype or shape.
        pub fn expect(&self, arg: &Arg, dims: &mut Dims) -> Result<()> {
            arg.check(self.p.dtype, &self.p.shape, dims)
        }
    };
}

impl<'a> TensorView<'a> {
    /// A dense row-major view of a host slice with shape `shape`.
    ///
    /// Errors: [`Error::Shape`] when the shape's element count is not `data.len()`.
    pub fn from_host_slice<T: Element>(data: &'a [T], shape: &[usize]) -> Result<TensorView<'a>> {
        let p = Parts::new(
            data.as_ptr() as *mut u8,
            shape,
            &row_major_strides(shape),
            T::DTYPE,
            Device::Cpu,
        )?;
        if p.numel != data.len() {
            return Err(Error::shape(
                "host tensor",
                format!("{} elements for shape {shape:?}", p.numel),
                data.len(),
            ));
        }
        Ok(TensorView {
            p,
            _borrow: PhantomData,
        })
    }

    /// A view from raw parts: `ptr` is the address of element 0, `strides` in elements.
    ///
    /// Errors: [`Error::Shape`] when `strides` does not have one entry per dim or the span
    /// overflows.
    ///
    /// # Safety
    /// For `'a`, the `span` bytes from `ptr` (see [`TensorView::byte_range`]) must be valid for
    /// reads on `device`, aligned to the element size, and not written by anyone else.
    pub unsafe fn from_raw_parts(
        ptr: *const u8,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<TensorView<'a>> {
        Ok(TensorView {
            p: Parts::new(ptr as *mut u8, shape, strides, dtype, device)?,
            _borrow: PhantomData,
        })
    }

    view_common!();

    /// The elements as a host slice (dense row-major, host memory, dtype `T` only).
    ///
    /// Errors: [`Error::Shape`] for another dtype or a strided view, [`Error::Unsupported`] for
    /// device memory; `what` names the argument.
    pub fn as_slice<T: Element>(&self, what: &str) -> Result<&'a [T]> {
        self.p.dense::<T>(what)?;
        if self.p.numel == 0 {
            return Ok(&[]);
        }
        // SAFETY: host memory, dtype T, dense: the constructor's contract makes `numel` elements
        // of T readable from `ptr` for 'a.
        Ok(unsafe { std::slice::from_raw_parts(self.p.ptr as *const T, self.p.numel) })
    }
}

impl<'a> TensorView<'a> {
    /// A float tensor's elements as f32 (dense host memory): borrowed for float32, converted in one
    /// pass for bfloat16/float16.
    ///
    /// Errors: [`Error::Shape`] for another dtype or a strided view, [`Error::Unsupported`] for
    /// device memory; `what` names the argument.
    pub fn to_f32(&self, what: &str) -> Result<std::borrow::Cow<'a, [f32]>> {
        use std::borrow::Cow;
        Ok(match self.p.dtype {
            DType::F32 => Cow::Borrowed(self.as_slice::<f32>(what)?),
            DType::Bf16 => Cow::Owned(
                self.as_slice::<bf16>(what)?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
            ),
            DType::F16 => Cow::Owned(
                self.as_slice::<f16>(what)?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
            ),
            other => {
                return Err(Error::shape(
                    format!("{what}.dtype"),
                    "float32, bfloat16 or float16",
                    other.name(),
                ))
            }
        })
    }

    /// An index tensor's elements as i64 (dense host memory, int32 or int64; always copied).
    ///
    /// Errors: as [`TensorView::to_f32`].
    pub fn to_i64(&self, what: &str) -> Result<Vec<i64>> {
        Ok(match self.p.dtype {
            DType::I32 => self
                .as_slice::<i32>(what)?
                .iter()
                .map(|&v| v as i64)
                .collect(),
            DType::I64 => self.as_slice::<i64>(what)?.to_vec(),
            other => {
                return Err(Error::shape(
                    format!("{what}.dtype"),
                    "int32 or int64",
                    other.name(),
                ))
            }
        })
    }
}

impl<'a> TensorViewMut<'a> {
    /// A dense row-major view of a mutable host slice with shape `shape`.
    ///
    /// Errors: [`Error::Shape`] when the shape's element count is not `data.len()`.
    pub fn from_host_slice<T: Element>(
        data: &'a mut [T],
        shape: &[usize],
    ) -> Result<TensorViewMut<'a>> {
        let n = data.len();
        let p = Parts::new(
            data.as_mut_ptr() as *mut u8,
            shape,
            &row_major_strides(shape),
            T::DTYPE,
            Device::Cpu,
        )?;
        if p.numel != n {
            return Err(Error::shape(
                "host tensor",
                format!("{} elements for shape {shape:?}", p.numel),
                n,
            ));
        }
        Ok(TensorViewMut {
            p,
            _borrow: PhantomData,
        })
    }

    /// A writable view from raw parts (see [`TensorView::from_raw_parts`]).
    ///
    /// # Safety
    /// As [`TensorView::from_raw_parts`], and the span must be valid for writes and not accessed by
    /// anyone else for `'a`.
    pub unsafe fn from_raw_parts(
        ptr: *mut u8,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<TensorViewMut<'a>> {
        Ok(TensorViewMut {
            p: Parts::new(ptr, shape, strides, dtype, device)?,
            _borrow: PhantomData,
        })
    }

    view_common!();

    /// A read-only view of the same memory for as long as this borrow lasts.
    pub fn as_view(&self) -> TensorView<'_> {
        TensorView {
            p: self.p.clone(),
            _borrow: PhantomData,
        }
    }

    /// Writes `src` (one f32 per element) into a float tensor (dense host memory), rounding to its
    /// dtype (round-to-nearest-even for bfloat16/float16).
    ///
    /// Errors: [`Error::Internal`] for a length other than [`TensorViewMut::numel`] (the caller
    /// checked the shape); [`Error::Shape`] for a non-float dtype or a strided view;
    /// [`Error::Unsupported`] for device memory; `what` names the argument.
    pub fn write_f32s(&mut self, what: &str, src: &[f32]) -> Result<()> {
        if src.len() != self.p.numel {
            return Err(Error::Internal(format!(
                "{what}: writing {} values into {} elements",
                src.len(),
                self.p.numel
            )));
        }
        match self.p.dtype {
            DType::F32 => self.as_mut_slice::<f32>(what)?.copy_from_slice(src),
            DType::Bf16 => self
                .as_mut_slice::<bf16>(what)?
                .iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = bf16::from_f32(v)),
            DType::F16 => self
                .as_mut_slice::<f16>(what)?
                .iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = f16::from_f32(v)),
            other => {
                return Err(Error::shape(
                    format!("{what}.dtype"),
                    "float32, bfloat16 or float16",
                    other.name(),
                ))
            }
        }
        Ok(())
    }

    /// The elements as a mutable host slice (dense row-major, host memory, dtype `T` only).
    ///
    /// Errors: as [`TensorView::as_slice`].
    pub fn as_mut_slice<T: Element>(&mut self, what: &str) -> Result<&mut [T]> {
        self.p.dense::<T>(what)?;
        if self.p.numel == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`, plus exclusivity from the constructor's contract and `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.p.ptr as *mut T, self.p.numel) })
    }
}

/// Views for tests that are never dereferenced: the refusals of a device-dispatching entry (mixed
/// devices, a build without `cuda`, a bad signature) all come before any memory access.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;

    /// A row-major `shape` view of `dt` on CUDA device 0 at the fake address `addr`.
    pub(crate) fn cuda(addr: usize, shape: &[usize], dt: DType) -> TensorView<'static> {
        // SAFETY: never dereferenced (see the module docs); the constructor itself only checks
        // the address' alignment and the span.
        unsafe {
            TensorView::from_raw_parts(
                addr as *const u8,
                shape,
                &row_major_strides(shape),
                dt,
                Device::Cuda(0),
            )
        }
        .expect("a well-formed fake CUDA view")
    }

    /// [`cuda`], writable.
    pub(crate) fn cuda_mut(addr: usize, shape: &[usize], dt: DType) -> TensorViewMut<'static> {
        // SAFETY: as `cuda`.
        unsafe {
            TensorViewMut::from_raw_parts(
                addr as *mut u8,
                shape,
                &row_major_strides(shape),
                dt,
                Device::Cuda(0),
            )
        }
        .expect("a well-formed fake CUDA view")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_slice_view_is_dense_and_typed() {
        let v = vec![1f32, 2., 3., 4., 5., 6.];
        let t = TensorView::from_host_slice(&v, &[2, 3]).unwrap();
        assert_eq!(t.strides(), &[3, 1]);
        assert!(t.is_contiguous());
        assert_eq!(t.byte_range().len(), 24);
        assert_eq!(t.as_slice::<f32>("x").unwrap(), &v[..]);
        let e = t.as_slice::<i32>("x").unwrap_err().to_string();
        assert!(e.contains("x.dtype") && e.contains("int32"), "{e}");
        assert!(TensorView::from_host_slice(&v, &[4, 2]).is_err());
        let empty: [u8; 0] = [];
        let t = TensorView::from_host_slice(&empty, &[0, 68]).unwrap();
        assert_eq!(t.numel(), 0);
        assert!(t.byte_range().is_empty());
    }

    #[test]
    fn strided_views_span_their_last_element() {
        // A per-block slab of 3 layers × 4 slots × 8 bytes, viewed as layer 1: [blocks, 4, 8] with
        // block stride 96 — what a vLLM pool looks like from one layer.
        let slab = vec![0u8; 5 * 96];
        // SAFETY: the span (4·96 + 3·8 + 7 + 1 + 32 offset) stays inside `slab`.
        let t = unsafe {
            TensorView::from_raw_parts(
                slab.as_ptr().add(32),
                &[5, 4, 8],
                &[96, 8, 1],
                DType::U8,
                Device::Cpu,
            )
        }
        .unwrap();
        assert!(!t.is_contiguous());
        assert_eq!(t.byte_range().len(), 4 * 96 + 3 * 8 + 8);
        assert!(t.as_slice::<u8>("pool").is_err(), "strided: no dense slice");
        // Size-1 dims may carry any stride and still be contiguous.
        // SAFETY: 8 bytes inside `slab`.
        let t = unsafe {
            TensorView::from_raw_parts(slab.as_ptr(), &[1, 8], &[12345, 1], DType::U8, Device::Cpu)
        }
        .unwrap();
        assert!(t.is_contiguous());
        assert_eq!(t.as_slice::<u8>("row").unwrap().len(), 8);
    }

    #[test]
    fn overflowing_spans_are_shape_errors() {
        // SAFETY: the constructor fails before anything is read.
        let r = unsafe {
            TensorView::from_raw_parts(
                8 as *const u8,
                &[2, 3],
                &[usize::MAX / 2, 1],
                DType::F32,
                Device::Cpu,
            )
        };
        assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    }

    #[test]
    fn device_views_refuse_host_access_and_signatures_bind_names() {
        // SAFETY: never dereferenced (device memory is only handed to kernels).
        let t = unsafe {
            TensorView::from_raw_parts(
                0x1000 as *const u8,
                &[3, 64, 512],
                &[64 * 512, 512, 1],
                DType::F32,
                Device::Cuda(1),
            )
        }
        .unwrap();
        let e = t.as_slice::<f32>("q").unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
        assert!(e.to_string().contains("CUDA device 1"), "{e}");
        let mut dims = Dims::default();
        let q = &crate::ops::attention::signature::Q;
        t.expect(q, &mut dims).unwrap();
        assert_eq!(dims.get("T"), Some(3));
        let pos = [0i64; 4];
        let p = TensorView::from_host_slice(&pos, &[4]).unwrap();
        let e = p
            .expect(&crate::ops::attention::signature::POSITIONS, &mut dims)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("positions") && e.contains("T=3") && e.contains("[4]"),
            "{e}"
        );
        let e = one_device(&[("q", Device::Cpu), ("pos", Device::Cuda(0))]).unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("pos") && e.contains("CUDA device 0") && e.contains("`q` is on host"),
            "{e}"
        );
        assert_eq!(
            one_device(&[("a", Device::Cuda(1)), ("b", Device::Cuda(1))]).unwrap(),
            Device::Cuda(1)
        );
        assert_eq!(one_device(&[]).unwrap(), Device::Cpu);
    }

    #[test]
    fn mutable_views_write_through() {
        let mut v = vec![0i32; 4];
        let mut t = TensorViewMut::from_host_slice(&mut v, &[2, 2]).unwrap();
        t.as_mut_slice::<i32>("out").unwrap()[3] = 7;
        assert_eq!(t.as_view().as_slice::<i32>("out").unwrap()[3], 7);
        drop(t);
        assert_eq!(v, vec![0, 0, 0, 7]);
    }
}
