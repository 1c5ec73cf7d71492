//! Compiles `tests/c/smoke.c` with `cc` against `include/csa2.h` and the cdylib that `cargo test`
//! built next to this test's profile directory, then runs it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn cdylib_dir() -> PathBuf {
    // The test binary lives in target/<profile>/deps. `cargo test` writes the cdylib there and only
    // `cargo build` copies it up to target/<profile>, so the copy up there may be stale: take the
    // newer of the two.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let profile = deps.parent().unwrap();
    let found = [deps, profile]
        .into_iter()
        .filter_map(|d| {
            let m = std::fs::metadata(d.join("libcsa2.so")).ok()?;
            Some((m.modified().ok()?, d.to_path_buf()))
        })
        .max();
    match found {
        Some((_, dir)) => dir,
        None => panic!(
            "libcsa2.so not found in {} or {}: build the library first (`cargo build --lib` or \
             `cargo test --all-targets`)",
            deps.display(),
            profile.display()
        ),
    }
}

#[test]
#[cfg(target_os = "linux")]
fn c_smoke_test_passes() {
    let root = Path::new(crate::REPO_ROOT);
    let lib = cdylib_dir();
    let out = tempfile::tempdir().unwrap();
    let exe = out.path().join("smoke");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("tests/c/smoke.c"))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lcsa2", "-lm", "-o"])
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{cc}`: {e}"));
    assert!(
        build.status.success(),
        "compiling smoke.c failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    // cargo puts target/<profile> on LD_LIBRARY_PATH, which outranks the rpath; point it at the
    // library we linked against.
    let run = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "smoke test failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("C smoke test passed"), "{stdout}");
}
