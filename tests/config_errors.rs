//! Malformed configs through the built `csa2` binary: each must exit non-zero with exactly one
//! line on stderr that names the offending field, and never panic.

use serde_json::{json, Value};
use std::process::Command;

fn base() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../assets/deepseek_v41_flash_config.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn text(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    v["text_config"].as_object_mut().unwrap()
}

fn run_geometry(config: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    std::fs::write(&p, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_csa2"))
        .args(["geometry", "--config"])
        .arg(&p)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_released_config_passes() {
    let (ok, err) = run_geometry(&base().to_string());
    assert!(ok, "{err}");
}

#[test]
fn malformed_configs_fail_with_one_line_naming_the_field() {
    type Edit = fn(&mut Value);
    let cases: Vec<(&str, &str, Edit)> = vec![
        ("missing field", "text_config.num_hidden_layers", |v| {
            text(v).remove("num_hidden_layers");
        }),
        ("wrong type", "text_config.hidden_size", |v| {
            text(v)["hidden_size"] = json!("5120");
        }),
        ("list too short", "text_config.compress_ratios", |v| {
            text(v)["compress_ratios"] = json!([0, 0, 2]);
        }),
        ("id out of range", "text_config.kv_source_layer_ids", |v| {
            text(v)["kv_source_layer_ids"] = json!([2, 8, 14, 99]);
        }),
        (
            "compressed layer with no KV source below it",
            "text_config.kv_source_layer_ids",
            |v| {
                text(v)["kv_source_layer_ids"] = json!([8, 14, 20]);
            },
        ),
        (
            "source with a different ratio",
            "text_config.kv_source_layer_ids",
            |v| {
                text(v)["compress_ratios"][21] = json!(2);
            },
        ),
        (
            "candidate source not Full",
            "text_config.candidate_source_layer_id",
            |v| {
                text(v)["candidate_source_layer_id"] = json!(24);
            },
        ),
        ("text_config not an object", "text_config", |v| {
            v["text_config"] = json!([1, 2]);
        }),
        (
            "non-increasing ids",
            "text_config.index_source_layer_ids",
            |v| {
                text(v)["index_source_layer_ids"] = json!([2, 8, 8, 14, 20, 24, 28, 32, 36]);
            },
        ),
        ("negative count", "text_config.num_attention_heads", |v| {
            text(v)["num_attention_heads"] = json!(-64);
        }),
        (
            "list entry of the wrong type",
            "text_config.compress_ratios",
            |v| {
                text(v)["compress_ratios"][5] = json!("two");
            },
        ),
        ("zero layers", "text_config.num_hidden_layers", |v| {
            text(v)["num_hidden_layers"] = json!(0);
        }),
    ];
    for (what, field, edit) in cases {
        let mut v = base();
        edit(&mut v);
        let (ok, err) = run_geometry(&v.to_string());
        assert!(!ok, "{what}: accepted");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{what}: stderr is not one line:\n{err}"
        );
        assert!(!err.contains("panicked"), "{what}: panicked:\n{err}");
        assert!(
            err.contains(&format!("`{field}`")),
            "{what}: message does not name `{field}`: {err}"
        );
    }
}

#[test]
fn non_json_and_non_object_fail_cleanly() {
    for (what, text, needle) in [
        ("non-JSON", "{\"text_config\": {", "not valid JSON"),
        ("top-level list", "[1, 2, 3]", "top level must be an object"),
        ("empty file", "", "not valid JSON"),
    ] {
        let (ok, err) = run_geometry(text);
        assert!(!ok, "{what}: accepted");
        assert_eq!(err.trim_end().lines().count(), 1, "{what}: {err}");
        assert!(err.contains(needle), "{what}: {err}");
    }
}
