//! libFuzzer target over the whole C ABI boundary: the input bytes drive the shared harness
//! (`tests/fuzz_harness/mod.rs`), which builds a valid call of one export, mutates it, calls it and
//! checks the invariants (no panic, refusals of invalid input, last-error discipline).
#![no_main]

#[path = "../../tests/fuzz_harness/mod.rs"]
mod fuzz_harness;

use libfuzzer_sys::fuzz_target;

thread_local! {
    // One geometry and cache for the whole run, as in `cargo test --test suite ffi_fuzz::`.
    static CTX: fuzz_harness::Ctx = fuzz_harness::Ctx::new();
}

fuzz_target!(|data: &[u8]| {
    CTX.with(|x| {
        fuzz_harness::run_bytes(data, x);
    });
});
