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
