// Does nothing unless the `cuda` feature is on (nothing in the default build needs CUDA).
//
// With `cuda`: compiles the explicit kernel list below with nvcc and embeds, per kernel file,
//   - a fatbin with SASS for sm_90a and sm_100a (no JIT when the driver accepts it),
//   - PTX for sm_90a and sm_100a as nvcc wrote it (ISA of the toolkit, 9.5 for CUDA 13.5),
//   - "compat" PTX: the same PTX re-stamped with the oldest ISA that knows the target (8.0 for
//     sm_90a = CUDA 12.0 drivers, 8.6 for sm_100a = CUDA 12.8), embedded only if ptxas accepts it
//     under that ISA — what a CUDA 12.x driver can still JIT,
//   - the flattened source (headers inlined) for a last-resort NVRTC compile at run time.
// src/cuda/modules.rs tries them in that order; docs/DESIGN.md explains why.
//
// Every kernel is compiled with the model constants of src/geometry/consts.rs, the record widths
// and ids of src/formats/abi.rs and the launch shapes of src/cuda/shapes.rs as
// `-D CSA2_<NAME>=<value>` (the same lines head the NVRTC source): the crate reads the same three
// files, so a kernel's dims, record layouts and tiles have one definition.
//
// `CSA2_PTXAS_REPORT=1` prints ptxas' register / stack / spill figures of every entry point as
// build warnings (scripts/ci-cuda.sh sets it); a spill is always reported.
use std::path::{Path, PathBuf};
use std::process::Command;

// The three files are the crate's own modules; build.rs reads only their define lists. abi.rs
// names the geometry as `super::consts`, which is the module just above it here as in the crate.
#[allow(dead_code)]
#[path = "src/formats/abi.rs"]
mod abi;
#[allow(dead_code)]
#[path = "src/geometry/consts.rs"]
mod consts;
#[allow(dead_code)]
#[path = "src/cuda/shapes.rs"]
mod shapes;

/// `(name, C value)` of every define the kernels are compiled with.
fn kernel_defines() -> Vec<(String, String)> {
    consts::KERNEL_DEFINES
        .iter()
        .chain(abi::RECORD_DEFINES)
        .map(|d| (d.name().to_string(), d.c_value()))
        .chain(
            shapes::LAUNCH_DEFINES
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string())),
        )
        .collect()
}

/// Kernel files (kernels/<name>.cu), one per op family. Explicit on purpose: a new file is a
/// deliberate act, and the Rust side lists the entry points it expects from each.
const KERNELS: &[&str] = &[
    "kv_cache",
    "compressor",
    "indexer",
    "topk",
    "attention",
    "mhc",
];
/// Headers the kernels include (inlined into the NVRTC source).
const HEADERS: &[&str] = &["common.cuh"];
/// (arch, oldest PTX ISA that supports it).
const ARCHS: &[(&str, &str)] = &[("sm_80", "7.0"), ("sm_90a", "8.0"), ("sm_100a", "8.6")];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/geometry/consts.rs");
    println!("cargo:rerun-if-changed=src/formats/abi.rs");
    println!("cargo:rerun-if-changed=src/cuda/shapes.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if std::env::var_os("CARGO_FEATURE_CUDA_EMU").is_some() {
        build_host_modules();
        return;
    }
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=PATH");
    println!("cargo:rerun-if-env-changed=CSA2_PTXAS_REPORT");
    let report = std::env::var_os("CSA2_PTXAS_REPORT").is_some_and(|v| v != "0");
    let defines = kernel_defines();
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let kdir = root.join("kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for f in KERNELS
        .iter()
        .map(|k| format!("{k}.cu"))
        .chain(HEADERS.iter().map(|h| h.to_string()))
    {
        println!("cargo:rerun-if-changed=kernels/{f}");
    }

    let nvcc = find_nvcc();
    let version = nvcc_version(&nvcc);
    let ptxas = nvcc.with_file_name("ptxas");

    // Every (kernel, output) compile is independent; run them on all cores.
    let jobs: Vec<(String, Vec<String>)> = KERNELS
        .iter()
        .flat_map(|k| {
            let src = kdir.join(format!("{k}.cu")).display().to_string();
            let mut v = Vec::new();
            for (arch, _) in ARCHS {
                let o = out.join(format!("{k}.{arch}.ptx")).display().to_string();
                v.push((
                    format!("{k} → PTX {arch}"),
                    args(&["-ptx", &format!("-arch={arch}"), "-o", &o, &src]),
                ));
            }
            let fat = out.join(format!("{k}.fatbin")).display().to_string();
            // ptxas -v on the SASS build: its figures feed the spill check and the report.
            let mut fa = vec!["-fatbin".to_string(), "-Xptxas".into(), "-v".into()];
            for (_, arch) in shapes::SASS_ARCHS {
                let a = arch.trim_start_matches("sm_");
                fa.push("-gencode".into());
                fa.push(format!("arch=compute_{a},code=sm_{a}"));
            }
            // PTX for every other GPU of compute capability ≥ 8.0: the driver JITs it.
            fa.push("-gencode".into());
            fa.push("arch=compute_80,code=compute_80".into());
            fa.extend(args(&["-o", &fat, &src]));
            v.push((format!("{k} → fatbin"), fa));
            v
        })
        .collect();
    let mut common = args(&["-O3", "-std=c++17"]);
    common.extend(defines.iter().map(|(n, v)| format!("-D{n}={v}")));
    let figures = std::sync::Mutex::new(Vec::<PtxasFigures>::new());
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(what, a)| {
                let nvcc = &nvcc;
                let common = &common;
                let kdir = &kdir;
                let figures = &figures;
                s.spawn(move || {
                    let o = Command::new(nvcc)
                        .args(common)
                        .args(a)
                        .current_dir(kdir)
                        .output()
                        .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
                    if !o.status.success() {
                        panic!(
                            "nvcc failed for {what}:\n{}{}",
                            String::from_utf8_lossy(&o.stdout),
                            String::from_utf8_lossy(&o.stderr)
                        );
                    }
                    figures
                        .lock()
                        .unwrap()
                        .extend(ptxas_figures(&String::from_utf8_lossy(&o.stderr)));
                    for line in ptxas_summary(&String::from_utf8_lossy(&o.stderr)) {
                        if report || line.contains("SPILLS") {
                            println!("cargo:warning=csa2 kernels: {what}: {line}");
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            if h.join().is_err() {
                panic!("a kernel compile failed (see the message above)");
            }
        }
    });

    // Compat PTX: re-stamp the ISA version; keep it only if ptxas assembles it under that ISA.
    for k in KERNELS {
        for (arch, isa) in ARCHS {
            let ptx = std::fs::read_to_string(out.join(format!("{k}.{arch}.ptx"))).unwrap();
            let compat = restamp(&ptx, isa);
            let path = out.join(format!("{k}.{arch}.compat.ptx"));
            let ok = match &compat {
                Some(c) => {
                    std::fs::write(&path, c).unwrap();
                    let cub = out.join(format!("{k}.{arch}.compat.cubin"));
                    Command::new(&ptxas)
                        .args([&format!("-arch={arch}"), "-o"])
                        .arg(&cub)
                        .arg(&path)
                        .output()
                        .map(|o| o.status.success())
                        .unwrap_or(false)
                }
                None => false,
            };
            if !ok {
                println!(
                    "cargo:warning=csa2 kernels: {k} for {arch} needs a PTX ISA newer than {isa}; \
                     no compat PTX embedded (CUDA 12.x drivers will need NVRTC)"
                );
                std::fs::write(&path, "").unwrap();
            }
        }
        let head: String = defines
            .iter()
            .map(|(n, v)| format!("#define {n} {v}\n"))
            .collect();
        std::fs::write(
            out.join(format!("{k}.flat.cu")),
            head + &flatten(&kdir, &format!("{k}.cu")),
        )
        .unwrap();
    }

    // The embedded module table.
    let mut gen = String::new();
    gen.push_str(&format!(
        "/// `nvcc --version` of the compiler that built the embedded kernels.\n\
         pub const NVCC_VERSION: &str = {version:?};\n\
         /// Every embedded kernel module.\npub static MODULES: &[EmbeddedModule] = &[\n"
    ));
    for k in KERNELS {
        let inc = |suffix: &str, bytes: bool| {
            let p = out.join(format!("{k}{suffix}")).display().to_string();
            if bytes {
                format!("include_bytes!({p:?})")
            } else {
                format!("include_str!({p:?})")
            }
        };
        gen.push_str(&format!(
            "    EmbeddedModule {{ name: {k:?}, fatbin: {}, ptx_sm80: {}, ptx_sm90a: {}, \
             ptx_sm100a: {}, compat_ptx_sm80: {}, compat_ptx_sm90a: {}, compat_ptx_sm100a: {}, \
             source: {} }},\n",
            inc(".fatbin", true),
            inc(".sm_80.ptx", false),
            inc(".sm_90a.ptx", false),
            inc(".sm_100a.ptx", false),
            inc(".sm_80.compat.ptx", false),
            inc(".sm_90a.compat.ptx", false),
            inc(".sm_100a.compat.ptx", false),
            inc(".flat.cu", false),
        ));
    }
    gen.push_str("];\n");
    let mut figures = figures.into_inner().unwrap();
    figures.sort_by(|a, b| (&a.kernel, &a.arch).cmp(&(&b.kernel, &b.arch)));
    gen.push_str(&ptxas_table(&figures));
    std::fs::write(out.join("embedded_kernels.rs"), gen).unwrap();
}

/// ptxas' figures for one entry point and arch, as `-Xptxas -v` prints them.
struct PtxasFigures {
    kernel: String,
    arch: String,
    registers: u32,
    shared_bytes: u32,
    stack_bytes: u32,
    spill_stores: u32,
    spill_loads: u32,
}

/// The number just before `unit` in `line` (e.g. "44160 bytes smem" → 44160).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.trim_end()
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Every entry point's figures from `ptxas -v` output (the SASS builds).
fn ptxas_figures(stderr: &str) -> Vec<PtxasFigures> {
    let mut out = Vec::new();
    let mut cur: Option<PtxasFigures> = None;
    for l in stderr.lines() {
        if let Some(rest) = l.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or("?").to_string();
            let arch = rest
                .split("for '")
                .nth(1)
                .unwrap_or("?")
                .trim_end_matches('\'')
                .to_string();
            cur = Some(PtxasFigures {
                kernel,
                arch,
                registers: 0,
                shared_bytes: 0,
                stack_bytes: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let (true, Some(c)) = (l.contains("bytes stack frame"), cur.as_mut()) {
            c.stack_bytes = number_before(l, "bytes stack frame").unwrap_or(0);
            c.spill_stores = number_before(l, "bytes spill stores").unwrap_or(0);
            c.spill_loads = number_before(l, "bytes spill loads").unwrap_or(0);
        } else if l.contains("Used ") && cur.is_some() {
            let mut c = cur.take().unwrap();
            c.registers = number_before(l, "registers").unwrap_or(0);
            c.shared_bytes = number_before(l, "bytes smem").unwrap_or(0);
            out.push(c);
        }
    }
    out
}

/// The generated `PTXAS` table (empty in builds without nvcc).
fn ptxas_table(figures: &[PtxasFigures]) -> String {
    let mut g = String::from(
        "/// ptxas' figures of every kernel entry point as this build compiled it (empty without nvcc):\n\
         /// `(kernel, arch, registers, static shared bytes, stack bytes, spill stores, spill loads)`.\n\
         pub static PTXAS: &[(&str, &str, u32, u32, u32, u32, u32)] = &[\n",
    );
    for f in figures {
        g.push_str(&format!(
            "    ({:?}, {:?}, {}, {}, {}, {}, {}),\n",
            f.kernel,
            f.arch,
            f.registers,
            f.shared_bytes,
            f.stack_bytes,
            f.spill_stores,
            f.spill_loads
        ));
    }
    g.push_str("];\n");
    g
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// nvcc from `NVCC`, then `$CUDA_HOME/bin/nvcc`, then `PATH`.
fn find_nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return p;
        }
        panic!("NVCC is set to {} but no such file exists", p.display());
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = Path::new(&h).join("bin").join("nvcc");
        if p.is_file() {
            return p;
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "feature `cuda` needs nvcc and none was found: set NVCC to the nvcc binary, or CUDA_HOME to a \
         toolkit (CUDA_HOME/bin/nvcc), or put nvcc on PATH. A compile-only toolchain without a GPU: \
         `export NVCC=\"$(scripts/cuda-env.sh)\"`"
    );
}

fn nvcc_version(nvcc: &Path) -> String {
    let o = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find(|l| l.contains("release"))
        .unwrap_or("unknown")
        .trim()
        .to_string()
}

/// One line per entry point and arch from `ptxas -v` output: registers, stack, spills (the
/// line says SPILLS when a store or load spilled).
fn ptxas_summary(stderr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<(String, String)> = None;
    let mut frame = String::new();
    for l in stderr.lines() {
        if let Some(rest) = l.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("?").to_string();
            let arch = rest
                .split("for '")
                .nth(1)
                .unwrap_or("?")
                .trim_end_matches('\'');
            cur = Some((name, arch.to_string()));
            frame.clear();
        } else if l.contains("bytes stack frame") && frame.is_empty() {
            frame = l.split(':').next_back().unwrap_or("").trim().to_string();
        } else if let (Some(regs), Some((name, arch))) = (l.split("Used ").nth(1), &cur) {
            let regs = regs.split(',').next().unwrap_or("?");
            let spills = !frame.contains(" 0 bytes spill stores, 0 bytes spill loads");
            out.push(format!(
                "{name} {arch}: {regs}; {frame}{}",
                if spills { " — SPILLS" } else { "" }
            ));
            cur = None;
        }
    }
    out
}

/// Replaces the `.version X.Y` line of a PTX module; None when the module has none.
fn restamp(ptx: &str, isa: &str) -> Option<String> {
    let mut found = false;
    let s: Vec<String> = ptx
        .lines()
        .map(|l| {
            if !found && l.trim_start().starts_with(".version ") {
                found = true;
                format!(".version {isa}")
            } else {
                l.to_string()
            }
        })
        .collect();
    found.then(|| s.join("\n") + "\n")
}

/// The source with every `#include "local.cuh"` replaced by the file (once; `#pragma once` dropped).
fn flatten(dir: &Path, file: &str) -> String {
    let mut seen = Vec::new();
    flatten_into(dir, file, &mut seen)
}

fn flatten_into(dir: &Path, file: &str, seen: &mut Vec<String>) -> String {
    let text = std::fs::read_to_string(dir.join(file))
        .unwrap_or_else(|e| panic!("cannot read kernels/{file}: {e}"));
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t == "#pragma once" {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include \"") {
            let inc = rest.trim_end_matches('"').to_string();
            if !seen.contains(&inc) {
                seen.push(inc.clone());
                out.push_str(&flatten_into(dir, &inc, seen));
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Feature `cuda-emu`: every kernel file compiled as host C++20 under the host SIMT harness
/// (`kernels/simt/simt.h` force-included, `runtime.cpp` linked in), one shared object per module
/// and build, embedded for `cuda::emu`. Builds: sm_90a; sm_100a (`__CUDA_ARCH_FEAT_SM100_ALL`, so
/// the SM100 branches run too); sm_90a under ThreadSanitizer and under AddressSanitizer + UBSan
/// (selected at run time with `CSA2_EMU_SANITIZER`, the test process preloading the runtime); and
/// the mutants below.
fn build_host_modules() {
    println!("cargo:rerun-if-env-changed=CXX");
    for f in ["simt.h", "registry.h", "runtime.cpp"] {
        println!("cargo:rerun-if-changed=kernels/simt/{f}");
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let kdir = root.join("kernels");
    for f in KERNELS
        .iter()
        .map(|k| format!("{k}.cu"))
        .chain(HEADERS.iter().map(|h| h.to_string()))
    {
        println!("cargo:rerun-if-changed=kernels/{f}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let base = args(&[
        "-std=c++20",
        "-O2",
        "-g",
        "-fPIC",
        "-pthread",
        "-fvisibility=hidden",
        "-Wall",
        "-Wno-unused-function",
    ]);
    // (flavor, kernel flags, scheduler flags): the ThreadSanitizer build leaves the scheduler
    // uninstrumented (runtime.cpp says why) and tells it so with CSA2_SIMT_TSAN.
    let asan = args(&[
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
    ]);
    let flavors: [(&str, Vec<String>, Vec<String>); 3] = [
        ("", vec![], vec![]),
        (
            "tsan",
            args(&["-fsanitize=thread", "-fno-omit-frame-pointer"]),
            args(&["-DCSA2_SIMT_TSAN=1"]),
        ),
        (
            "asan",
            asan.clone(),
            [asan, args(&["-DCSA2_SIMT_ASAN=1"])].concat(),
        ),
    ];
    let run = |what: &str, cmd: &mut Command| {
        let o = cmd.output().unwrap_or_else(|e| {
            panic!("cannot run {cxx} for {what}: {e} (set CXX to a C++20 compiler)")
        });
        if !o.status.success() {
            panic!(
                "the host SIMT build of {what} failed:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    };
    std::thread::scope(|s| {
        for (flavor, _, extra) in &flavors {
            let (out, kdir, base, run, cxx) = (&out, &kdir, &base, &run, &cxx);
            s.spawn(move || {
                run(
                    &format!("kernels/simt/runtime.cpp {flavor}"),
                    Command::new(cxx)
                        .args(base)
                        .args(extra)
                        .arg("-c")
                        .arg(kdir.join("simt/runtime.cpp"))
                        .arg("-o")
                        .arg(out.join(format!("simt_runtime{flavor}.o"))),
                )
            });
        }
    });
    let defines: Vec<String> = kernel_defines()
        .iter()
        .map(|(n, v)| format!("-D{n}={v}"))
        .collect();
    // One job per shared object: (module, build name, flavor, extra flags, mutant edit).
    type Job = (
        &'static str,
        String,
        usize,
        Vec<String>,
        Option<(&'static str, &'static str)>,
    );
    let mut jobs: Vec<Job> = Vec::new();
    for k in KERNELS {
        jobs.push((k, "sm_90a".into(), 0, vec![], None));
        jobs.push((
            k,
            "sm_100a".into(),
            0,
            args(&["-D__CUDA_ARCH_FEAT_SM100_ALL=1"]),
            None,
        ));
        jobs.push((k, "sm_90a.tsan".into(), 1, vec![], None));
        jobs.push((k, "sm_90a.asan".into(), 2, vec![], None));
    }
    for (k, mutant, from, to) in MUTANTS {
        jobs.push((k, format!("mutant.{mutant}"), 0, vec![], Some((from, to))));
    }
    // Two compilers at a time per core is plenty; the jobs are independent.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()) * 2;
    std::thread::scope(|s| {
        for _ in 0..workers {
            let (jobs, next, out, kdir, flavors, defines, run, cxx, base) = (
                &jobs, &next, &out, &kdir, &flavors, &defines, &run, &cxx, &base,
            );
            s.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((k, build, flavor, extra, edit)) = jobs.get(i) else {
                    break;
                };
                let mut src = std::fs::read_to_string(kdir.join(format!("{k}.cu"))).unwrap();
                let cu = match edit {
                    None => kdir.join(format!("{k}.cu")),
                    Some((from, to)) => {
                        assert_eq!(
                            src.matches(from).count(),
                            1,
                            "{k} {build}: its edit must match kernels/{k}.cu exactly once"
                        );
                        src = src.replacen(from, to, 1);
                        let p = out.join(format!("{k}.{build}.cu"));
                        std::fs::write(&p, &src).unwrap();
                        p
                    }
                };
                let rows: Vec<String> = global_kernels(&src)
                    .iter()
                    .map(|(name, bound)| format!("    CSA2_SIMT_KERNEL({name}, {bound})"))
                    .collect();
                assert!(
                    !rows.is_empty(),
                    "kernels/{k}.cu: no extern \"C\" __global__"
                );
                let tu = out.join(format!("{k}.{build}.simt.cpp"));
                std::fs::write(
                    &tu,
                    format!(
                        "#include \"{}\"\n#include \"simt/registry.h\"\nCSA2_SIMT_TABLE(\n{}\n)\n",
                        cu.display(),
                        rows.join(",\n")
                    ),
                )
                .unwrap();
                let (fname, fflags, _) = &flavors[*flavor];
                run(
                    &format!("kernels/{k}.cu ({build})"),
                    Command::new(cxx)
                        .args(base)
                        .args(fflags)
                        .args(defines)
                        .args(extra)
                        .arg("-I")
                        .arg(kdir)
                        .arg("-include")
                        .arg(kdir.join("simt/simt.h"))
                        .arg("-shared")
                        .arg("-o")
                        .arg(out.join(format!("{k}.{build}.simt.so")))
                        .arg(&tu)
                        .arg(out.join(format!("simt_runtime{fname}.o"))),
                );
            });
        }
    });
    let so = |k: &str, build: &str| {
        format!(
            "include_bytes!({:?})",
            out.join(format!("{k}.{build}.simt.so"))
                .display()
                .to_string()
        )
    };
    let mut gen = String::from(
        "/// No nvcc in a host SIMT build (the name the GPU build's constant has).\n\
         pub const NVCC_VERSION: &str = \"none (host SIMT build)\";\n\
         /// The host-compiled kernel modules (feature `cuda-emu`), one per kernel file.\n\
         pub static MODULES: &[EmbeddedModule] = &[\n",
    );
    for k in KERNELS {
        gen.push_str(&format!(
            "    EmbeddedModule {{ name: {k:?}, host_sm90a: {}, host_sm100a: {}, \
             host_sm90a_tsan: {}, host_sm90a_asan: {} }},\n",
            so(k, "sm_90a"),
            so(k, "sm_100a"),
            so(k, "sm_90a.tsan"),
            so(k, "sm_90a.asan"),
        ));
    }
    gen.push_str("];\n");
    gen.push_str(
        "/// Deliberately broken builds of a module (module, mutant, sm_90a image), selected with\n\
         /// `CSA2_EMU_MUTANT=<module>:<mutant>` to show the tests catch the defect.\n\
         pub static MUTANTS: &[(&str, &str, &[u8])] = &[\n",
    );
    for (k, mutant, _, _) in MUTANTS {
        gen.push_str(&format!(
            "    ({k:?}, {mutant:?}, {}),\n",
            so(k, &format!("mutant.{mutant}"))
        ));
    }
    gen.push_str("];\n");
    gen.push_str(&ptxas_table(&[]));
    std::fs::write(out.join("embedded_kernels.rs"), gen).unwrap();
}

/// Deliberate kernel defects for the host SIMT harness's mutation tests: (module, name, the exact
/// source text, its replacement).
const MUTANTS: &[(&str, &str, &str, &str)] = &[
    // Two A fragments of the tensor-core QKᵀ swapped: a wrong fragment mapping.
    (
        "attention",
        "mma_a_registers_swapped",
        "mma_bf16_16816(s[nt], a0, a1, a2, a3, b0, b1);",
        "mma_bf16_16816(s[nt], a1, a0, a2, a3, b0, b1);",
    ),
    // The barrier between writing the tensor-core kernel's key tile and reading it, removed.
    (
        "attention",
        "mma_tile_barrier_removed",
        "dst[i] = f32_to_bf16_bits(f[i]);\n        }\n        __syncthreads();",
        "dst[i] = f32_to_bf16_bits(f[i]);\n        }",
    ),
    // The split kernel's combine weighting every partial by e^0 (each partial's own max ignored).
    (
        "attention",
        "split_combine_ignores_partial_max",
        "float w = expf(m_s - M);",
        "float w = expf(M - M);",
    ),
    // The split kernel reading its raw records without waiting for their cp.async copies.
    (
        "attention",
        "split_cp_async_wait_removed",
        "cp_async_wait<1>();",
        "",
    ),
    // The barrier between the two dim-half warps writing their S halves and reading each other's.
    (
        "attention",
        "split_s_half_barrier_removed",
        "__syncthreads();  // both halves of S written",
        "",
    ),
    // The barrier between the top-k's histogram counts and thread 0's bucket scan, removed.
    (
        "topk",
        "histogram_barrier_removed",
        "if (shift == 24 && zeros) atomicAdd(&s.zero, zeros);\n        __syncthreads();",
        "if (shift == 24 && zeros) atomicAdd(&s.zero, zeros);",
    ),
];

/// The `extern "C" __global__` kernels of a .cu file with their `__launch_bounds__` thread bound
/// (the macro text as written, or `0` without one).
fn global_kernels(src: &str) -> Vec<(String, String)> {
    const MARK: &str = "extern \"C\" __global__";
    let mut v = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find(MARK) {
        rest = &rest[i + MARK.len()..];
        let mut s = rest.trim_start();
        s = s
            .strip_prefix("void")
            .expect("a kernel returns void")
            .trim_start();
        let mut bound = "0".to_string();
        if let Some(b) = s.strip_prefix("__launch_bounds__(") {
            let end = b.find(')').expect("__launch_bounds__(...) closes");
            bound = b[..end].split(',').next().unwrap().trim().to_string();
            s = b[end + 1..].trim_start();
        }
        let name: String = s
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        assert!(!name.is_empty(), "a kernel without a name");
        v.push((name, bound));
    }
    v
}
