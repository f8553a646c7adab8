//! The binary's allocator (src/main.rs): jemalloc with the options that keep a training step's freed
//! buffers for the next step. Read back through jemalloc's own statistics (`stats_print`, which reports
//! the options in effect), so a lost `#[global_allocator]` or a changed `malloc_conf` fails here.
use crate::common::harpe_cmd;

#[cfg(all(unix, not(target_env = "musl")))]
#[test]
fn the_binary_runs_on_jemalloc_with_the_step_reuse_options() {
    let out = harpe_cmd().arg("--version").env("_RJEM_MALLOC_CONF", "stats_print:true").output().expect("harpe runs");
    assert!(out.status.success());
    let stats = String::from_utf8_lossy(&out.stderr);
    assert!(stats.contains("jemalloc statistics"), "no jemalloc statistics: not on jemalloc?\n{stats}");
    // jemalloc reads the kernel's THP mode at start; without /sys/kernel/mm/transparent_hugepage it reports
    // thp "not supported" and zeroes reused memory by MADV_DONTNEED again (slower, same results)
    let thp = if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
        "opt.thp: \"always\""
    } else {
        "opt.thp: \"not supported\""
    };
    for opt in ["opt.dirty_decay_ms: -1", "opt.muzzy_decay_ms: -1", "opt.oversize_threshold: 0", thp, "opt.narenas: 1"]
    {
        assert!(stats.contains(opt), "{opt:?} is not in effect:\n{stats}");
    }
}

/// `harpe --version` names the build's features, its CPU GEMM backend and the vector ISA of its CPU
/// kernels (benchmark records copy this line to say which build they measured).
#[test]
fn version_names_the_features_and_the_cpu_gemm_backend() {
    let out = harpe_cmd().arg("--version").output().expect("harpe runs");
    assert!(out.status.success());
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(v.starts_with(&format!("harpe {}", env!("CARGO_PKG_VERSION"))), "{v}");
    let gemm = if cfg!(feature = "mkl") { "CPU GEMM: mkl" } else { "CPU GEMM: gemm" };
    assert!(v.contains(gemm), "{v}");
    let features: Vec<&str> =
        v.split("features: ").nth(1).and_then(|r| r.split(';').next()).expect("features").split(", ").collect();
    let built = [
        ("mkl", cfg!(feature = "mkl")),
        ("cuda", cfg!(feature = "cuda")),
        ("nccl", cfg!(feature = "nccl")),
        ("avx512", cfg!(feature = "avx512")),
    ];
    for (f, on) in built {
        assert_eq!(features.contains(&f), on, "{f}: {v}");
    }
    assert_eq!(features == ["none"], !built.iter().any(|f| f.1), "{v}");
    // the ISA the CPU kernels take here: AVX-512 only when built with it and the CPU has it
    #[cfg(target_arch = "x86_64")]
    {
        let isa = if cfg!(feature = "avx512") && std::is_x86_feature_detected!("avx512f") {
            "CPU kernels: AVX-512"
        } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            "CPU kernels: AVX2 + FMA"
        } else {
            "CPU kernels: baseline"
        };
        assert!(v.contains(isa), "{isa}: {v}");
    }
}
