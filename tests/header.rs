//! `include/csa2.h` must be exactly what cbindgen generates from `src/ffi` today.

#[test]
fn header_is_up_to_date() {
    let root = crate::REPO_ROOT;
    let config = cbindgen::Config::from_file(format!("{root}/cbindgen.toml")).unwrap();
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen could not parse the crate")
        .write(&mut fresh);
    let path = format!("{root}/include/csa2.h");
    if std::env::var_os("CSA2_BLESS").is_some() {
        std::fs::create_dir_all(format!("{root}/include")).unwrap();
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/csa2.h is stale or missing (the C ABI in src/ffi changed). Regenerate it with\n    \
         CSA2_BLESS=1 cargo test --test suite header::\nand commit the result."
    );
}

/// Every type the header declares is csa2's own (`Csa2…`): a C or C++ file includes it beside
/// `<cuda.h>` and `dlpack.h`, so a driver or DLPack name declared here again would not compile
/// there (the emulated device's `CUgraphInstantiate_flags` once leaked into it).
#[test]
fn header_declares_only_csa2_names() {
    let text = std::fs::read_to_string(format!("{}/include/csa2.h", crate::REPO_ROOT)).unwrap();
    let foreign: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            let l = l.trim_end();
            if let Some(rest) = l.strip_prefix("} ") {
                return rest.strip_suffix(';');
            }
            let rest = l.strip_prefix("typedef ")?.strip_suffix(';')?;
            rest.rsplit(' ').next()
        })
        .filter(|name| !name.starts_with("Csa2"))
        .collect();
    assert!(foreign.is_empty(), "types that are not csa2's: {foreign:?}");
}
