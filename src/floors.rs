//! What a GPU machine must have before a CUDA harpe can run on it, checked before any weight is read: a
//! driver at least as new as the CUDA release the binary was built for, a glibc at least the binary's
//! floor, and a GPU for this rank (`rank_gpu`).
//!
//! Why here and first: the binary links its CUDA release's cudart, cuBLAS and NCCL and embeds PTX of that
//! release's ISA, so an older driver fails somewhere inside the first CUDA call with
//! `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` or a cuBLAS handle error — after a 7B model's weights took minutes
//! to load. One line naming both versions and the build that fits saves that. glibc: a glibc older than
//! the floor stops the dynamic loader before `main` (`GLIBC_2.34 not found`), so the real guard is the shell
//! check of scripts/gpu-check.sh and scripts/slurm-harpe-128k.sh; the check here states the floor where the
//! loader let an older-looking glibc through (a test hook fakes it) and keeps the number in one place.
//!
//! Slurm: a site that binds one GPU per task (`--gpu-bind=single:1`, `--gpus-per-task=1`) shows each rank
//! only its own GPU as device 0, while `LOCAL_RANK` still counts 0..7: a process that sees exactly one
//! device uses it whatever its local rank (`rank_gpu`).
//!
//! Reference: CUDA driver API `cuDriverGetVersion` (1000 x major + 10 x minor), NVIDIA's "CUDA Compatibility"
//! guide (minimum driver per toolkit release, the cuda-compat forward-compatibility package).
use anyhow::{bail, Result};

/// The oldest glibc this binary's dynamic symbols ask for (GLIBC_2.34: `__libc_start_main` of Debian 12's
/// glibc). tests/tools/no_system_libs.rs reads the highest GLIBC_ version of the built binary's symbols and
/// holds it to this number.
pub const GLIBC_FLOOR: (u32, u32) = (2, 34);

/// The CUDA release this binary was built for, as the driver API writes versions (12040 = 12.4): the nvcc
/// that compiled it (build.rs). `None` in a CPU build.
pub fn build_cuda_version() -> Option<u32> {
    option_env!("HARPE_CUDA_BUILD_VERSION").and_then(|v| v.parse().ok())
}

/// "12.4" for 12040.
pub fn cuda_version_text(v: u32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The oldest Linux driver branch that runs a CUDA release (NVIDIA's compatibility table), for messages.
pub fn driver_branch(v: u32) -> &'static str {
    match v {
        0..=12000 => "R525",
        12001..=12010 => "R530",
        12011..=12020 => "R535",
        12021..=12030 => "R545",
        12031..=12040 => "R550",
        12041..=12050 => "R555",
        12051..=12060 => "R560",
        12061..=12080 => "R570",
        12081..=12090 => "R575",
        _ => "R580",
    }
}

/// The versions the check compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    /// the driver's CUDA version (`cuDriverGetVersion`)
    pub driver: u32,
    /// the CUDA release this binary was built for
    pub build: u32,
    /// the running glibc, (major, minor)
    pub glibc: (u32, u32),
}

/// Fail with one line naming both numbers and the fix when the driver is older than the build or glibc
/// is under `GLIBC_FLOOR`.
pub fn check(found: Found) -> Result<()> {
    let Found { driver, build, glibc } = found;
    if driver < build {
        let (d, b) = (cuda_version_text(driver), cuda_version_text(build));
        let fix = if build >= 13000 && driver >= 12040 {
            "use harpe's CUDA 12 build (scripts/install-cuda-toolchain.sh PREFIX 12, README 'Build for GPUs'), \
             or install cuda-compat-13-0 and put its lib directory first on LD_LIBRARY_PATH"
                .to_string()
        } else {
            format!(
                "update the driver to {} or newer, or install the cuda-compat package of CUDA {b} (data-center GPUs) \
                 and put its lib directory first on LD_LIBRARY_PATH",
                driver_branch(build)
            )
        };
        bail!(
            "the CUDA driver supports CUDA {d} ({} class) but this harpe was built for CUDA {b} (needs {} or newer); hint: {fix}",
            driver_branch(driver),
            driver_branch(build)
        );
    }
    if glibc < GLIBC_FLOOR {
        bail!(
            "glibc is {}.{} but this harpe needs glibc {}.{} or newer; hint: run it in a newer image (Ubuntu 22.04, \
             Debian 12, RHEL 9 or later; e.g. a container) or build harpe on the cluster's own OS",
            glibc.0,
            glibc.1,
            GLIBC_FLOOR.0,
            GLIBC_FLOOR.1
        );
    }
    Ok(())
}

/// The running glibc's version (the test hook's when set).
fn glibc_version() -> Result<(u32, u32)> {
    if let Some(v) = crate::testing::hooks().fake_glibc {
        return Ok(v);
    }
    // SAFETY: gnu_get_libc_version returns a static NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) }.to_string_lossy().into_owned();
    parse_glibc(&text).ok_or_else(|| anyhow::anyhow!("cannot read glibc's version {text:?}"))
}

/// "2.36" -> (2, 36).
pub fn parse_glibc(text: &str) -> Option<(u32, u32)> {
    let (a, b) = text.trim().split_once('.')?;
    let b = b.split(|c: char| !c.is_ascii_digit()).next()?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// The driver's CUDA version (`cuDriverGetVersion`; the test hook's when set). `None` in a CPU build
/// without the hook.
fn driver_version() -> Result<Option<u32>> {
    if let Some(v) = crate::testing::hooks().fake_cuda_driver {
        return Ok(Some(v));
    }
    #[cfg(feature = "cuda")]
    {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int and needs no cuInit.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            bail!(
                "cannot read the CUDA driver's version ({r:?}); hint: is an NVIDIA driver installed and libcuda.so.1 \
                 the driver's own (not the link stub of a toolchain directory on LD_LIBRARY_PATH)?"
            );
        }
        Ok(Some(v as u32))
    }
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}

/// The floors of a run on `device`: nothing for the CPU; for CUDA, the driver and glibc against this
/// build. A CPU build checks only when a test hook fakes the versions (it rehearses the order: this comes
/// before any weight is read); otherwise opening the device refuses CUDA with the rebuild hint.
pub fn check_for(device: &crate::device::DeviceSpec) -> Result<()> {
    if *device == crate::device::DeviceSpec::Cpu {
        return Ok(());
    }
    let build = crate::testing::hooks().fake_cuda_build.or_else(build_cuda_version);
    let (Some(build), Some(driver)) = (build, driver_version()?) else { return Ok(()) };
    check(Found { driver, build, glibc: glibc_version()? })
}

/// The CUDA device a rank with `local_rank` uses when `visible` devices are visible to its process: its
/// local rank, or the only device when the launcher bound one GPU to each task.
pub fn pick_gpu(local_rank: usize, visible: usize) -> Result<usize> {
    match visible {
        0 => bail!(
            "this process sees no CUDA device; hint: check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and that the job asked \
             for GPUs (sbatch --gpus-per-node)"
        ),
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => bail!(
            "LOCAL_RANK={local_rank} but this process sees {n} CUDA devices (0..{}); hint: give each node's ranks \
             all of its GPUs (sbatch/srun --gpu-bind=none, as scripts/slurm-harpe-128k.sh does) or exactly one each",
            n - 1
        ),
    }
}

/// The CUDA device this rank opens: `pick_gpu` over the devices the driver shows this process.
pub fn rank_gpu(local_rank: usize) -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        use anyhow::Context;
        cudarc::driver::result::init().context("cuInit failed; hint: check `nvidia-smi` and the driver")?;
        let n = cudarc::driver::result::device::get_count().context("cannot count the CUDA devices")?;
        pick_gpu(local_rank, n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    Ok(local_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(f: Found) -> String {
        format!("{:#}", check(f).unwrap_err())
    }

    #[test]
    fn an_older_driver_is_refused_in_one_line_naming_both_versions_and_the_fix() {
        let e = err(Found { driver: 12020, build: 13000, glibc: (2, 36) });
        assert!(!e.contains('\n'), "{e}");
        assert!(e.contains("CUDA 12.2") && e.contains("CUDA 13.0") && e.contains("R535"), "{e}");
        assert!(e.contains("cuda-compat") && e.contains("update the driver"), "{e}");
        let e = err(Found { driver: 12080, build: 13000, glibc: (2, 36) });
        assert!(e.contains("CUDA 12 build") && e.contains("install-cuda-toolchain.sh PREFIX 12"), "{e}");
        let e = err(Found { driver: 12020, build: 12040, glibc: (2, 36) });
        assert!(e.contains("R550") && e.contains("CUDA 12.4"), "{e}");
    }

    #[test]
    fn a_driver_as_new_as_the_build_or_newer_passes() {
        for (driver, build) in [(12040, 12040), (13000, 12040), (13020, 13000)] {
            check(Found { driver, build, glibc: GLIBC_FLOOR }).unwrap();
        }
    }

    #[test]
    fn an_old_glibc_is_refused_naming_both_versions() {
        let e = err(Found { driver: 13000, build: 13000, glibc: (2, 28) });
        assert!(!e.contains('\n') && e.contains("glibc is 2.28") && e.contains("2.34"), "{e}");
        assert_eq!(parse_glibc("2.36"), Some((2, 36)));
        assert_eq!(parse_glibc("2.28-stable"), Some((2, 28)));
        assert_eq!(parse_glibc("junk"), None);
        // the running glibc is read and at least the floor (the test binary loaded)
        assert!(glibc_version().unwrap() >= GLIBC_FLOOR);
    }

    #[test]
    fn one_visible_device_serves_any_local_rank() {
        assert_eq!(pick_gpu(3, 1).unwrap(), 0);
        assert_eq!(pick_gpu(3, 8).unwrap(), 3);
        assert_eq!(pick_gpu(0, 2).unwrap(), 0);
        let e = format!("{:#}", pick_gpu(3, 2).unwrap_err());
        assert!(e.contains("LOCAL_RANK=3") && e.contains("--gpu-bind=none"), "{e}");
        assert!(format!("{:#}", pick_gpu(0, 0).unwrap_err()).contains("no CUDA device"));
    }

    #[test]
    fn versions_print_as_major_dot_minor() {
        assert_eq!(cuda_version_text(12040), "12.4");
        assert_eq!(cuda_version_text(13000), "13.0");
    }
}
