//! The C ABI (`include/csa2.h`).
//!
//! MERGE NOTE (shim branch): the `found` branch owns this file (status codes, thread-local last
//! error, the boundary, handles). Until it lands, this is a minimal stand-in with the *same names
//! and signatures* (`Csa2Status`, `boundary`, `csa2_last_error_message`, `csa2_version`) so that
//! `dlpack.rs` compiles and the Python shim can be tested; at merge, keep found's file and add the
//! `pub mod dlpack;` line.

pub mod dlpack;

use crate::error::{Error, Result};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Status code returned by every fallible C ABI function (numbering of the `found` branch).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2Status {
    /// Success.
    Csa2Ok = 0,
    /// A buffer or tensor has the wrong length or shape.
    Csa2ErrShape = 200,
    /// An argument is out of range.
    Csa2ErrInvalidArgument = 201,
    /// A required pointer was null.
    Csa2ErrNullPointer = 202,
    /// The build or machine lacks a needed feature.
    Csa2ErrUnsupported = 402,
    /// Any other error.
    Csa2ErrInternal = 500,
    /// A panic was caught at the boundary.
    Csa2ErrPanic = 501,
}

impl Csa2Status {
    /// The status for an error.
    pub fn of(e: &Error) -> Csa2Status {
        match e {
            Error::Shape { .. } => Csa2Status::Csa2ErrShape,
            Error::Invalid { .. } => Csa2Status::Csa2ErrInvalidArgument,
            Error::NullPointer(_) => Csa2Status::Csa2ErrNullPointer,
            Error::Unsupported(_) => Csa2Status::Csa2ErrUnsupported,
            _ => Csa2Status::Csa2ErrInternal,
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

fn set_last_error(msg: String) {
    let msg = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(msg));
}

/// Runs an export's body: clears the last error, catches panics, maps errors to a status.
pub(crate) fn boundary(name: &'static str, body: impl FnOnce() -> Result<()>) -> Csa2Status {
    LAST_ERROR.with(|e| *e.borrow_mut() = None);
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => Csa2Status::Csa2Ok,
        Ok(Err(e)) => {
            set_last_error(format!("{name}: {e}"));
            Csa2Status::of(&e)
        }
        Err(_) => {
            set_last_error(format!("{name}: panic (a csa2 bug)"));
            Csa2Status::Csa2ErrPanic
        }
    }
}

/// The library version, `"MAJOR.MINOR.PATCH"`, as a static NUL-terminated string (never free it).
#[no_mangle]
pub extern "C" fn csa2_version() -> *const c_char {
    static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    VERSION.as_ptr().cast()
}

/// Copies the calling thread's last error message into `buf` (capacity `len`), NUL-terminated when
/// `len > 0`; returns the size needed including the NUL (0 when there is no error).
#[no_mangle]
pub extern "C" fn csa2_last_error_message(buf: *mut c_char, len: usize) -> usize {
    catch_unwind(|| {
        LAST_ERROR.with(|e| {
            let e = e.borrow();
            let Some(msg) = e.as_ref() else { return 0 };
            let bytes = msg.as_bytes();
            if !buf.is_null() && len > 0 {
                let mut n = bytes.len().min(len - 1);
                while n > 0 && n < bytes.len() && (bytes[n] & 0xC0) == 0x80 {
                    n -= 1;
                }
                // SAFETY: `buf` has room for `len` ≥ n + 1 bytes (caller's contract); our CString
                // cannot overlap a caller buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                    *buf.add(n) = 0;
                }
            }
            bytes.len() + 1
        })
    })
    .unwrap_or(0)
}
