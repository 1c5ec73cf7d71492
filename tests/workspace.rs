//! The workspace's shape: the core library — the cdylib vLLM loads — links no CLI,
//! plotting, `.npy` or harness dependency; those belong to `cli/` and `harness/`.

use crate::REPO_ROOT;

/// Dependency names declared in `[section]` of the manifest at `path` (a plain line scan: names
/// are the keys before `=`, up to the next `[...]` header).
fn declared(path: &str, section: &str) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let header = format!("[{section}]");
    let mut inside = false;
    let mut names = vec![];
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == header;
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                names.push(name.trim().to_string());
            }
        }
    }
    names
}

#[test]
fn the_core_library_links_no_cli_or_harness_dependency() {
    let core = declared(&format!("{REPO_ROOT}/Cargo.toml"), "dependencies");
    assert!(
        core.iter().any(|d| d == "thiserror"),
        "the scan found the core's dependencies: {core:?}"
    );
    for banned in [
        "clap",
        "indicatif",
        "plotters",
        "npyz",
        "flate2",
        "gemm",
        "csa2-harness",
        "csa2-cli",
    ] {
        assert!(
            !core.iter().any(|d| d == banned),
            "the core library (root Cargo.toml [dependencies]) declares {banned}: it belongs to \
             cli/ or harness/ (the cdylib vLLM loads must not link it)"
        );
    }
    let cli = declared(&format!("{REPO_ROOT}/cli/Cargo.toml"), "dependencies");
    for needed in ["csa2", "csa2-harness", "clap"] {
        assert!(
            cli.iter().any(|d| d == needed),
            "cli/Cargo.toml lacks {needed}: {cli:?}"
        );
    }
}
