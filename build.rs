//! Build script: compiles kernels/*.cu twice over — with the host C++ compiler against kernels/emu.h
//! (always; a static lib whose `emu_*` entry points run the kernels' own source on CPU, see
//! `harpe::ops::emu`), and with nvcc to one fatbin per file when the `cuda` feature is on (embedded by
//! `ops::cuda`).
//!
//! Reference: `nvcc -fatbin -gencode arch=compute_80,code=[sm_80,compute_80] -gencode
//! arch=compute_90,code=[sm_90,compute_90] -O3 -std=c++17` per kernel file into OUT_DIR, embedded by
//! `ops::cuda` with `include_bytes!`; nvcc and its headers come from PyPI (scripts/install-cuda-toolchain.sh).
//! The non-obvious decision: SASS for sm_80 and sm_90 beside the PTX of both, so an A100 or an H100/H200
//! runs the kernels without a JIT compile at first use (the driver picks the SASS of the device), and any
//! other GPU of compute capability >= 8.0 JIT-compiles the newest PTX it can take. `HARPE_CUDA_ARCHS`
//! (default "80,90") names the archs; each fatbin is checked to hold the SASS of every one of them.
//! Does not: build candle's kernels (candle-kernels does), or look for a GPU.
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: [&str; 7] = ["rope", "rms_norm", "cross_entropy", "adamw", "attention", "mma_probe", "emu_toys"];

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kdir = root.join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    for f in ["emu.h", "common.cuh", "mma.cuh"] {
        println!("cargo:rerun-if-changed={}", kdir.join(f).display());
    }
    build_emulation(&kdir, &out);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        record_cuda_version();
        build_fatbins(&kdir, &out);
    }
    if std::env::var_os("CARGO_FEATURE_MKL").is_some() {
        link_mkl();
    }
    if std::env::var_os("CARGO_FEATURE_GLOO").is_some() {
        build_gloo_shim(&root.join("native"));
    }
}

/// Feature `gloo`: native/gloo_shim.cc (a C interface to Gloo's collectives, `comms::gloo`) against
/// Debian's libgloo-dev (headers in /usr/include/gloo, libgloo.so in /usr/lib), linked dynamically.
fn build_gloo_shim(dir: &Path) {
    let src = dir.join("gloo_shim.cc");
    println!("cargo:rerun-if-changed={}", src.display());
    let hint = "hint: apt-get install libgloo-dev (Debian/Ubuntu), or build without --features gloo";
    if !Path::new("/usr/include/gloo/allreduce.h").is_file() {
        panic!("feature `gloo`: Gloo's headers are not installed (/usr/include/gloo/allreduce.h)\n{hint}");
    }
    cc::Build::new()
        .cpp(true)
        .file(&src)
        .flag("-std=c++17")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .compile("harpe_gloo_shim");
    println!("cargo:rustc-link-search=native=/usr/lib");
    println!("cargo:rustc-link-lib=dylib=gloo");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

/// Feature `mkl`: link MKL's sequential LP64 static libraries from `HARPE_MKL_LIB` (scripts/install-mkl.sh
/// lays them out) as one group (the three archives reference each other). Static, so the binary needs no
/// MKL at run time. A missing directory is a build error with the command that makes it.
fn link_mkl() {
    println!("cargo:rerun-if-env-changed=HARPE_MKL_LIB");
    let hint = "hint: eval \"$(scripts/install-mkl.sh target/mkl)\" (downloads mkl-static from PyPI), then build again";
    let dir = PathBuf::from(std::env::var("HARPE_MKL_LIB").unwrap_or_else(|_| {
        panic!("feature `mkl`: HARPE_MKL_LIB is not set (the directory holding MKL's static libraries)\n{hint}")
    }));
    let libs = ["libmkl_intel_lp64.a", "libmkl_sequential.a", "libmkl_core.a"];
    for l in libs {
        let p = dir.join(l);
        if !p.is_file() {
            panic!("feature `mkl`: {} does not exist (HARPE_MKL_LIB={})\n{hint}", p.display(), dir.display());
        }
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rustc-link-arg=-Wl,--start-group");
    for l in libs {
        println!("cargo:rustc-link-arg={}", dir.join(l).display());
    }
    println!("cargo:rustc-link-arg=-Wl,--end-group");
    for l in ["pthread", "m", "dl"] {
        println!("cargo:rustc-link-arg=-l{l}");
    }
}

/// One wrapper .cpp per kernel (`#include ".../rope.cu"`), so the host compiler sees C++ sources.
fn build_emulation(kdir: &Path, out: &Path) {
    let mut b = cc::Build::new();
    b.cpp(true).std("c++17").opt_level(2).include(kdir).warnings(false);
    for k in KERNELS {
        let src = kdir.join(format!("{k}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let wrapper = out.join(format!("emu_{k}.cpp"));
        std::fs::write(&wrapper, format!("#include \"{}\"\n", src.display()))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", wrapper.display()));
        b.file(wrapper);
    }
    b.compile("harpe_kernels_emu");
}

fn find_nvcc() -> PathBuf {
    println!("cargo:rerun-if-env-changed=NVCC");
    for v in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    if let Some(p) = std::env::var_os("NVCC") {
        return PathBuf::from(p);
    }
    for v in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(r) = std::env::var_os(v) {
            let p = PathBuf::from(r).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc") // from PATH
}

/// `HARPE_CUDA_BUILD_VERSION` for the crate: the CUDA release of the nvcc that builds it, as the driver API
/// writes versions (1000 x major + 10 x minor: 12040 for 12.4). The binary links that release's cudart,
/// cuBLAS and NCCL and embeds PTX of its ISA, so a driver older than it cannot run the binary: `harpe
/// --version` names it and training compares it with the driver's before any weight is read
/// (device::check_cuda_floor). cudarc reads the same `nvcc --version` to pick its bindings.
fn record_cuda_version() {
    let nvcc = find_nvcc();
    let out = Command::new(&nvcc).arg("--version").output().unwrap_or_else(|e| {
        panic!(
            "cannot run {} --version ({e})\nhint: eval \"$(scripts/install-cuda-toolchain.sh target/cuda-toolchain)\" \
             puts nvcc on PATH and sets CUDA_ROOT",
            nvcc.display()
        )
    });
    let text = String::from_utf8_lossy(&out.stdout);
    let release = text
        .split("release ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{} --version printed no 'release X.Y':\n{text}", nvcc.display()));
    let (major, minor) = release
        .split_once('.')
        .and_then(|(a, b)| Some((a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?)))
        .unwrap_or_else(|| panic!("{} --version: cannot read release {release:?}", nvcc.display()));
    println!("cargo:rustc-env=HARPE_CUDA_BUILD_VERSION={}", major * 1000 + minor * 10);
}

/// The archs of `HARPE_CUDA_ARCHS` (default 80 and 90), e.g. "80,90" -> [80, 90].
fn cuda_archs() -> Vec<u32> {
    println!("cargo:rerun-if-env-changed=HARPE_CUDA_ARCHS");
    let spec = std::env::var("HARPE_CUDA_ARCHS").unwrap_or_else(|_| "80,90".into());
    let archs: Vec<u32> = spec
        .split(',')
        .map(|a| {
            a.trim().parse().unwrap_or_else(|_| {
                panic!(
                    "HARPE_CUDA_ARCHS={spec:?}: {a:?} is not a compute capability\nhint: e.g. HARPE_CUDA_ARCHS=80,90"
                )
            })
        })
        .collect();
    assert!(!archs.is_empty(), "HARPE_CUDA_ARCHS is empty\nhint: e.g. HARPE_CUDA_ARCHS=80,90");
    archs
}

/// kernels/K.cu -> OUT_DIR/K.fatbin: SASS and PTX for each arch of `cuda_archs`.
fn build_fatbins(kdir: &Path, out: &Path) {
    let nvcc = find_nvcc();
    let archs = cuda_archs();
    for k in KERNELS {
        let fatbin = out.join(format!("{k}.fatbin"));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("-fatbin");
        for a in &archs {
            cmd.arg(format!("-gencode=arch=compute_{a},code=[sm_{a},compute_{a}]"));
        }
        let status = cmd
            .args(["-O3", "-std=c++17", "-lineinfo", "-o"])
            .arg(&fatbin)
            .arg(kdir.join(format!("{k}.cu")))
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} ({e})\nhint: eval \"$(scripts/install-cuda-toolchain.sh target/cuda-toolchain)\" \
                     puts nvcc on PATH and sets CUDA_ROOT",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed on kernels/{k}.cu ({status})");
        check_fatbin(&fatbin, &archs);
    }
}

/// Fail the build unless `path` is a fatbin holding SASS (an ELF entry) and PTX for each of `archs`: a
/// toolchain that dropped an arch would otherwise show only as a JIT compile on the GPU, or a missing
/// kernel image on one too new for the PTX.
fn check_fatbin(path: &Path, archs: &[u32]) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let entries = fatbin_entries(&data).unwrap_or_else(|e| panic!("{}: not a fatbin nvcc wrote: {e}", path.display()));
    for &a in archs {
        for (kind, what) in [(FATBIN_ELF, "SASS"), (FATBIN_PTX, "PTX")] {
            assert!(
                entries.contains(&(kind, a)),
                "{}: no {what} for sm_{a} (entries (kind, arch): {entries:?}; kind {FATBIN_ELF} = SASS, {FATBIN_PTX} = PTX)\n\
                 hint: check that this nvcc supports sm_{a} (nvcc --list-gpu-code)",
                path.display()
            );
        }
    }
}

/// Entry kinds of a fatbin: PTX text and an ELF (SASS) image.
const FATBIN_PTX: u16 = 1;
const FATBIN_ELF: u16 = 2;

/// The (kind, arch) of each entry of a fatbin image. Its layout (CUDA's fatbinary.h, as `cuobjdump` reads
/// it): a 16-byte header (magic 0xBA55ED50 u32, version u16, header size u16, size of the entries u64),
/// then entries, each a header (kind u16, u16, header size u32, payload size u64, ..., arch u32 at
/// byte 28) followed by its payload.
fn fatbin_entries(d: &[u8]) -> Result<Vec<(u16, u32)>, String> {
    let u16_at = |o: usize| d.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| d.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |o: usize| d.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
    if u32_at(0) != Some(0xBA55_ED50) {
        return Err("no fatbin magic".into());
    }
    let (hdr, size) = (u16_at(6).ok_or("short header")? as usize, u64_at(8).ok_or("short header")? as usize);
    let end = hdr.checked_add(size).filter(|&e| e <= d.len()).ok_or("entries past the end of the file")?;
    let (mut at, mut out) = (hdr, vec![]);
    while at < end {
        let kind = u16_at(at).ok_or("short entry")?;
        let entry_hdr = u32_at(at + 4).ok_or("short entry")? as usize;
        let payload = u64_at(at + 8).ok_or("short entry")? as usize;
        if entry_hdr < 32 {
            return Err(format!("an entry header of {entry_hdr} bytes"));
        }
        out.push((kind, u32_at(at + 28).ok_or("short entry")?));
        at = at.checked_add(entry_hdr).and_then(|a| a.checked_add(payload)).ok_or("entry size overflows")?;
    }
    Ok(out)
}
