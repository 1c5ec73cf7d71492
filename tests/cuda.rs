//! CUDA kernels against the CPU path (feature `cuda`).
//!
//! Without a CUDA driver every GPU test prints `SKIPPED: no CUDA driver` and returns (run with
//! `--nocapture` to see it; `scripts/ci-cuda.sh` counts the skips). The embedded-module tests and the
//! NVRTC test need no GPU. Larger, timed runs: `tests/gpu/validate.sh`.
#![cfg(feature = "cuda")]

mod cuda_support;

#[cfg(not(feature = "cuda-emu"))]
use csa2::cuda::modules::{ptx_entries, ptx_isa, EmbeddedModule, MODULES, NVCC_VERSION};
use csa2::cuda::CudaDevice;
#[cfg(not(feature = "cuda-emu"))]
use csa2::cuda::EXPECTED_KERNELS;
use csa2::formats::RecordFormat;
use cuda_support::checks::{self, Report, Size};
use cuda_support::host;

const SMALL: Size = Size {
    large: false,
    iters: 0,
};

fn device() -> Option<CudaDevice> {
    if !CudaDevice::driver_present() {
        println!("SKIPPED: no CUDA driver");
        return None;
    }
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("SKIPPED: no usable CUDA device ({e})");
            None
        }
    }
}

fn assert_report(r: csa2::Result<Report>) {
    let r = r.unwrap_or_else(|e| panic!("kernel call failed: {e}"));
    println!("{}\n{}", r.name, r.detail);
    assert!(r.ok, "{} failed:\n{}", r.name, r.detail);
}

// ---- no device needed ---------------------------------------------------------------------------------

/// Every `__shared__` variable of `kernels/` is declared in the body of an `extern "C" __global__`
/// entry point (or of a macro an entry point expands): the host SIMT harness places shared
/// variables in its own section and poisons it before each block, and a `__shared__` inside a
/// template or `__device__` function lands in `.bss` there instead (GCC ignores the section of a
/// template's static), so reads before writes would go unseen.
#[test]
fn shared_memory_is_declared_in_entry_points() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels");
    let mut checked = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let ext = path.extension().and_then(|x| x.to_str());
        if !matches!(ext, Some("cu" | "cuh")) {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = src.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let code = l.split("//").next().unwrap();
            if !code.contains("__shared__") || code.trim_start().starts_with("#define __shared__") {
                continue;
            }
            checked += 1;
            // The enclosing top-level declaration: the nearest line above at column 0 that is
            // code (not a comment, a closing brace or a blank line).
            let head = lines[..i]
                .iter()
                .rev()
                .find(|h| {
                    let t = h.trim_end();
                    !t.is_empty()
                        && !h.starts_with(' ')
                        && !h.starts_with('\t')
                        && !h.starts_with("//")
                        && !h.starts_with('}')
                })
                .unwrap_or(&"");
            assert!(
                head.contains("extern \"C\" __global__") || head.starts_with("#define "),
                "{}:{}: a __shared__ variable outside an entry point's body (in `{}`)",
                path.display(),
                i + 1,
                head.trim()
            );
        }
    }
    assert!(
        checked >= 20,
        "found only {checked} __shared__ declarations"
    );
}

/// Each split attention kernel's blocks per SM, as its plan assumes, is what this build's ptxas
/// figures give on every SASS arch (registers and static shared memory of 256-thread blocks):
/// one for the 64-head kernel, two for the 32-head one; neither spills.
#[cfg(not(feature = "cuda-emu"))]
#[test]
fn split_attention_blocks_per_sm_match_the_ptxas_figures() {
    use csa2::ops::attention::cuda::PoolsKernel;
    use csa2::ops::attention::decode_model::{blocks_per_sm, HOPPER};
    for kernel in [PoolsKernel::Split, PoolsKernel::SplitH32] {
        let rows: Vec<_> = csa2::cuda::modules::PTXAS
            .iter()
            .filter(|f| f.0 == kernel.entry())
            .collect();
        assert!(
            rows.iter().any(|f| f.1 == "sm_90a"),
            "no sm_90a figures for {kernel:?}: {rows:?}"
        );
        for &&(_, arch, regs, smem, _, spill_st, spill_ld) in &rows {
            assert_eq!((spill_st, spill_ld), (0, 0), "{arch}: {kernel:?} spills");
            if arch == "sm_90a" || arch.starts_with("sm_10") {
                assert_eq!(
                    blocks_per_sm(regs, smem, 256, &HOPPER) as usize,
                    kernel.blocks_per_sm(),
                    "{arch}: {kernel:?}, {regs} registers, {smem} B shared"
                );
            }
        }
    }
}

/// The pooled indexer has an entry point per query quantisation, each clear of the 255-register
/// cap (one entry for every mode held 255), and the Mega-mHC boundary does not spill, on every
/// SASS arch this build compiles.
#[cfg(not(feature = "cuda-emu"))]
#[test]
fn pooled_indexer_entries_and_mhc_fit_their_registers() {
    use csa2::cuda::modules::PTXAS;
    use csa2::cuda::shapes::SASS_ARCHS;
    use csa2::ops::indexer::{cuda::pool_kernel, QueryQuant};
    let figures = |k: &str, arch: &str| {
        *PTXAS
            .iter()
            .find(|f| f.0 == k && f.1 == arch)
            .unwrap_or_else(|| panic!("no ptxas figures for {k} on {arch}"))
    };
    for &(_, arch) in SASS_ARCHS {
        for q in [
            QueryQuant::None,
            QueryQuant::Mxfp4,
            QueryQuant::Fp8,
            QueryQuant::Bf16,
        ] {
            let k = pool_kernel(q);
            let f = figures(k, arch);
            assert!(f.2 < 255 && (f.5, f.6) == (0, 0), "{k} on {arch}: {f:?}");
        }
        let f = figures("mega_mhc_bf16", arch);
        assert_eq!((f.5, f.6), (0, 0), "mega_mhc_bf16 spills on {arch}: {f:?}");
    }
}

#[cfg(not(feature = "cuda-emu"))]
#[test]
fn embedded_ptx_names_every_kernel_for_both_archs() {
    assert_eq!(MODULES.len(), EXPECTED_KERNELS.len());
    for (module, kernels) in EXPECTED_KERNELS {
        let m =
            EmbeddedModule::get(module).unwrap_or_else(|| panic!("module {module} not embedded"));
        for arch in ["sm_80", "sm_90a", "sm_100a"] {
            let ptx = m.ptx(arch).unwrap();
            assert!(!ptx.is_empty(), "{module} {arch}: empty PTX");
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{module}: PTX not for {arch}"
            );
            let mut entries = ptx_entries(ptx);
            entries.sort();
            let mut want: Vec<String> = kernels.iter().map(|s| s.to_string()).collect();
            want.sort();
            assert_eq!(entries, want, "{module} {arch}: entry points");
            let compat = m
                .compat_ptx(arch)
                .unwrap_or_else(|| panic!("{module} {arch}: no compat PTX"));
            let want_isa = match arch {
                "sm_80" => "7.0",
                "sm_90a" => "8.0",
                _ => "8.6",
            };
            assert_eq!(ptx_isa(compat), Some(want_isa));
            assert_eq!(ptx_entries(compat).len(), kernels.len());
        }
        // A CUDA fatbin starts with the magic 0xBA55ED50 (little-endian).
        assert!(
            m.fatbin.len() > 16 && m.fatbin[..4] == [0x50, 0xED, 0x55, 0xBA],
            "{module}: not a fatbin"
        );
        assert!(
            !m.source.contains("#include"),
            "{module}: NVRTC source not flattened"
        );
    }
    assert!(NVCC_VERSION.contains("release"), "{NVCC_VERSION}");
}

#[cfg(not(feature = "cuda-emu"))]
#[test]
fn e2m1_hardware_convert_only_on_sm100() {
    // SM90 has no E2M1 conversion instruction (software encoder); SM100 uses cvt…e2m1x2.
    let m = EmbeddedModule::get("kv_cache").unwrap();
    assert!(!m.ptx_sm90a.contains("e2m1x2"));
    assert!(m.ptx_sm100a.contains("cvt.rn.satfinite.e2m1x2.f32"));
}

/// The compute-capability table: SASS for each GPU generation csa2 ships for, the sm_80 PTX's JIT
/// for other GPUs of compute capability ≥ 8.0, nothing below (no bf16 `mma.sync`).
#[test]
fn cuda_compute_capabilities_map_to_their_images() {
    use csa2::cuda::sass_arch;
    use csa2::cuda::shapes::MIN_COMPUTE_CAPABILITY;
    for (cc, arch) in [
        ((8, 0), "sm_80"),
        ((8, 6), "sm_86"),
        ((8, 9), "sm_89"),
        ((9, 0), "sm_90a"),
        ((10, 0), "sm_100a"),
        ((10, 3), "sm_103a"),
        ((12, 0), "sm_120"),
    ] {
        assert_eq!(sass_arch(cc), Some(arch), "{cc:?}");
    }
    for cc in [(8, 7), (11, 0), (12, 1)] {
        assert_eq!(
            sass_arch(cc),
            None,
            "{cc:?}: no SASS, the PTX is JIT-compiled"
        );
        assert!(cc >= MIN_COMPUTE_CAPABILITY);
    }
    assert!((7, 5) < MIN_COMPUTE_CAPABILITY);
}

/// The released geometry's parameters are what the kernels were compiled for; others are refused.
#[test]
fn kernels_accept_the_released_geometry_and_refuse_other_parameters() {
    use csa2::ops::{candidates, compressor, indexer, mhc};
    let g = csa2::Geometry::embedded();
    let p = mhc::MhcParams::from_geometry(&g).unwrap();
    mhc::cuda::kernel_supports(&p).unwrap();
    let r = mhc::cuda::kernel_supports(&mhc::MhcParams {
        sinkhorn_iters: 3,
        ..p
    });
    assert!(matches!(r, Err(csa2::Error::Unsupported(_))), "{r:?}");
    indexer::cuda::kernel_supports(&indexer::IndexerParams::new(2)).unwrap();
    let mut ip = indexer::IndexerParams::new(2);
    ip.query_quant = indexer::QueryQuant::Mxfp4;
    assert!(indexer::cuda::kernel_supports(&ip).is_err());
    let (norm, wk, k_norm) = (vec![1f32; 512], vec![0f32; 128 * 512], vec![1f32; 128]);
    let w = compressor::PooledWeights {
        norm: &norm,
        wk: &wk,
        k_norm: &k_norm,
    };
    let layer = g.layers.iter().find(|l| l.ratio == 2).unwrap();
    let rope = csa2::ops::rope::Rope::for_layer(layer);
    let c = compressor::Compressor::new(2, g.rms_norm_eps, rope.clone(), w).unwrap();
    compressor::cuda::kernel_supports(&c).unwrap();
    let c = compressor::Compressor::new(2, 1e-6, rope, w).unwrap();
    assert!(compressor::cuda::kernel_supports(&c).is_err());
    assert_eq!(
        csa2::geometry::consts::CANDIDATE_BLOCK_SIZE,
        candidates::CandidateParams::default().block_size
    );
}

#[cfg(not(feature = "cuda-emu"))]
#[test]
fn open_without_driver_is_a_typed_error() {
    if CudaDevice::driver_present() {
        println!("SKIPPED: a CUDA driver is present (this test covers machines without one)");
        return;
    }
    match CudaDevice::open(0) {
        Err(csa2::Error::Unsupported(msg)) => assert!(msg.contains("driver"), "{msg}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[cfg(not(feature = "cuda-emu"))]
#[test]
fn nvrtc_jits_a_kernel_module() {
    if !CudaDevice::nvrtc_present() {
        println!("SKIPPED: no NVRTC library (install nvidia-cuda-nvrtc and put its lib dir on LD_LIBRARY_PATH)");
        return;
    }
    let m = EmbeddedModule::get("topk").unwrap();
    let opts = csa2::cuda::cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90a"),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    let ptx =
        csa2::cuda::cudarc::nvrtc::compile_ptx_with_opts(m.source, opts).expect("NVRTC compile");
    let text = ptx.to_src();
    let mut entries = ptx_entries(&text);
    entries.sort();
    assert_eq!(entries, vec!["candidate_blocks_f32", "topk_f32"]);
}

// ---- GPU against CPU ------------------------------------------------------------------------------------

#[test]
fn codecs_match_cpu_bit_for_bit() {
    let Some(dev) = device() else { return };
    for (i, fmt) in [
        RecordFormat::Nvfp4Ds,
        RecordFormat::Mxfp4Index,
        RecordFormat::Mxfp8,
    ]
    .into_iter()
    .enumerate()
    {
        assert_report(checks::check_codec(&dev, fmt, SMALL, 100 + i as u64));
    }
}

#[test]
fn unsupported_codec_is_a_typed_error() {
    let Some(dev) = device() else { return };
    let mut pages = vec![0u8; 584 * 4];
    let r = host::encode_pages(
        &dev,
        RecordFormat::V4Record,
        &[0.0; 512],
        &[0],
        &mut pages,
        4,
    );
    assert!(matches!(r, Err(csa2::Error::Unsupported(_))), "{r:?}");
    let r = host::encode_pages(
        &dev,
        RecordFormat::Mxfp8,
        &[0.0; 512],
        &[4],
        &mut vec![0u8; 528 * 4],
        4,
    );
    assert!(matches!(r, Err(csa2::Error::Invalid { .. })), "{r:?}");
}

/// The device-dispatching codec entry (`PageLayout::encode_into_pages_view`) on CUDA tensor views
/// (the memory a framework hands over through DLPack) writes the CPU codec's bytes.
#[test]
fn codec_dispatch_on_cuda_views_matches_cpu() {
    use csa2::cuda::driver::DevicePtr;
    use csa2::formats::page::PageLayout;
    use csa2::tensor::{DType, Device, TensorView, TensorViewMut};
    let Some(dev) = device() else { return };
    let layout = PageLayout {
        format: RecordFormat::Nvfp4Ds,
        slots: 4,
    };
    let x: Vec<f32> = (0..5 * 512)
        .map(|i| (i as f32 * 0.731).sin() * 3.0)
        .collect();
    let map = vec![7i64, -1, 0, 3, 6];
    let mut want = vec![9u8; 2 * layout.page_bytes()];
    layout.encode_into_pages(&x, &map, &mut want).unwrap();
    let dx = dev.upload(&x).unwrap();
    let dm = dev.upload(&map).unwrap();
    let dp = dev.upload(&vec![9u8; want.len()]).unwrap();
    {
        let s = dev.stream();
        let (px, _gx) = dx.device_ptr(s);
        let (pm, _gm) = dm.device_ptr(s);
        let (pp, _gp) = dp.device_ptr(s);
        // SAFETY: live allocations of the device's primary context for the whole block.
        let (xv, mv, mut pv) = unsafe {
            (
                TensorView::from_raw_parts(
                    px as *const u8,
                    &[5, 512],
                    &[512, 1],
                    DType::F32,
                    Device::Cuda(0),
                ),
                TensorView::from_raw_parts(
                    pm as *const u8,
                    &[5],
                    &[1],
                    DType::I64,
                    Device::Cuda(0),
                ),
                TensorViewMut::from_raw_parts(
                    pp as *mut u8,
                    &[want.len()],
                    &[1],
                    DType::U8,
                    Device::Cuda(0),
                ),
            )
        };
        layout
            .encode_into_pages_view(&xv.unwrap(), &mv.unwrap(), pv.as_mut().unwrap())
            .unwrap();
    }
    let got = dev.download(&dp).unwrap();
    assert_eq!(&got[..want.len()], &want[..]);
}

#[test]
fn compressor_ratio1_matches_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_compressor(&dev, 1, SMALL, 200));
}

#[test]
fn compressor_ratio2_with_carried_pairs_matches_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_compressor(&dev, 2, SMALL, 201));
}

#[test]
fn indexer_decode_prefill_and_masked_match_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_indexer(&dev, false, false, SMALL, 300));
    assert_report(checks::check_indexer(&dev, true, false, SMALL, 301));
    assert_report(checks::check_indexer(&dev, false, true, SMALL, 302));
}

/// Mutation check: the top-k test, run in a child process on a build of `topk.cu` without the
/// barrier between the histogram counts and the bucket scan, must fail.
#[cfg(feature = "cuda-emu")]
#[test]
fn a_removed_topk_barrier_fails_the_topk_test() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cuda::topk_matches_cpu_exactly",
            "--test-threads",
            "1",
        ])
        .env("CSA2_EMU_MUTANT", "topk:histogram_barrier_removed")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    // Without the barrier thread 0 scans a histogram still being counted: wrong selections, or
    // (as on a GPU) writes out of bounds that end the process; a sanitizer build
    // (scripts/simt-sanitizers.sh) stops at its race report.
    use std::os::unix::process::ExitStatusExt;
    let caught =
        text.contains("1 failed") || text.contains("Sanitizer") || out.status.signal().is_some();
    assert!(
        !out.status.success() && caught,
        "the build without the barrier passed:\n{text}"
    );
}

#[test]
fn topk_matches_cpu_exactly() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_topk(&dev, SMALL, 400));
}

/// The order contract from the kernel itself (no host sort), on the caller's stream and through
/// the synchronous entry: equal to the CPU entry.
#[test]
fn topk_on_stream_orders_like_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_topk_ordered(&dev, SMALL, 402));
}

/// The pooled indexer on a strided, offset vLLM-style slab: GPU vs the CPU entry and the f64
/// reference, each query quantisation, the in-kernel error record.
#[test]
fn indexer_pool_on_a_strided_slab_matches_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_indexer_pool(&dev, SMALL, 303));
}

#[test]
fn candidate_pool_matches_cpu_exactly() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_candidates(&dev, SMALL, 401));
}

/// The export's contract from the kernel itself (sorted block lists, −1 padding, counts; no host
/// step), on the caller's stream and through the synchronous entry: equal to the CPU entry and
/// the reference over the edge cases of `checks::check_candidates_ordered`.
#[test]
fn candidates_on_stream_match_cpu_and_reference() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_candidates_ordered(&dev, SMALL, 403));
}

#[test]
fn sparse_decode_attention_matches_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_attention(&dev, SMALL, 500));
}

#[test]
fn mega_mhc_matches_cpu() {
    let Some(dev) = device() else { return };
    assert_report(checks::check_mhc(&dev, true, SMALL, 600));
    assert_report(checks::check_mhc(&dev, false, SMALL, 601));
}

/// The device codecs of `kernels/common.cuh`, compiled as host C++ (intrinsics shimmed), against
/// `csa2::formats::scalar` on every E4M3 / E8M0 / E2M1 code, the special values and 2M random f32 bit
/// patterns. Needs no GPU, only a C++ compiler.
#[test]
fn device_codec_source_matches_cpu_on_host() {
    use csa2::formats::scalar::*;
    use rand::{Rng, SeedableRng};
    use std::io::Write;
    use std::process::{Command, Stdio};
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("host_codecs");
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/cuda_support/host_codecs.cpp"
    );
    // The kernels' compile-time constants, as build.rs passes them to nvcc (common.cuh refuses
    // to compile without them).
    let defines = (csa2::geometry::consts::KERNEL_DEFINES.iter())
        .chain(csa2::formats::abi::RECORD_DEFINES)
        .map(|d| format!("-D{}={}", d.name(), d.c_value()))
        .chain((csa2::cuda::shapes::LAUNCH_DEFINES.iter()).map(|(n, v)| format!("-D{n}={v}")));
    let built = Command::new(&cxx)
        .args(["-O2", "-std=c++17"])
        .args(defines)
        .arg("-o")
        .arg(&exe)
        .arg(src)
        .output();
    // No compiler at all is a skip; a compiler that rejects the device source is a failure (a
    // skip here once hid exactly that).
    let Ok(built) = built else {
        println!(
            "SKIPPED: no working C++ compiler `{cxx}` for the host build of the device codecs"
        );
        return;
    };
    assert!(
        built.status.success(),
        "the host build of kernels/common.cuh failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let mut words: Vec<u32> = (0..=0xffffu32).collect();
    for f in [
        0.25f32,
        0.2500001,
        -0.25,
        0.75,
        1.25,
        1.75,
        2.5,
        3.5,
        5.0,
        5.0001,
        6.5,
        448.0,
        449.0,
        464.0,
        465.0,
        -0.0,
        1e-38,
        2f32.powi(-9),
        2f32.powi(-10),
        1.5 * 2f32.powi(-10),
    ] {
        words.push(f.to_bits());
    }
    words.extend([
        0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 1, 3, 0x007fffff, 0x00800000,
    ]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    words.extend((0..2_000_000).map(|_| rng.random::<u32>()));
    let mut child = Command::new(&exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let input: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&input).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert_eq!(out.stdout.len(), words.len() * 20);
    let word = |c: &[u8], i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
    let same = |a: f32, b: u32| a.to_bits() == b || (a.is_nan() && f32::from_bits(b).is_nan());
    let mut bad = 0;
    for (w, c) in words.iter().zip(out.stdout.chunks_exact(20)) {
        let x = f32::from_bits(*w);
        let cl = ceil_log2(x).unwrap_or(128);
        let ok = c[0] == e2m1_encode(x)
            && c[1] == e4m3_encode(x)
            && c[2] == ((cl + 200) & 0xff) as u8
            && same(bf16_round(x), word(c, 4))
            && same(e4m3_decode((*w & 0xff) as u8), word(c, 8))
            && same(e2m1_decode((*w & 0xf) as u8), word(c, 12))
            && same(e8m0_decode((*w & 0xff) as u8), word(c, 16));
        if !ok {
            bad += 1;
            if bad < 10 {
                println!("mismatch for {w:#010x} ({x:e}): device {:?}", &c[..4]);
            }
        }
    }
    assert_eq!(bad, 0, "{bad} of {} inputs differ", words.len());
}

// ---- the references themselves (no GPU): properties a wrong reference would break --------------------
// (The compressor's and mHC's batched references are tested in the default build: ops::compressor
// unit tests and tests/mhc.rs.)

#[test]
fn reference_attention_single_key_and_sink() {
    use csa2::cuda::attention::TablePages;
    use csa2::tensor::TensorView;
    use host::{attention_ref, Pool};
    const KV: usize = 512;
    let mut swa = Pool::new(RecordFormat::Mxfp8, 2, 1);
    let key: Vec<f32> = (0..KV).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
    swa.write_slot(0, &key);
    let k = swa.read_slot(0);
    let main = Pool::new(RecordFormat::Nvfp4Ds, 2, 1);
    let q: Vec<f32> = (0..64 * KV).map(|i| ((i % 5) as f32 - 2.0) * 0.1).collect();
    let sink = vec![0.5f32; 64];
    fn cache(p: &Pool) -> TablePages<'_> {
        TablePages {
            pages: TensorView::from_host_slice(&p.bytes, &[p.bytes.len()]).unwrap(),
            block_table: TensorView::from_host_slice(&[0i32], &[1, 1]).unwrap(),
            page_slots: 2,
        }
    }
    let (mc, sc) = (cache(&main), cache(&swa));
    let (out, lse) = attention_ref(
        &q,
        &[-1],
        1,
        &[0],
        &[0],
        &[0],
        (&main.layout, &mc),
        (&swa.layout, &sc),
        Some(&sink),
        None,
        0.5,
    );
    for h in [0usize, 17, 63] {
        let z: f64 = 0.5
            * q[h * KV..(h + 1) * KV]
                .iter()
                .zip(&k)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>();
        let w = 1.0 / (1.0 + (0.5 - z).exp());
        assert!((lse[h] - z).abs() < 1e-12);
        for d in [0usize, 100, 511] {
            assert!((out[h * KV + d] - w * k[d] as f64).abs() < 1e-12);
        }
    }
}
