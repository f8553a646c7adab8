//! The binary's allocator (src/main.rs): jemalloc with the options that keep a training step's freed
//! buffers for the next step. Read back through jemalloc's own statistics (`stats_print`, which reports
//! the options in effect), so a lost `#[global_allocator]` or a changed `malloc_conf` fails here.
use std::process::Command;

#[cfg(all(unix, not(target_env = "musl")))]
#[test]
fn the_binary_runs_on_jemalloc_with_the_step_reuse_options() {
    let out = Command::new(env!("CARGO_BIN_EXE_harpe"))
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("harpe runs");
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
