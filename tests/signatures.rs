//! Each op's tensor signature is declared once: shapes (`Dim` values) are written only in
//! `src/shape.rs` and the signature declarations, and every face binds its tensors through them.

use crate::REPO_ROOT;
use csa2::shape::Signature;
use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Where a shape may be written: the shape module and the signature declarations.
fn may_declare_shapes(rel: &str) -> bool {
    let family_mod =
        rel.starts_with("src/ops/") && rel.ends_with("/mod.rs") && rel.matches('/').count() == 3;
    rel == "src/shape.rs"
        || family_mod
        || rel == "src/cache/signature.rs"
        || rel == "src/backend/signature.rs"
        || rel == "src/formats/page.rs"
}

#[test]
fn shapes_are_written_only_in_signature_declarations() {
    let root = Path::new(REPO_ROOT);
    let mut files = vec![];
    for d in [
        "src",
        "cli/src",
        "harness/src",
        "rng/src",
        "tests",
        "benches",
    ] {
        if root.join(d).is_dir() {
            rust_files(&root.join(d), &mut files);
        }
    }
    assert!(
        files.len() > 50,
        "the scan found the tree: {} files",
        files.len()
    );
    let needle = ["Dim", "::"].concat(); // split so this file does not match itself
    let offenders: Vec<String> = files
        .iter()
        .filter_map(|p| {
            let rel = p
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let text = std::fs::read_to_string(p).unwrap();
            (text.contains(&needle) && !may_declare_shapes(&rel)).then_some(rel)
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "shapes written outside a signature declaration (use the op's `signature` module): {offenders:?}"
    );
    for fam in [
        "rope",
        "compressor",
        "indexer",
        "topk",
        "candidates",
        "mhc",
        "attention",
    ] {
        let text = std::fs::read_to_string(root.join(format!("src/ops/{fam}/mod.rs"))).unwrap();
        assert!(
            text.contains("pub mod signature"),
            "ops/{fam}/mod.rs declares no signature"
        );
    }
}

/// Within one op, a name is one argument: two entries may share it only as two forms of that
/// argument (same access; different dtypes or a different shape).
#[test]
fn an_argument_name_is_one_argument_per_op() {
    use csa2::ops::*;
    let all: [Signature; 11] = [
        rope::signature::ROPE,
        compressor::signature::COMPRESS,
        indexer::signature::LOGITS,
        indexer::signature::LOGITS_IN_BLOCKS,
        topk::signature::TOPK,
        candidates::signature::CANDIDATES,
        candidates::signature::CANDIDATES_ON_STREAM,
        mhc::signature::MHC,
        attention::signature::ATTENTION,
        attention::signature::ATTENTION_INDEXED,
        csa2::backend::signature::STEP,
    ];
    for s in all
        .iter()
        .chain([&attention::signature::pools::ATTENTION_POOLS])
    {
        for (i, a) in s.args.iter().enumerate() {
            for b in &s.args[i + 1..] {
                if a.name == b.name {
                    assert!(
                        a.access == b.access
                            && (a.dims != b.dims || a.dtypes.iter().all(|d| !b.dtypes.contains(d))),
                        "{}: `{}` is declared twice as the same form",
                        s.op,
                        a.name
                    );
                }
            }
        }
    }
}
