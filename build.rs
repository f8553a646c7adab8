//! Build script: compiles kernels/*.cu twice over — with the host C++ compiler against kernels/emu.h
//! (always; a static lib whose `emu_*` entry points run the kernels' own source on CPU, see
//! `harpe::ops::emu`), and with nvcc to PTX when the `cuda` feature is on (embedded by `ops::cuda`).
//!
//! Reference: `nvcc -ptx -arch=compute_80 -O3 -std=c++17` per kernel file into OUT_DIR, embedded by `ops::cuda`
//! with `include_str!`; nvcc and its headers come from PyPI (scripts/install-cuda-toolchain.sh).
//! The non-obvious decision: PTX for compute_80 (not SASS) so one binary runs on A100 and, JIT-compiled
//! by the driver, on Hopper; `HARPE_PTX_ARCH` overrides it (e.g. compute_90).
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
        build_ptx(&kdir, &out);
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

fn build_ptx(kdir: &Path, out: &Path) {
    let nvcc = find_nvcc();
    println!("cargo:rerun-if-env-changed=HARPE_PTX_ARCH");
    let arch = std::env::var("HARPE_PTX_ARCH").unwrap_or_else(|_| "compute_80".into());
    for k in KERNELS {
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["-ptx", &format!("-arch={arch}"), "-O3", "-std=c++17", "-lineinfo", "-o"])
            .arg(&ptx)
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
    }
}
