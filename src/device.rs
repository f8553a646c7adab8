//! Where and in what precision a model runs: `DeviceSpec` (`cpu`, `cuda`, `cuda:N`) parsed once, for
//! `--device` on every command that runs a model and `train.device` in the config; `ComputeDtype`,
//! the one dtype enum of configs (`train.dtype`) and flags (`--dtype`).
//!
//! Reference: PyTorch's device strings (`cuda:1`). The non-obvious decision: a CPU build still
//! parses `cuda` (a recipe for a GPU run can be read, planned and hashed anywhere) and fails only when
//! the device is opened, with a hint to rebuild with `--features cuda`. `init_cpu_runtime` sets candle's
//! elementwise pool to one thread and glibc's reuse of large blocks (see there); `as_pool_worker` makes the
//! calling thread worker 0 of the CPU ops' rayon pool. Not done here: choosing
//! the attention implementation for a device (`model::attention::AttentionImpl::for_device`).
use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Process settings of the CPU path; call first thing in `main`, while the process has one thread.
///
/// 1. `CANDLE_NUM_THREADS=1` unless the user set it. candle 0.11 runs large elementwise ops on its own
///    spinning barrier pool (CANDLE_NUM_THREADS - 1 workers, default: all cores) beside rayon's pool
///    (GEMMs, harpe's ops), so every core gets two busy-waiting threads; on 2 threads, training at
///    T = 256 measured 400 tok/s with the default and 2200-2900 with one pool thread. Elementwise ops then
///    split over rayon's pool when called from one of its threads (`as_pool_worker`; the change in
///    third_party/candle-core/HARPE.md), else run on the calling thread.
/// 2. glibc keeps freed blocks up to 32 MiB for reuse (`M_MMAP_THRESHOLD`, `M_TRIM_THRESHOLD`) instead of
///    returning every activation-sized buffer to the kernel and page-faulting it back in on the next op
///    (15% of a T = 1024 step was page faults; +50% tok/s). Freed blocks are reused, so the peak is the
///    live tensors' plus fragmentation; free memory goes back to the kernel above 256 MiB. Both measured in
///    benches/results/train-cpu-2vcpu.md.
pub fn init_cpu_runtime() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Sound here: called at the top of `main`, while the process has one thread.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// Run `f` on this thread made worker 0 of a rayon pool (as many threads as the global pool would have,
/// `RAYON_NUM_THREADS`), so the CPU ops' parallel loops start from a worker: this thread takes part and
/// the others steal, instead of a thread outside the pool injecting every op and sleeping until the
/// workers wake, finish and wake it (two context switches per op: ~8% of a small CPU step in `perf`,
/// half of it gone with this). This thread, not a pool thread, keeps running the step, so its tensors
/// stay in the main malloc arena: run on a pool thread instead, the same run's peak memory came out
/// bimodal (96 or 106 MiB; tests/stage_train/plan_memory.rs). Results do not depend on it: every op
/// splits its work by size, not by thread. Already a worker (a second run in one process): `f` as is.
/// Used by `harpe train` (one process's rank) and the commands that run a model on the CPU (eval-ppl,
/// eval-loss, generate, eval-niah, eval-tasks: main.rs): eval-ppl of a 0.5M-parameter model spent ~20% of
/// its samples in the scheduler (context switches, `sched_yield`) injecting each small op from outside.
pub fn as_pool_worker<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("harpe-cpu-{i}"))
        .use_current_thread()
        .build()
        .map_err(|e| anyhow!("starting the CPU thread pool: {e}"))?;
    // this thread is the pool's worker 0, so `install` runs `f` right here
    pool.install(f)
}

/// A device as the user names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// CUDA device N (`cuda` is `cuda:0`); needs a build with `--features cuda`.
    Cuda(usize),
}

/// The sentence every "no CUDA here" error ends with.
pub const NO_CUDA_HINT: &str = "hint: this harpe was built without CUDA: rebuild with --features cuda, see README 'Build for GPUs', or use the cpu device";

impl DeviceSpec {
    /// True when this build can open the device at all (CPU always; CUDA only with `--features cuda`).
    pub fn compiled_in(&self) -> bool {
        match self {
            DeviceSpec::Cpu => true,
            DeviceSpec::Cuda(_) => cfg!(feature = "cuda"),
        }
    }

    /// Open the device; `what` names the flag or config field for the error (e.g. `--device`).
    pub fn open(&self, what: &str) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) if !self.compiled_in() => {
                bail!("{what} = \"{self}\" asks for CUDA device {n}\n{NO_CUDA_HINT}")
            }
            DeviceSpec::Cuda(n) => {
                let dev = Device::new_cuda(*n).map_err(|e| {
                    anyhow!("{what} = \"{self}\": cannot open CUDA device {n}: {e}\nhint: check `nvidia-smi`, CUDA_VISIBLE_DEVICES and LD_LIBRARY_PATH (README 'Build for GPUs')")
                })?;
                keep_freed_device_memory(&dev)?;
                Ok(dev)
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(0) => write!(f, "cuda"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<DeviceSpec, String> {
        let bad = || format!("unknown device `{s}` (expected cpu, cuda or cuda:N)");
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<DeviceSpec, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Memory of a CUDA device when a run starts: what the plan check compares against.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceMemory {
    /// the driver's device name, e.g. "NVIDIA H200"
    pub name: String,
    /// bytes free now (other processes' allocations already taken out)
    pub free: u64,
    /// bytes in total
    pub total: u64,
}

/// Free and total memory of the CUDA device `spec` names (`None` for the CPU, which the plan sizes
/// from /proc). Asks the driver through the device's primary context: no candle device, stream or
/// cuBLAS handle is made for the query (the run opens its device later). `what` names the config
/// field for errors; a CPU build fails here as `DeviceSpec::open` does, with the rebuild hint.
pub fn device_memory(spec: &DeviceSpec, what: &str) -> Result<Option<DeviceMemory>> {
    let DeviceSpec::Cuda(n) = *spec else { return Ok(None) };
    #[cfg(feature = "cuda")]
    {
        let ctx = cudarc::driver::CudaContext::new(n).map_err(|e| {
            anyhow!("{what} = \"{spec}\": cannot open CUDA device {n}: {e}\nhint: check `nvidia-smi`, CUDA_VISIBLE_DEVICES and LD_LIBRARY_PATH (README 'Build for GPUs')")
        })?;
        let name = ctx.name().map_err(|e| anyhow!("cannot read the name of CUDA device {n}: {e}"))?;
        let (free, total) =
            ctx.mem_get_info().map_err(|e| anyhow!("cannot query the memory of CUDA device {n} ({name}): {e}"))?;
        Ok(Some(DeviceMemory { name, free: free as u64, total: total as u64 }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = n;
        spec.open(what)?; // refuses CUDA with the rebuild hint
        bail!("{what} = \"{spec}\": no CUDA in this build\n{NO_CUDA_HINT}")
    }
}

/// Peak device memory of a step: candle/cudarc allocate with `cuMemAllocAsync` from the device's
/// current memory pool, whose `USED_MEM_HIGH` attribute is the high-water mark of bytes handed out and
/// `RESERVED_MEM_HIGH` that of bytes the pool held from the driver (handed out plus its free fragments:
/// what another allocation on the device, NCCL's for one, could not have). `reset_device_peak` zeroes
/// both (at a step's start, on every rank), `device_peak_bytes` / `device_reserved_peak_bytes` read them;
/// no-ops / `None` on the CPU (whose peak comes from /proc) and when the context has no stream-ordered pool.
/// Reference: CUDA driver API, "Stream Ordered Memory Allocator" (cuMemPoolGetAttribute).
pub fn reset_device_peak(dev: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        if let Some(pool) = cuda_pool(d)? {
            use cudarc::driver::sys::CUmemPool_attribute::{
                CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            };
            for attr in [CU_MEMPOOL_ATTR_USED_MEM_HIGH, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH] {
                let mut zero: u64 = 0;
                // SAFETY: `pool` is the device's current pool; both high-water marks take a cuuint64_t (only 0 may be set).
                unsafe { cudarc::driver::result::mem_pool::set_attribute(pool, attr, (&mut zero as *mut u64).cast()) }
                    .map_err(|e| anyhow!("cannot reset the device memory pool's peak ({attr:?}): {e}"))?;
            }
        }
    }
    let _ = dev;
    Ok(())
}

/// The device's peak allocated bytes since `reset_device_peak` (see there); `None` on the CPU.
pub fn device_peak_bytes(dev: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    {
        pool_attribute(dev, cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = dev;
        Ok(None)
    }
}

/// The device's peak reserved bytes (the pool's footprint) since `reset_device_peak`; `None` on the CPU.
pub fn device_reserved_peak_bytes(dev: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    {
        pool_attribute(dev, cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = dev;
        Ok(None)
    }
}

/// One u64 attribute of the device's memory pool; `None` off CUDA or without a pool.
#[cfg(feature = "cuda")]
fn pool_attribute(dev: &Device, attr: cudarc::driver::sys::CUmemPool_attribute) -> Result<Option<u64>> {
    let Device::Cuda(d) = dev else { return Ok(None) };
    let Some(pool) = cuda_pool(d)? else { return Ok(None) };
    let mut v: u64 = 0;
    // SAFETY: `pool` is the device's current pool; the memory attributes are written as one cuuint64_t.
    unsafe { cudarc::driver::result::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast()) }
        .map_err(|e| anyhow!("cannot read the device memory pool's {attr:?}: {e}"))?;
    Ok(Some(v))
}

/// Keep the memory a CUDA device's pool gets back (a freed tensor) mapped for the next allocation: set the
/// pool's release threshold to "never" once, right after the device opens. Why: candle and cudarc allocate
/// with `cuMemAllocAsync` from the device's default pool, whose release threshold is 0 — every
/// synchronisation then unmaps all the freed memory, and the next step maps it again (a map/unmap of
/// gigabytes per step, and the step's peak-sized blocks fragment anew each time). With the threshold at
/// u64::MAX the pool holds what a step freed, as PyTorch's caching allocator does; `release_device_memory`
/// still hands it back on purpose (`cuMemPoolTrimTo` ignores the threshold). A no-op on the CPU and without
/// a pool. Reference: CUDA driver API, `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
pub fn keep_freed_device_memory(dev: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        if let Some(pool) = cuda_pool(d)? {
            let mut never: u64 = u64::MAX;
            // SAFETY: `pool` is the device's current pool; RELEASE_THRESHOLD takes a cuuint64_t.
            unsafe {
                cudarc::driver::result::mem_pool::set_attribute(
                    pool,
                    cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut never as *mut u64).cast(),
                )
            }
            .map_err(|e| anyhow!("cannot set the device memory pool's release threshold: {e}\nhint: a driver without stream-ordered allocation (CUDA < 11.2) is not supported"))?;
        }
    }
    let _ = dev;
    Ok(())
}

/// A 1-D tensor of `n` zeros on `dev`; for n = 0 an empty view of a 1-element buffer. Why: on CUDA a
/// zero-length tensor is a `cuMemAllocAsync` of 0 bytes, which the driver may refuse (`cuMemAlloc` documents
/// CUDA_ERROR_INVALID_VALUE for 0 bytes); ZeRO's ragged collectives make such tensors on every rank that
/// owns none of a layer.
pub fn zeros_1d(n: usize, dtype: DType, dev: &Device) -> Result<candle_core::Tensor> {
    use candle_core::Tensor;
    if n == 0 {
        return Ok(Tensor::zeros(1, dtype, dev)?.narrow(0, 0, 0)?);
    }
    Ok(Tensor::zeros(n, dtype, dev)?)
}

/// Hand the device memory freed so far back to the driver: synchronise, then trim the memory pool to
/// what is in use (`cuMemPoolTrimTo`), so that `device_memory` and another process (the PyTorch
/// comparison of `harpe bench model`) see it free. A no-op on the CPU and without a pool.
pub fn release_device_memory(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        if let Some(pool) = cuda_pool(d)? {
            // SAFETY: `pool` is the device's current pool, valid while the context lives.
            unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) }
                .map_err(|e| anyhow!("cannot trim the device memory pool: {e}"))?;
        }
    }
    Ok(())
}

/// The current memory pool of a CUDA device, `None` when its context allocates without one.
#[cfg(feature = "cuda")]
fn cuda_pool(d: &candle_core::CudaDevice) -> Result<Option<cudarc::driver::sys::CUmemoryPool>> {
    let stream = d.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    ctx.bind_to_thread().map_err(|e| anyhow!("cannot bind the CUDA context: {e}"))?;
    let mut pool = std::mem::MaybeUninit::uninit();
    // SAFETY: `cu_device` is this context's device; the driver writes one pool handle.
    unsafe { cudarc::driver::sys::cuDeviceGetMemPool(pool.as_mut_ptr(), ctx.cu_device()) }
        .result()
        .map_err(|e| anyhow!("cannot get the CUDA device's memory pool: {e}"))?;
    // SAFETY: written by the successful call above.
    Ok(Some(unsafe { pool.assume_init() }))
}

/// Compute dtype of weights and activations (training keeps master weights and moments in f32;
/// log-softmax and reductions are f32 everywhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    #[default]
    Bf16,
    F32,
    F16,
}

impl ComputeDtype {
    /// The candle dtype.
    pub fn dtype(self) -> DType {
        match self {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::BF16,
            ComputeDtype::F16 => DType::F16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The retry every CUDA allocation of candle's backend goes through (third_party/candle-core.patch), with
    /// a failing allocator: an out-of-memory failure trims once and retries once; a second failure, a failed
    /// trim and any other error come back as they are.
    #[test]
    fn an_allocation_out_of_memory_is_retried_once_after_a_trim() {
        use candle_core::utils::retry_once_after_trim;
        use std::cell::Cell;
        #[derive(Debug, PartialEq)]
        enum E {
            Oom,
            Other,
            TrimFailed,
        }
        let run = |results: Vec<Result<u32, E>>, trim_ok: bool| {
            let (calls, trims) = (Cell::new(0), Cell::new(0));
            let mut results = results.into_iter();
            let r = retry_once_after_trim(
                || {
                    calls.set(calls.get() + 1);
                    results.next().expect("allocator called more often than the test planned")
                },
                |e| *e == E::Oom,
                || {
                    trims.set(trims.get() + 1);
                    if trim_ok {
                        Ok(())
                    } else {
                        Err(E::TrimFailed)
                    }
                },
            );
            (r, calls.get(), trims.get())
        };
        assert_eq!(run(vec![Ok(7)], true), (Ok(7), 1, 0));
        assert_eq!(run(vec![Err(E::Oom), Ok(7)], true), (Ok(7), 2, 1));
        assert_eq!(run(vec![Err(E::Oom), Err(E::Oom)], true), (Err(E::Oom), 2, 1));
        assert_eq!(run(vec![Err(E::Other)], true), (Err(E::Other), 1, 0));
        assert_eq!(run(vec![Err(E::Oom)], false), (Err(E::TrimFailed), 1, 1));
    }

    #[test]
    fn parse_print_round_trip() {
        for (s, d, back) in [
            ("cpu", DeviceSpec::Cpu, "cpu"),
            ("cuda", DeviceSpec::Cuda(0), "cuda"),
            ("cuda:0", DeviceSpec::Cuda(0), "cuda"),
            ("CUDA:3", DeviceSpec::Cuda(3), "cuda:3"),
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap(), d);
            assert_eq!(d.to_string(), back);
        }
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn zeros_1d_of_zero_length_is_an_empty_view() {
        let z = zeros_1d(0, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(z.dims(), &[0]);
        assert_eq!(z.to_vec1::<f32>().unwrap(), Vec::<f32>::new());
        assert_eq!(zeros_1d(3, DType::BF16, &Device::Cpu).unwrap().dims(), &[3]);
    }

    #[test]
    fn cpu_opens_and_cuda_needs_the_feature() {
        assert!(DeviceSpec::Cpu.open("--device").unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            let e = DeviceSpec::Cuda(1).open("--device").unwrap_err().to_string();
            assert!(e.starts_with("--device = \"cuda:1\" asks for CUDA device 1"), "{e}");
            assert!(e.contains("hint: this harpe was built without CUDA: rebuild with --features cuda"), "{e}");
        }
    }
}
