//! Helpers the unit tests of the `ffi` modules share: reading the thread's last error message,
//! registering the embedded geometry, and describing host buffers as `DLTensor`s. Test-only.
use super::dlpack::{DLDataType, DLDevice, DLTensor, K_DL_CPU};
use super::{csa2_geometry_embedded, csa2_last_error_message, Csa2Geometry, Csa2Status};
use std::ffi::c_void;

/// This thread's last error message (empty when none), read the way a C caller does: size first,
/// then the copy.
pub(crate) fn last_error() -> String {
    let n = unsafe { csa2_last_error_message(std::ptr::null_mut(), 0) };
    let mut buf = vec![0 as std::ffi::c_char; n.max(1)];
    unsafe { csa2_last_error_message(buf.as_mut_ptr(), buf.len()) };
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// A fresh handle to the embedded geometry (the caller frees it with `csa2_geometry_free`).
pub(crate) fn geometry() -> *mut Csa2Geometry {
    let mut g = std::ptr::null_mut();
    assert_eq!(
        unsafe { csa2_geometry_embedded(&mut g) },
        Csa2Status::Csa2Ok
    );
    g
}

/// A host (`kDLCPU`, device 0) descriptor of `data` with DLPack type `(code, bits)`, one lane,
/// `shape`, and `strides` in elements (`None`: row-major). The slices must outlive every use.
pub(crate) fn host_tensor(
    data: *mut c_void,
    code: u8,
    bits: u8,
    shape: &mut [i64],
    strides: Option<&mut [i64]>,
) -> DLTensor {
    DLTensor {
        data,
        device: DLDevice {
            device_type: K_DL_CPU,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: DLDataType {
            code,
            bits,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: strides.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
        byte_offset: 0,
    }
}

/// A host descriptor of `dtype` over `data` with `shape`, compact strides (both kept alive by the
/// caller).
pub(crate) fn desc<T>(data: &mut [T], shape: &mut [i64], dtype: super::dlpack::DType) -> DLTensor {
    let (code, bits) = dtype.code_bits();
    host_tensor(data.as_mut_ptr().cast(), code, bits, shape, None)
}
