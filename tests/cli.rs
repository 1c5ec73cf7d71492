//! The command-line conventions, through the real binary:
//! - every subcommand's `--help` follows one convention (`--json <PATH>` with `-` for stdout,
//!   `--plots <DIR>`, no rustdoc link syntax, `op` lists every op);
//! - every JSON-capable command run with `--json -` prints one JSON document on stdout that parses,
//!   and its human report on stderr;
//! - a closed stdout ends the process without a panic; `geometry --context 0` is refused;
//! - plain progress lines appear when stderr is not a terminal;
//! - `codec` and `op` print a one-line summary;
//! - every plot the tools write renders (resvg) with all its text inside the canvas and no two
//!   text boxes overlapping (the `kv_bytes.svg` y labels once ran off the canvas into the axis
//!   title). The PNGs are written to `target/plot-png/` for a look.
//!
//! Every run uses tiny sizes (seconds).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn csa2() -> Command {
    Command::new(env!("CARGO_BIN_EXE_csa2"))
}

fn run(args: &[&str]) -> Output {
    csa2().args(args).output().expect("csa2 runs")
}

fn ok(args: &[&str]) -> Output {
    let out = run(args);
    assert!(
        out.status.success(),
        "csa2 {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The subcommand names listed under `Commands:` of a help text.
fn commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

/// Commands that write JSON, with the smallest arguments that still do the real work.
fn json_runs(dir: &Path) -> Vec<Vec<String>> {
    let ssd = dir.join("ssd").to_string_lossy().into_owned();
    let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        v(&["geometry"]),
        v(&["paper"]),
        v(&["check"]),
        v(&["bench", "codecs", "--rows", "16", "--reps", "1"]),
        v(&["bench", "gemm", "--rows", "1", "--reps", "1"]),
        v(&[
            "bench",
            "ops",
            "--keys",
            "4096",
            "--prefill-tokens",
            "64",
            "--reps",
            "1",
            "--prefill-reps",
            "1",
        ]),
        v(&[
            "trace",
            "--limit",
            "20",
            "--ssd-gib",
            "0.0625",
            "--ssd-dir",
            &ssd,
        ]),
        v(&[
            "run",
            "--turns",
            "1",
            "--token-scale",
            "0.005",
            "--decode-max",
            "2",
        ]),
        v(&[
            "replay-error",
            "--turns",
            "2",
            "--first",
            "136",
            "--new",
            "8",
            "--continuation",
            "1",
            "--variants",
            "bounded",
        ]),
        v(&[
            "ab",
            "--scale",
            "tiny",
            "--contexts",
            "1K",
            "--accuracy-max",
            "none",
            "--prefill-max",
            "8",
            "--decode-steps",
            "1",
            "--warmup",
            "0",
        ]),
    ]
}

#[test]
fn every_subcommand_help_follows_the_convention() {
    let top = String::from_utf8(ok(&["--help"]).stdout).unwrap();
    let mut all: Vec<Vec<String>> = vec![];
    for c in commands(&top) {
        let help = String::from_utf8(ok(&[&c, "--help"]).stdout).unwrap();
        let subs = commands(&help);
        if subs.is_empty() {
            all.push(vec![c]);
        } else {
            all.extend(subs.into_iter().map(|s| vec![c.clone(), s]));
        }
    }
    let names: BTreeSet<String> = all.iter().map(|c| c.join(" ")).collect();
    let tmp = tempfile::tempdir().unwrap();
    let with_json: BTreeSet<String> = json_runs(tmp.path())
        .iter()
        .map(|a| {
            a.iter()
                .take_while(|s| !s.starts_with("--"))
                .cloned()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    // A new subcommand must be classified here: JSON-capable ones join `json_runs`.
    let without_json: BTreeSet<String> = ["codec", "make-checkpoint", "op"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let classified: BTreeSet<String> = with_json.union(&without_json).cloned().collect();
    assert_eq!(names, classified, "subcommands found vs classified");
    for c in &all {
        let mut args: Vec<&str> = c.iter().map(String::as_str).collect();
        args.push("--help");
        let help = String::from_utf8(ok(&args).stdout).unwrap();
        let name = c.join(" ");
        assert!(
            !help.contains("[`"),
            "{name}: rustdoc link syntax in help:\n{help}"
        );
        assert!(
            !help.contains("--plot ") && !help.contains("--plot <"),
            "{name}: `--plot FILE` is gone; plots go to `--plots <DIR>`:\n{help}"
        );
        if help.contains("--plots") {
            assert!(help.contains("--plots <DIR>"), "{name}:\n{help}");
        }
        if with_json.contains(&name) {
            assert!(
                help.contains("--json <PATH>"),
                "{name}: --json <PATH>:\n{help}"
            );
            assert!(
                help.contains("`-` = stdout"),
                "{name}: say that - is stdout:\n{help}"
            );
        } else {
            assert!(
                !help.contains("--json"),
                "{name} has --json: add it to json_runs"
            );
        }
    }
    let op = String::from_utf8(ok(&["op", "--help"]).stdout).unwrap();
    for name in [
        "compress",
        "indexer",
        "candidates",
        "attention",
        "rope",
        "mhc",
    ] {
        assert!(op.contains(name), "op --help lacks {name}:\n{op}");
    }
    for c in ["ab", "trace"] {
        let h = String::from_utf8(ok(&[c, "--help"]).stdout).unwrap();
        assert!(h.contains("--plots <DIR>"), "{c}:\n{h}");
    }
}

#[test]
fn json_to_stdout_parses_for_every_json_command() {
    let tmp = tempfile::tempdir().unwrap();
    for mut args in json_runs(tmp.path()) {
        args.push("--json".into());
        args.push("-".into());
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ok(&a);
        let stdout = String::from_utf8(out.stdout).unwrap();
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "csa2 {}: stdout is not one JSON document ({e}):\n{stdout}",
                a.join(" ")
            )
        });
        assert!(
            v.as_object().is_some_and(|o| !o.is_empty()),
            "{}: {v}",
            a.join(" ")
        );
        // The human report is not lost: it moved to stderr.
        assert!(
            out.stderr.len() > 40,
            "{}: no report on stderr",
            a.join(" ")
        );
        let _ = std::fs::remove_dir_all(tmp.path().join("ssd"));
    }
}

#[test]
fn json_to_a_file_keeps_the_report_on_stdout() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("g.json");
    let out = ok(&["geometry", "--json", p.to_str().unwrap()]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("global KV bytes per token"), "{stdout}");
    assert!(
        stdout.contains(&format!("wrote {}", p.display())),
        "{stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(v["global_kv_bytes_per_token"]["nvfp4"], 890.0);
}

/// Regression: `csa2 geometry --json | head` panicked in `println!` on the broken pipe.
#[test]
fn a_closed_stdout_ends_quietly() {
    for args in [
        &["geometry"][..],
        &["geometry", "--json", "-"][..],
        &["paper"][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader); // every write to stdout now fails with EPIPE
        let out = csa2()
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert!(
                out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
                "{args:?}: {:?} {err}",
                out.status
            );
        }
    }
}

#[test]
fn geometry_refuses_an_empty_context() {
    let out = run(&["geometry", "--context", "0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context") && err.contains("≥ 1"), "{err}");
}

#[test]
fn geometry_names_its_capacity_preset() {
    let out = String::from_utf8(ok(&["geometry"]).stdout).unwrap();
    assert!(out.contains("h200-tp4-engram-offload"), "{out}");
    assert!(out.contains("81.2"), "{out}");
    let custom = String::from_utf8(ok(&["geometry", "--weights-gib", "60"]).stdout).unwrap();
    assert!(custom.contains("`custom`"), "{custom}");
    let bad = run(&["geometry", "--kv-gib", "100", "--weights-gib", "81.2"]);
    assert!(!bad.status.success());
}

#[test]
fn plain_progress_lines_when_stderr_is_not_a_terminal() {
    let out = csa2()
        .args([
            "run",
            "--turns",
            "2",
            "--token-scale",
            "0.005",
            "--decode-max",
            "2",
        ])
        .env("CSA2_PROGRESS_SECS", "0.01")
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("progress: run turns"))
        .collect();
    assert!(lines.len() >= 2, "{err}");
    assert!(lines.last().unwrap().contains("2/2"), "{err}");
}

#[test]
fn codec_and_op_print_a_one_line_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = tmp.path().join("rows.f32");
    let vals: Vec<u8> = (0..2 * 512)
        .flat_map(|i| ((i as f32 * 0.37).sin()).to_le_bytes())
        .collect();
    std::fs::write(&rows, vals).unwrap();
    let rec = tmp.path().join("rows.nvfp4");
    let out = ok(&[
        "codec",
        "encode",
        "--format",
        "nvfp4",
        "--in",
        rows.to_str().unwrap(),
        "--out",
        rec.to_str().unwrap(),
    ]);
    let s = String::from_utf8(out.stdout).unwrap();
    assert_eq!(s.lines().count(), 1, "{s}");
    assert!(
        s.contains("1024 f32 values") && s.contains("576 record bytes"),
        "{s}"
    );
    // rope on a small input folder: x [T, H, D] f32 and positions.
    let inp = tmp.path().join("in");
    std::fs::create_dir_all(&inp).unwrap();
    csa2_harness::npy::write(&inp.join("x.npy"), &[2, 1, 512], &vec![0.5f32; 1024]).unwrap();
    csa2_harness::npy::write(&inp.join("positions.npy"), &[2], &[0i64, 1]).unwrap();
    let outd = tmp.path().join("out");
    let out = run(&[
        "op",
        "rope",
        "--in",
        inp.to_str().unwrap(),
        "--out",
        outd.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8(out.stdout).unwrap();
    assert_eq!(s.lines().count(), 1, "{s}");
    assert!(
        s.contains("op rope (fast path)") && s.contains(".npy"),
        "{s}"
    );
}

// ---- plots -----------------------------------------------------------------------------------

struct TextBox {
    text: String,
    x0: f32,
    y0: f32,
    x1: f32,
    y1: f32,
}

fn texts(g: &resvg::usvg::Group, out: &mut Vec<TextBox>) {
    for n in g.children() {
        match n {
            resvg::usvg::Node::Group(g) => texts(g, out),
            resvg::usvg::Node::Text(t) => {
                let b = t.abs_bounding_box();
                out.push(TextBox {
                    text: t.chunks().iter().map(|c| c.text()).collect(),
                    x0: b.left(),
                    y0: b.top(),
                    x1: b.right(),
                    y1: b.bottom(),
                });
            }
            _ => {}
        }
    }
}

/// Renders `svg` to PNG beside the test outputs and checks its text: inside the canvas, and no
/// two labels overlapping.
fn check_plot(svg: &Path, png_dir: &Path) {
    let mut opt = resvg::usvg::Options::default();
    opt.fontdb_mut().load_system_fonts();
    // The plots ask for `sans-serif`; fontdb maps it to Arial unless told otherwise. Use the
    // system's own sans face (DejaVu Sans, Liberation Sans, ...).
    let families: Vec<String> = opt
        .fontdb
        .faces()
        .flat_map(|f| f.families.iter().map(|(n, _)| n.clone()))
        .collect();
    let sans = families
        .iter()
        .find(|n| n.contains("Sans") && !n.contains("Mono"))
        .or(families.first())
        .cloned()
        .expect(
            "no system fonts: the plot test lays out text with a real font (install fonts-dejavu)",
        );
    opt.fontdb_mut().set_sans_serif_family(sans);
    let data = std::fs::read(svg).unwrap();
    let tree = resvg::usvg::Tree::from_data(&data, &opt).unwrap();
    let size = tree.size();
    // Render first, so a failing plot can be looked at.
    let mut pix =
        resvg::tiny_skia::Pixmap::new(size.width().ceil() as u32, size.height().ceil() as u32)
            .unwrap();
    pix.fill(resvg::tiny_skia::Color::WHITE);
    resvg::render(
        &tree,
        resvg::tiny_skia::Transform::default(),
        &mut pix.as_mut(),
    );
    std::fs::create_dir_all(png_dir).unwrap();
    let png = png_dir.join(svg.file_name().unwrap()).with_extension("png");
    pix.save_png(&png).unwrap();
    let mut boxes = vec![];
    texts(tree.root(), &mut boxes);
    assert!(
        boxes.len() >= 5,
        "{}: {} text nodes",
        svg.display(),
        boxes.len()
    );
    let name = svg.display();
    for b in &boxes {
        assert!(
            b.x0 >= 0.0 && b.y0 >= 0.0 && b.x1 <= size.width() && b.y1 <= size.height(),
            "{name}: `{}` at [{:.1}, {:.1}]–[{:.1}, {:.1}] leaves the {}×{} canvas",
            b.text,
            b.x0,
            b.y0,
            b.x1,
            b.y1,
            size.width(),
            size.height()
        );
    }
    for (i, a) in boxes.iter().enumerate() {
        for b in &boxes[i + 1..] {
            // 0.5 px of slack: adjacent glyph boxes may touch.
            let overlap =
                a.x0 < b.x1 - 0.5 && b.x0 < a.x1 - 0.5 && a.y0 < b.y1 - 0.5 && b.y0 < a.y1 - 0.5;
            assert!(!overlap, "{name}: `{}` overlaps `{}`", a.text, b.text);
        }
    }
}

#[test]
fn every_plot_renders_with_its_text_inside_the_canvas() {
    let tmp = tempfile::tempdir().unwrap();
    let ab = tmp.path().join("ab");
    let tr = tmp.path().join("trace");
    ok(&[
        "ab",
        "--scale",
        "tiny",
        "--contexts",
        "1K,4K,16K",
        "--accuracy-max",
        "none",
        "--prefill-max",
        "8",
        "--decode-steps",
        "1",
        "--warmup",
        "0",
        "--plots",
        ab.to_str().unwrap(),
    ]);
    ok(&[
        "trace",
        "--limit",
        "60",
        "--ssd-gib",
        "0.0625",
        "--ssd-dir",
        tmp.path().join("ssd").to_str().unwrap(),
        "--plots",
        tr.to_str().unwrap(),
    ]);
    let png_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plot-png");
    let mut n = 0;
    for dir in [&ab, &tr] {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "svg") {
                check_plot(&p, &png_dir);
                n += 1;
            }
        }
    }
    assert_eq!(n, 3, "kv_bytes.svg, decode_time.svg, footprint.svg");
}

/// Bad numbers and unwritable outputs: each is refused with one line that names the flag, before
/// any work starts (no progress line), never with a panic, a backtrace or a nonsense figure.
/// Regressions: `ab --prefill-max 0` panicked; `geometry --gpu-mem-gib 0` and `--weights-gib 500`
/// printed a negative KV capacity; `trace --limit 0` printed NaN; `run --chunk 0` ran with chunks
/// of 1; a negative number got clap's "unexpected argument"; `ab` ran two minutes before failing
/// on an unwritable `--json` path.
/// One request is "1 request" (the report said "1 requests").
#[test]
fn a_count_of_one_is_singular() {
    let out = csa2().args(["trace", "--limit", "1"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(" 1 request, "), "{text}");
    assert!(!text.contains(" 1 requests"), "{text}");
}

#[test]
fn bad_inputs_get_a_one_line_error_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    // A path under a regular file cannot be created, whoever runs the test.
    let bad_json = file.join("out.json");
    let bad_dir = file.join("plots");
    let (bj, bd) = (bad_json.to_str().unwrap(), bad_dir.to_str().unwrap());
    let tiny_ab = [
        "ab",
        "--scale",
        "tiny",
        "--contexts",
        "1K",
        "--accuracy-max",
        "none",
    ];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["ab", "--prefill-max", "0"], "--prefill-max"),
        (vec!["ab", "--decode-steps", "-3"], "--decode-steps"),
        (vec!["geometry", "--gpu-mem-gib", "0"], "--gpu-mem-gib"),
        (vec!["geometry", "--gpu-mem-gib", "-5"], "--gpu-mem-gib"),
        (
            vec!["geometry", "--weights-gib", "500"],
            "weights of 500.0 GiB leave no room for a KV cache on a 131.3 GiB accelerator",
        ),
        (
            vec!["geometry", "--weights-gib", "100", "--kv-gib", "50"],
            "weights 100.0 GiB + KV 50.0 GiB exceed the accelerator's 131.3 GiB",
        ),
        (vec!["geometry", "--context", "-1"], "--context"),
        (vec!["trace", "--limit", "0"], "--limit"),
        (vec!["trace", "--hbm-gib", "-1"], "--hbm-gib"),
        (vec!["run", "--chunk", "0"], "--chunk"),
        (vec!["run", "--chunk", "-5"], "--chunk"),
        (vec!["run", "--stride", "0"], "--stride"),
        (vec!["run", "--decode-max", "0"], "--decode-max"),
        (
            vec!["ab", "--contexts", "-4K"],
            "a length must be positive, found `-4K`",
        ),
        (
            vec!["ab", "--contexts", "4K,0"],
            "a length must be positive, found `0`",
        ),
        (
            vec!["ab", "--accuracy-max", "-4K"],
            "a positive length like 128K",
        ),
        (vec!["run", "--turns", "-2"], "--turns"),
        (vec!["bench", "ops", "--reps", "0"], "--reps"),
        (vec!["check", "--seed", "-1"], "--seed"),
        ([&tiny_ab[..], &["--json", bj]].concat(), "out.json"),
        ([&tiny_ab[..], &["--plots", bd]].concat(), "plots"),
        (vec!["trace", "--limit", "5", "--plots", bd], "plots"),
        (
            vec!["trace", "--limit", "5", "--ssd-dir", file.to_str().unwrap()],
            "is not a directory",
        ),
        (vec!["run", "--turns", "1", "--json", bj], "out.json"),
        (
            vec!["geometry", "--json", tmp.path().to_str().unwrap()],
            "directory",
        ),
    ];
    for (args, names) in cases {
        let out = csa2()
            .args(&args)
            .env("CSA2_PROGRESS_SECS", "0.01")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let what = format!("csa2 {}", args.join(" "));
        assert!(!out.status.success(), "{what}: accepted\n{err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
        assert!(!err.contains("progress:"), "{what}: started work\n{err}");
        assert!(
            err.contains(names),
            "{what}: the error does not name `{names}`:\n{err}"
        );
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| {
                !l.trim().is_empty()
                    && !l.starts_with("Usage:")
                    && !l.starts_with("For more information")
            })
            .collect();
        assert_eq!(lines.len(), 1, "{what}: one line expected:\n{err}");
        assert!(
            !err.contains("unexpected argument"),
            "{what}: a negative number must be read as a value:\n{err}"
        );
        let out_s = String::from_utf8_lossy(&out.stdout);
        assert!(out_s.trim().is_empty(), "{what}: printed a report\n{out_s}");
    }
}

/// The README's codec example, pasted as it stands (its `csa2` is this binary): every line runs,
/// with no tool beyond `csa2` (it once needed numpy), and the byte counts its comments state hold.
#[test]
fn readme_codec_example_runs_as_pasted() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let block: Vec<&str> = readme
        .split("## `csa2 codec`: the file format")
        .nth(1)
        .and_then(|s| s.split("```bash\n").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("README § csa2 codec has a bash block")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .collect();
    assert!(block.len() >= 3, "{block:?}");
    let tmp = tempfile::tempdir().unwrap();
    for line in &block {
        let cmd = line.split(" #").next().unwrap();
        let words: Vec<&str> = cmd.split_whitespace().collect();
        assert_eq!(
            words[0], "csa2",
            "every step of the example is a csa2 command: {line}"
        );
        let out = csa2()
            .args(&words[1..])
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{line}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let size = |f: &str| std::fs::metadata(tmp.path().join(f)).unwrap().len();
    assert_eq!(size("rows.f32"), 8192);
    assert_eq!(size("rows.rec"), 1152);
    assert_eq!(size("back.f32"), 8192);
}

/// Every `cargo install --path P` in the README names a package with a binary (`--path .` once
/// failed: the root package is the library; the binary is in `cli/`). CI runs the command itself
/// (`.ci/run`).
#[test]
fn readme_install_command_names_the_package_with_the_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let paths: Vec<&str> = readme
        .split("cargo install")
        .skip(1)
        .filter_map(|s| s.split("--path").nth(1))
        .filter_map(|s| s.split_whitespace().next())
        .map(|p| p.trim_end_matches(['`', ')', ',', ';']))
        .collect();
    assert!(!paths.is_empty(), "the README gives an install command");
    for p in paths {
        let manifest = std::fs::read_to_string(root.join(p).join("Cargo.toml"))
            .unwrap_or_else(|e| panic!("`cargo install --path {p}`: no Cargo.toml ({e})"));
        assert!(
            manifest.contains("[[bin]]") || root.join(p).join("src/main.rs").exists(),
            "`cargo install --path {p}`: that package has no binary"
        );
    }
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    assert!(
        ci.contains("cargo install --locked --debug --path cli"),
        "CI runs the install"
    );
}

/// Words a new user read wrong: `csa2 run` said "1 turns" and gave rates without units
/// ("prefill/s"); `csa2 bench --help` listed `codecs` and `ops` but not `gemm`.
#[test]
fn run_and_bench_say_what_they_mean() {
    let out = ok(&[
        "run",
        "--turns",
        "1",
        "--token-scale",
        "0.005",
        "--decode-max",
        "1",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("— 1 turn of"), "{text}");
    assert!(
        text.contains("prefill tok/s") && text.contains("decode tok/s"),
        "{text}"
    );
    let help = String::from_utf8_lossy(&ok(&["--help"]).stdout).into_owned();
    let bench = help
        .lines()
        .find(|l| l.trim_start().starts_with("bench "))
        .unwrap_or_else(|| panic!("{help}"));
    for family in ["codecs", "ops", "gemm"] {
        assert!(bench.contains(family), "{bench}");
    }
}
