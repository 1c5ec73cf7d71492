//! Helpers the C-ABI test files share (no tests of its own): the thread's last error message as a
//! C caller reads it, and a handle to the embedded geometry.
use csa2::ffi::{csa2_geometry_embedded, csa2_last_error_message, Csa2Geometry, Csa2Status};

/// This thread's last error message (empty when none): size first, then the copy.
pub fn last_error() -> String {
    let n = unsafe { csa2_last_error_message(std::ptr::null_mut(), 0) };
    let mut buf = vec![0 as std::ffi::c_char; n.max(1)];
    unsafe { csa2_last_error_message(buf.as_mut_ptr(), buf.len()) };
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// A fresh handle to the embedded geometry (the caller frees it with `csa2_geometry_free`).
pub fn geometry() -> *mut Csa2Geometry {
    let mut g = std::ptr::null_mut();
    assert_eq!(
        unsafe { csa2_geometry_embedded(&mut g) },
        Csa2Status::Csa2Ok
    );
    g
}

/// An owned host tensor and the DLPack descriptor a C caller would build over it: `dl()` borrows
/// the data, shape and strides, so the descriptor is valid while `self` is neither moved nor
/// resized. Fields are public so a test can corrupt one on purpose.
pub struct HostTensor<T> {
    pub data: Vec<T>,
    pub shape: Vec<i64>,
    pub strides: Option<Vec<i64>>,
    pub dtype: csa2::ffi::dlpack::DLDataType,
    pub device: csa2::ffi::dlpack::DLDevice,
    pub byte_offset: u64,
}

impl<T> HostTensor<T> {
    /// `data` as a compact row-major `shape` tensor of `dtype` on the host.
    pub fn new(data: Vec<T>, shape: &[i64], dtype: csa2::tensor::DType) -> Self {
        let (code, bits) = dtype.code_bits();
        HostTensor {
            data,
            shape: shape.to_vec(),
            strides: None,
            dtype: csa2::ffi::dlpack::DLDataType {
                code,
                bits,
                lanes: 1,
            },
            device: csa2::ffi::dlpack::DLDevice {
                device_type: csa2::ffi::dlpack::K_DL_CPU,
                device_id: 0,
            },
            byte_offset: 0,
        }
    }

    /// The descriptor over the current fields.
    pub fn dl(&mut self) -> csa2::ffi::dlpack::DLTensor {
        csa2::ffi::dlpack::DLTensor {
            data: self.data.as_mut_ptr().cast(),
            device: self.device,
            ndim: self.shape.len() as i32,
            dtype: self.dtype,
            shape: self.shape.as_mut_ptr(),
            strides: self
                .strides
                .as_mut()
                .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
            byte_offset: self.byte_offset,
        }
    }
}
