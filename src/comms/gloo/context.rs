//! One Gloo context through the C interface of native/gloo_shim.cc: the shim's declarations, its error
//! convention, the rendezvous store it calls back into (a TCPStore client with the join's deadline), and
//! the collectives on a connected context. Apart from `gloo.rs`, which decides what runs where and when;
//! everything `unsafe` about Gloo is here.
use crate::launch::store::StoreClient;
use anyhow::{bail, Result};
use candle_core::DType;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::{Duration, Instant};

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    /// `hg_ctx`: one connected Gloo context.
    #[repr(C)]
    pub struct HgCtx {
        _opaque: [u8; 0],
    }

    /// `hg_store`: the rendezvous store, implemented here.
    #[repr(C)]
    pub struct HgStore {
        pub ud: *mut c_void,
        pub set: extern "C" fn(*mut c_void, *const c_char, *const c_char, usize) -> c_int,
        pub get: extern "C" fn(*mut c_void, *const c_char, *mut *const c_char, *mut usize) -> c_int,
        pub err: extern "C" fn(*mut c_void) -> *const c_char,
    }

    #[link(name = "harpe_gloo_shim", kind = "static")]
    unsafe extern "C" {
        pub fn hg_connect(
            rank: c_int,
            size: c_int,
            hostname: *const c_char,
            prefix: *const c_char,
            store: *const HgStore,
            timeout_ms: i64,
            err: *mut c_char,
            errlen: usize,
        ) -> *mut HgCtx;
        pub fn hg_free(c: *mut HgCtx);
        pub fn hg_allreduce(
            c: *mut HgCtx,
            dtype: c_int,
            buf: *mut c_void,
            n: usize,
            tag: u32,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        pub fn hg_reduce(
            c: *mut HgCtx,
            dtype: c_int,
            input: *const c_void,
            out: *mut c_void,
            n: usize,
            root: c_int,
            tag: u32,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        pub fn hg_allgatherv(
            c: *mut HgCtx,
            input: *const c_void,
            out: *mut c_void,
            bytes: *const usize,
            tag: u32,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        pub fn hg_alltoall(
            c: *mut HgCtx,
            input: *const c_void,
            out: *mut c_void,
            bytes: usize,
            tag: u32,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        pub fn hg_broadcast(
            c: *mut HgCtx,
            buf: *mut c_void,
            bytes: usize,
            root: c_int,
            tag: u32,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        pub fn hg_barrier(c: *mut HgCtx, tag: u32, err: *mut c_char, errlen: usize) -> c_int;
    }
}

/// Gloo's element type codes (`hg_allreduce`, `hg_reduce`).
const F32: c_int = 0;
const F64: c_int = 1;

/// Run one shim call; a non-zero return becomes an error with the shim's message.
fn shim(what: &str, f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<()> {
    let mut err = vec![0 as c_char; 2048];
    if f(err.as_mut_ptr(), err.len()) != 0 {
        // SAFETY: the shim writes a NUL-terminated message into `err` (at most its length).
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        bail!("{what}: {msg}");
    }
    Ok(())
}

/// The rendezvous store as the shim sees it: a TCPStore client, the deadline of the whole join, and
/// the last value read (the shim copies it before the next call).
pub(super) struct StoreAdapter {
    pub(super) client: StoreClient,
    pub(super) deadline: Instant,
    pub(super) last: Vec<u8>,
    pub(super) err: CString,
}

impl StoreAdapter {
    fn fail(&mut self, e: String) -> c_int {
        self.err = CString::new(e.replace('\0', " ")).unwrap_or_default();
        -1
    }
}

extern "C" fn store_set(ud: *mut c_void, key: *const c_char, data: *const c_char, len: usize) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `ud` is the `StoreAdapter` `GlooComm::connect` passed with this table; key is
        // NUL-terminated and data holds `len` bytes (the shim's std::string and std::vector).
        let a = unsafe { &mut *(ud as *mut StoreAdapter) };
        let key = unsafe { CStr::from_ptr(key) }.to_string_lossy().into_owned();
        let data = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(data as *const u8, len) } };
        match a.client.set(&key, data) {
            Ok(()) => 0,
            Err(e) => a.fail(format!("{e:#}")),
        }
    }))
    .unwrap_or(-1)
}

extern "C" fn store_get(ud: *mut c_void, key: *const c_char, out: *mut *const c_char, len: *mut usize) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: as in `store_set`; `out` and `len` are the shim's locals.
        let a = unsafe { &mut *(ud as *mut StoreAdapter) };
        let key = unsafe { CStr::from_ptr(key) }.to_string_lossy().into_owned();
        match a.client.wait_get(&key, a.deadline) {
            Ok(Some(v)) => {
                a.last = v;
                unsafe {
                    *out = a.last.as_ptr() as *const c_char;
                    *len = a.last.len();
                }
                0
            }
            Ok(None) => a.fail(format!(
                "no value for {key} within the join's timeout (a rank never connected)\nhint: every rank of the \
                 group must start; raise dist.timeout_s for slow starts"
            )),
            Err(e) => a.fail(format!("{e:#}")),
        }
    }))
    .unwrap_or(-1)
}

extern "C" fn store_err(ud: *mut c_void) -> *const c_char {
    // SAFETY: as in `store_set`.
    let a = unsafe { &*(ud as *const StoreAdapter) };
    a.err.as_ptr()
}

/// One connected Gloo context, freed on drop.
pub(super) struct Ctx(*mut ffi::HgCtx);

// SAFETY: a context is used by one thread at a time (the communication thread owns it after `join`).
unsafe impl Send for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: a live context from hg_connect, freed once.
        unsafe { ffi::hg_free(self.0) }
    }
}

impl Ctx {
    /// Join the group of `size` ranks as `rank` through `store`, under the key prefix `prefix`; this
    /// rank's pairs listen on `host`.
    pub(super) fn connect(
        rank: usize,
        size: usize,
        host: &str,
        prefix: &str,
        store: &mut StoreAdapter,
        timeout: Duration,
    ) -> Result<Ctx> {
        let table = ffi::HgStore {
            ud: store as *mut StoreAdapter as *mut c_void,
            set: store_set,
            get: store_get,
            err: store_err,
        };
        let (host_c, prefix_c) = (CString::new(host)?, CString::new(prefix)?);
        let mut p = std::ptr::null_mut();
        shim(&format!("rank {rank}: connecting to the {size} ranks of the Gloo group"), |e, n| {
            // SAFETY: every pointer lives across the call; the store table's `ud` is `store`.
            p = unsafe {
                ffi::hg_connect(
                    rank as c_int,
                    size as c_int,
                    host_c.as_ptr(),
                    prefix_c.as_ptr(),
                    &table,
                    timeout.as_millis() as i64,
                    e,
                    n,
                )
            };
            if p.is_null() {
                -1
            } else {
                0
            }
        })?;
        Ok(Ctx(p))
    }

    /// Sum `v` over the group in place.
    pub(super) fn all_reduce<T: GlooSum>(&self, v: &mut [T], tag: u32, what: &str) -> Result<()> {
        if v.is_empty() {
            return Ok(());
        }
        // SAFETY: `v` holds `len` elements of the type the code names.
        shim(what, |e, n| unsafe {
            ffi::hg_allreduce(self.0, T::CODE, v.as_mut_ptr() as *mut c_void, v.len(), tag, e, n)
        })
    }

    /// The sum over the group of `input` at `root` into `out` (ignored elsewhere).
    pub(super) fn reduce(&self, input: &[f32], out: &mut [f32], root: usize, tag: u32, what: &str) -> Result<()> {
        // SAFETY: input and out hold `input.len()` f32 each (out only at the root, checked by the caller).
        shim(what, |e, n| unsafe {
            ffi::hg_reduce(
                self.0,
                F32,
                input.as_ptr() as *const c_void,
                out.as_mut_ptr() as *mut c_void,
                input.len(),
                root as c_int,
                tag,
                e,
                n,
            )
        })
    }

    /// Every rank's `input` bytes (`bytes[r]` from rank r) concatenated into `out`.
    pub(super) fn all_gather_v(
        &self,
        input: &[u8],
        out: &mut [u8],
        bytes: &[usize],
        tag: u32,
        what: &str,
    ) -> Result<()> {
        // SAFETY: `out` holds sum(bytes), `input` bytes[rank] (checked by the caller), `bytes` one per rank.
        shim(what, |e, n| unsafe {
            ffi::hg_allgatherv(
                self.0,
                input.as_ptr() as *const c_void,
                out.as_mut_ptr() as *mut c_void,
                bytes.as_ptr(),
                tag,
                e,
                n,
            )
        })
    }

    /// Equal-chunk all-to-all of bytes.
    pub(super) fn all_to_all(&self, input: &[u8], out: &mut [u8], tag: u32, what: &str) -> Result<()> {
        // SAFETY: both hold `input.len()` bytes (checked by the caller).
        shim(what, |e, n| unsafe {
            ffi::hg_alltoall(
                self.0,
                input.as_ptr() as *const c_void,
                out.as_mut_ptr() as *mut c_void,
                input.len(),
                tag,
                e,
                n,
            )
        })
    }

    /// `buf` at `root` copied into `buf` everywhere.
    pub(super) fn broadcast(&self, buf: &mut [u8], root: usize, tag: u32, what: &str) -> Result<()> {
        // SAFETY: `buf` holds its length in bytes on every rank (the same length: the caller's contract).
        shim(what, |e, n| unsafe {
            ffi::hg_broadcast(self.0, buf.as_mut_ptr() as *mut c_void, buf.len(), root as c_int, tag, e, n)
        })
    }

    pub(super) fn barrier(&self, tag: u32, what: &str) -> Result<()> {
        // SAFETY: a live context.
        shim(what, |e, n| unsafe { ffi::hg_barrier(self.0, tag, e, n) })
    }
}

/// Element types Gloo sums.
pub trait GlooSum: Copy + Send + 'static {
    /// the shim's element type code
    const CODE: c_int;
    /// the dtype the collective signature names
    const DTYPE: DType;
}
impl GlooSum for f32 {
    const CODE: c_int = F32;
    const DTYPE: DType = DType::F32;
}
impl GlooSum for f64 {
    const CODE: c_int = F64;
    const DTYPE: DType = DType::F64;
}
