// Does nothing unless the `cuda` feature is on (nothing in the default build needs CUDA).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=kernels");
}
