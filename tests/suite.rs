//! The integration tests, linked as ONE test binary (`cargo test --test suite`).
//!
//! Each file beside this one is a module of this binary rather than a binary of its own: every
//! integration binary links the whole crate (with debug info, ~50–90 MB each), so eighteen of them
//! spent most of the test command's build time in the linker. Run one file's tests with its module
//! name as the filter, e.g. `cargo test --test suite ssd_crash::`. A new test file must be listed
//! here; `every_test_file_is_a_module_of_the_suite` fails when one is not (Cargo.toml sets
//! `autotests = false`, so an unlisted file would otherwise never run). A file that must have a
//! process to itself (it changes process-wide state, like `cache_oom.rs`'s address-space cap) is a
//! `[[test]]` target of its own in Cargo.toml instead; the guard accepts either.
//!
//! The suite is a test of the CLI crate (`cli/Cargo.toml`), the package that owns the `csa2`
//! binary several tests run (`CARGO_BIN_EXE_csa2` exists only there); files are found from
//! [`REPO_ROOT`].

/// The repository root: the CLI crate's manifest directory is `cli/`.
pub const REPO_ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

#[path = "abi_findings.rs"]
mod abi_findings;
#[path = "backend_paged.rs"]
mod backend_paged;
#[path = "backend_stack.rs"]
mod backend_stack;
#[path = "batch_invariance.rs"]
mod batch_invariance;
#[path = "c_smoke.rs"]
mod c_smoke;
#[path = "cache_concurrency.rs"]
mod cache_concurrency;
#[path = "cli.rs"]
mod cli;
#[path = "codec_props.rs"]
mod codec_props;
#[path = "config_errors.rs"]
mod config_errors;
#[path = "cuda.rs"]
mod cuda;
#[path = "dlpack_layout.rs"]
mod dlpack_layout;
#[path = "docs.rs"]
mod docs;
#[path = "ffi_adversarial.rs"]
mod ffi_adversarial;
#[path = "ffi_engine.rs"]
mod ffi_engine;
#[path = "ffi_fuzz.rs"]
mod ffi_fuzz;
#[path = "ffi_records.rs"]
mod ffi_records;
#[path = "ffi_store.rs"]
mod ffi_store;
#[path = "ffi_support.rs"]
mod ffi_support;
#[path = "header.rs"]
mod header;
#[path = "mhc.rs"]
mod mhc;
#[path = "op_cli.rs"]
mod op_cli;
#[path = "replay_error.rs"]
mod replay_error;
#[path = "run_cli.rs"]
mod run_cli;
#[path = "signatures.rs"]
mod signatures;
#[path = "ssd_crash.rs"]
mod ssd_crash;
#[path = "store_directory.rs"]
mod store_directory;
#[path = "store_findings.rs"]
mod store_findings;
#[path = "store_reliability.rs"]
mod store_reliability;
#[path = "weights.rs"]
mod weights;
#[path = "workspace.rs"]
mod workspace;

#[test]
fn every_test_file_is_a_module_of_the_suite() {
    let dir = std::path::Path::new(REPO_ROOT).join("tests");
    let suite = std::fs::read_to_string(dir.join("suite.rs")).unwrap();
    let manifest =
        std::fs::read_to_string(std::path::Path::new(REPO_ROOT).join("Cargo.toml")).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let Some(stem) = name.strip_suffix(".rs") else {
            continue;
        };
        if stem == "suite" {
            continue;
        }
        assert!(
            suite.contains(&format!("#[path = \"{name}\"]\nmod {stem};"))
                || manifest.contains(&format!("path = \"tests/{name}\"")),
            "tests/{name} is neither a module of tests/suite.rs (add `#[path = \"{name}\"] mod {stem};`) \
             nor a [[test]] target of Cargo.toml"
        );
    }
}
