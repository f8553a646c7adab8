//! The host emulation's measuring (kernels/emu.h "Measuring"): per launch of a kernel, the global memory
//! traffic in 32-byte sectors beside the bytes the lanes asked for, shared-memory wavefronts and bank
//! conflicts per warp instruction (ld/st.shared, ldmatrix, the shared side of copy16 and cp.async; 32 banks of
//! 4 bytes), barriers, atomics, mma instructions and cp.async copies — and the toy kernels of
//! kernels/emu_toys.cu whose counts are known by hand (tests/stage_model/emu_profile.rs).
//!
//! Reference: CUDA C++ Best Practices Guide (coalescing into 32-byte sectors, shared-memory banks), the PTX
//! ISA (cp.async commit/wait groups); Nsight Compute's metric names for the same counts.
//! The non-obvious decision: a warp instruction is recognised on the host by (call site, the lane's n-th
//! execution of it), because the emulated lanes are separate threads; that is exact while a warp runs a
//! measured site in step (the kernels' main loops and the toys) and approximate where lanes diverge around
//! it. Only the accessors the kernels route through the emulator (`gld`/`gst`/`sld`/`sst`, `copy16`,
//! `cp_async16`, `ldmatrix_*`) are seen; a plain `x[i]` in a kernel is not counted.
//! Measuring is process-wide (one switch, one table by kernel name): callers serialise around it.
//! Does not: time anything, model caches (every sector counts, even one read twice), or count the FMA tiles'
//! plain shared-memory arrays.
use candle_core::{bail, Result};
use serde::Serialize;
use std::ffi::CString;

/// One kernel's counts, summed over its measured launches (kernels/emu.h `emu::Profile`, same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Profile {
    pub launches: u64,
    /// warp-level global load/store instructions (copy16, cp.async and gld/gst sites)
    pub global_instr: u64,
    /// distinct 32-byte sectors those instructions touched
    pub global_sectors: u64,
    /// bytes the lanes asked for
    pub useful_bytes: u64,
    /// warp-level shared-memory instructions
    pub shared_instr: u64,
    /// wavefronts they took (one per 128-byte phase when conflict-free)
    pub shared_wavefronts: u64,
    /// wavefronts beyond one per phase
    pub bank_conflicts: u64,
    /// __syncthreads per block, summed over blocks
    pub barriers: u64,
    /// atomic operations (one per lane)
    pub atomics: u64,
    /// mma.sync instructions (one per warp)
    pub mma: u64,
    /// cp.async copies (one per lane)
    pub cp_async: u64,
}

impl Profile {
    /// Useful bytes over the bytes of the sectors moved (1.0: perfectly coalesced).
    pub fn sector_efficiency(&self) -> f64 {
        if self.global_sectors == 0 {
            1.0
        } else {
            self.useful_bytes as f64 / (32.0 * self.global_sectors as f64)
        }
    }
}

mod ffi {
    use super::Profile;
    #[link(name = "harpe_kernels_emu", kind = "static")]
    extern "C" {
        pub fn emu_profile_enable(on: i32);
        pub fn emu_profile_reset();
        pub fn emu_profile_get(name: *const std::os::raw::c_char, out: *mut Profile) -> i32;
        pub fn emu_toy_copy(gx: u32, bx: u32, smem: usize, x: *const f32, y: *mut f32, n: u32, stride: u32);
        pub fn emu_toy_shared_column(gx: u32, bx: u32, smem: usize, out: *mut f32);
        pub fn emu_toy_shared_column_padded(gx: u32, bx: u32, smem: usize, out: *mut f32);
        pub fn emu_toy_cp_async(gx: u32, bx: u32, smem: usize, x: *const f32, y: *mut f32, early: i32);
    }
}

/// Turn measuring on or off for every later launch (off by default: it slows the emulator down).
pub fn enable(on: bool) {
    // SAFETY: sets a flag read under the launch lock.
    unsafe { ffi::emu_profile_enable(on as i32) }
}

/// Forget every kernel's counts.
pub fn reset() {
    // SAFETY: clears the table under the launch lock.
    unsafe { ffi::emu_profile_reset() }
}

/// The counts of kernel `name` (its CUDA name, e.g. `attn_fwd_tc_bf16_d128`) since the last `reset`, or None
/// if it has not run while measuring.
pub fn get(name: &str) -> Option<Profile> {
    let c = CString::new(name).ok()?;
    let mut p = Profile::default();
    // SAFETY: `c` is NUL-terminated; `p` has the C struct's layout (repr(C), 11 u64).
    (unsafe { ffi::emu_profile_get(c.as_ptr(), &mut p) } == 1).then_some(p)
}

/// A slice of `n` elements starting on a 128-byte boundary inside `buf` (so the toys' sector counts are exact).
fn aligned<T>(buf: &mut [T], n: usize) -> Result<&mut [T]> {
    let skip = buf.as_ptr().align_offset(128);
    if skip + n > buf.len() {
        bail!("emulated toy: buffer of {} elements has no 128-byte aligned run of {n}", buf.len());
    }
    Ok(&mut buf[skip..skip + n])
}

/// A copy of a slice that starts on a 128-byte boundary, as a GPU allocation does (cudaMalloc: 256 bytes).
/// Sectors are counted by address, and a heap `Vec` is only 16-byte aligned: a kernel input 16 bytes past a
/// sector boundary makes every 512-byte warp copy of whole rows touch 17 sectors instead of 16 (efficiency
/// 16/17), whatever the kernel does. Measured inputs go through this so their counts do not depend on where
/// the allocator put them.
pub struct Aligned<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    pub fn new(src: &[T]) -> Self {
        let len = src.len();
        let mut buf = vec![T::default(); len + 128 / std::mem::size_of::<T>().max(1)];
        let start = buf.as_ptr().align_offset(128);
        // align_offset is at most 128 / size - 1 for a power-of-two size (usize::MAX if unreachable)
        assert!(
            start <= buf.len() - len,
            "no 128-byte boundary in a Vec of {}-byte elements",
            std::mem::size_of::<T>()
        );
        buf[start..start + len].copy_from_slice(src);
        Aligned { buf, start, len }
    }
}

impl<T> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// kernels/emu_toys.cu `toy_copy` on one warp: y[i] = x[i * stride] for i < 32, x 128-byte aligned.
pub fn toy_copy(x: &[f32], stride: usize) -> Result<Vec<f32>> {
    let need = 31 * stride + 1;
    if x.len() < need {
        bail!("emulated toy: x has {} floats, stride {stride} needs {need}", x.len());
    }
    let mut xs = vec![0f32; need + 32];
    let xa = aligned(&mut xs, need)?;
    xa.copy_from_slice(&x[..need]);
    let mut ys = vec![0f32; 64];
    let ya = aligned(&mut ys, 32)?;
    // SAFETY: x holds 31 * stride + 1 floats, y 32; one block of 32 threads.
    unsafe { ffi::emu_toy_copy(1, 32, 0, xa.as_ptr(), ya.as_mut_ptr(), 32, stride as u32) };
    Ok(ya.to_vec())
}

/// `toy_shared_column` (or its padded twin): tile[j][lane] = 32 j + lane, then lane reads tile[lane][0].
pub fn toy_shared_column(padded: bool) -> Vec<f32> {
    let mut out = vec![0f32; 32];
    // SAFETY: out holds the 32 floats the one warp writes.
    unsafe {
        if padded {
            ffi::emu_toy_shared_column_padded(1, 32, 0, out.as_mut_ptr())
        } else {
            ffi::emu_toy_shared_column(1, 32, 0, out.as_mut_ptr())
        }
    };
    out
}

/// `toy_cp_async`: 256 floats through shared memory in two cp.async groups; returns what the lanes read
/// after wait_group 1 (first 256) and after wait_group 0 (last 256) — or, `early`, before any wait.
pub fn toy_cp_async(x: &[f32], early: bool) -> Result<Vec<f32>> {
    if x.len() != 256 {
        bail!("emulated toy: x has {} floats, expected 256", x.len());
    }
    let mut xs = vec![0f32; 256 + 32];
    let xa = aligned(&mut xs, 256)?;
    xa.copy_from_slice(x);
    let mut y = vec![0f32; 512];
    // SAFETY: x holds 256 floats (16-byte aligned), y 512; one block of 32 threads.
    unsafe { ffi::emu_toy_cp_async(1, 32, 0, xa.as_ptr(), y.as_mut_ptr(), early as i32) };
    Ok(y)
}
