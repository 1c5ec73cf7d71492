//! The `repr(C)` DLPack mirror (src/ffi/dlpack.rs) against the real `dlpack.h` (include/dlpack/, vendored unmodified): a C program
//! compiled by the system compiler prints every size, alignment, offset and enum value, and each
//! must equal what rustc lays out.

use csa2::ffi::dlpack::*;
use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

fn c_layout() -> BTreeMap<String, u64> {
    let root = PathBuf::from(crate::REPO_ROOT);
    let dir = root.join("tests/c");
    let out = tempfile::tempdir().expect("tempdir");
    let exe = out.path().join("dlpack_layout");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let st = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(root.join("include/dlpack"))
        .arg(dir.join("dlpack_layout.c"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(st.success(), "compiling tests/c/dlpack_layout.c failed");
    let run = Command::new(&exe).output().expect("run dlpack_layout");
    assert!(run.status.success());
    String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("`name value` line");
            (k.to_string(), v.parse().expect("number"))
        })
        .collect()
}

#[test]
fn mirror_matches_the_header() {
    let c = c_layout();
    let mut rust: Vec<(&str, u64)> = vec![
        ("version.major", DLPACK_MAJOR_VERSION as u64),
        ("const.kDLCPU", K_DL_CPU as u64),
        ("const.kDLCUDA", K_DL_CUDA as u64),
        ("const.kDLCUDAHost", K_DL_CUDA_HOST as u64),
        ("const.kDLROCM", K_DL_ROCM as u64),
        ("const.kDLCUDAManaged", K_DL_CUDA_MANAGED as u64),
        ("const.kDLInt", K_DL_INT as u64),
        ("const.kDLUInt", K_DL_UINT as u64),
        ("const.kDLFloat", K_DL_FLOAT as u64),
        ("const.kDLBfloat", K_DL_BFLOAT as u64),
        ("const.kDLBool", K_DL_BOOL as u64),
        (
            "const.DLPACK_FLAG_BITMASK_READ_ONLY",
            DLPACK_FLAG_BITMASK_READ_ONLY,
        ),
        // The C enum is stored in an `int`-sized field; we mirror it as i32.
        ("sizeof.DLDeviceType", size_of::<i32>() as u64),
    ];
    macro_rules! layout {
        ($t:ident { $($f:ident),* }) => {
            rust.push((concat!("sizeof.", stringify!($t)), size_of::<$t>() as u64));
            rust.push((concat!("alignof.", stringify!($t)), align_of::<$t>() as u64));
            $(rust.push((
                concat!("offsetof.", stringify!($t), ".", stringify!($f)),
                offset_of!($t, $f) as u64,
            ));)*
        };
    }
    layout!(DLDevice {
        device_type,
        device_id
    });
    layout!(DLDataType { code, bits, lanes });
    layout!(DLTensor {
        data,
        device,
        ndim,
        dtype,
        shape,
        strides,
        byte_offset
    });
    layout!(DLManagedTensor {
        dl_tensor,
        manager_ctx,
        deleter
    });
    layout!(DLPackVersion { major, minor });
    layout!(DLManagedTensorVersioned {
        version,
        manager_ctx,
        deleter,
        flags,
        dl_tensor
    });

    assert_eq!(
        rust.len(),
        c.len(),
        "C program and Rust list different items"
    );
    for (k, v) in rust {
        assert_eq!(
            c.get(k),
            Some(&v),
            "{k}: header says {:?}, Rust says {v}",
            c.get(k)
        );
    }
}
