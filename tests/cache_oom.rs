//! C ABI finding 6: an allocation sized by the caller that the machine cannot satisfy is
//! `CSA2_ERR_OUT_OF_MEMORY` (404) with the byte count, not an abort. The address space of this
//! test process is capped with `setrlimit(RLIMIT_AS)` so that real allocations really fail; the
//! file holds this one test so the cap cannot starve another test running beside it.

use csa2::ffi::dlpack::{DLDataType, DLDevice, DLTensor};
use csa2::ffi::*;
use std::ptr::{null, null_mut};

const OUT_OF_MEMORY: i32 = 404;

fn last_error() -> String {
    let n = unsafe { csa2_last_error_message(null_mut(), 0) };
    let mut buf = vec![0 as std::ffi::c_char; n.max(1)];
    unsafe { csa2_last_error_message(buf.as_mut_ptr(), buf.len()) };
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Virtual memory of this process now, in bytes (`/proc/self/statm`, first field, pages).
fn vm_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().next().unwrap().parse().unwrap();
    pages * 4096
}

/// Caps the address space at `bytes` and returns the previous limit.
fn cap_address_space(bytes: u64) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut old) }, 0);
    let new = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: old.rlim_max,
    };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &new) }, 0);
    old
}

#[test]
fn finding6_allocation_failure_is_out_of_memory_not_an_abort() {
    let mut g = null_mut();
    assert_eq!(
        unsafe { csa2_geometry_embedded(&mut g) },
        Csa2Status::Csa2Ok
    );
    // A small cache made before the cap, and one request of it.
    let mut small = null_mut();
    assert_eq!(
        unsafe {
            csa2_cache_create(
                &csa2::ffi::Csa2CacheCreateArgs {
                    geometry: g,
                    layout: 0,
                    num_blocks: 4096,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut small,
            )
        },
        Csa2Status::Csa2Ok
    );
    assert_eq!(
        unsafe { csa2_cache_add_request(small, 1) },
        Csa2Status::Csa2Ok
    );

    let headroom = 256u64 << 20;
    let old = cap_address_space(vm_bytes() + headroom);
    // (a) The largest pool allowed (2^24 blocks): its bookkeeping (over 1 GiB) does not fit.
    let mut c = null_mut();
    let st = unsafe {
        csa2_cache_create(
            &csa2::ffi::Csa2CacheCreateArgs {
                geometry: g,
                layout: 0,
                num_blocks: 1 << 24,
                block_tokens: 256,
                model: null(),
                model_len: 0,
                ..Default::default()
            },
            &mut c,
        )
    };
    let msg_a = last_error();
    // (b) Slabs: 4096 blocks of the small cache need far more than the headroom.
    let st_b = unsafe { csa2_cache_allocate(small, 1, 4096 * 256) };
    let msg_b = last_error();
    let mut after = Csa2CacheStats::default();
    let st_stats = unsafe { csa2_cache_stats(small, &mut after) };
    let mut n = 99usize;
    let st_table = unsafe { csa2_cache_block_table(small, 1, null_mut(), 0, &mut n) };
    unsafe { libc::setrlimit(libc::RLIMIT_AS, &old) };

    assert_eq!(st as i32, OUT_OF_MEMORY, "{msg_a}");
    assert!(c.is_null());
    assert!(msg_a.contains("bytes"), "{msg_a}");
    assert_eq!(st_b as i32, OUT_OF_MEMORY, "{msg_b}");
    assert!(msg_b.contains("slab") && msg_b.contains("bytes"), "{msg_b}");
    // Nothing changed: no block is referenced or in the table, every block is free again.
    assert_eq!(st_stats, Csa2Status::Csa2Ok);
    assert_eq!((after.used_blocks, after.free_blocks), (0, 4096));
    assert_eq!((st_table, n), (Csa2Status::Csa2Ok, 0));
    // With the cap lifted the same call succeeds: the cache is intact.
    assert_eq!(
        unsafe { csa2_cache_allocate(small, 1, 4 * 256) },
        Csa2Status::Csa2Ok,
        "{}",
        last_error()
    );
    unsafe { csa2_cache_free(small) };
    unsafe { csa2_geometry_free(g) };

    // A candidate pool far wider than the logits row: the selection's
    // scratch is sized by the row, not by the output's width, so it fits under the same cap (it
    // used to ask for 32 bytes per output column and abort the process).
    let b = 1usize << 26;
    let mut logits: Vec<f32> = (0..10).map(|i| i as f32).collect();
    let mut pos = vec![9i64];
    let mut out = vec![7i32; b];
    let (mut ls, mut ps, mut os) = ([1i64, 10], [1i64], [1i64, b as i64]);
    let dl = |data: *mut std::ffi::c_void, code: u8, bits: u8, shape: &mut [i64]| DLTensor {
        data,
        device: DLDevice {
            device_type: 1,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: DLDataType {
            code,
            bits,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: null_mut(),
        byte_offset: 0,
    };
    let (lt, pt, ot) = (
        dl(logits.as_mut_ptr().cast(), 2, 32, &mut ls),
        dl(pos.as_mut_ptr().cast(), 0, 64, &mut ps),
        dl(out.as_mut_ptr().cast(), 0, 32, &mut os),
    );
    let old = cap_address_space(vm_bytes() + (512 << 20));
    let st = unsafe { csa2_candidates(&lt, &pt, 1, 4, &ot) };
    unsafe { libc::setrlimit(libc::RLIMIT_AS, &old) };
    assert_eq!(st, Csa2Status::Csa2Ok, "{}", last_error());
    assert_eq!(&out[..4], &[2, 1, 0, -1]);
    assert!(out[3..].iter().all(|&v| v == -1));
}
