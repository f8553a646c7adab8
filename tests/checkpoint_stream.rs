//! Streamed safetensors writes (`model::weights::write_safetensors`, the optimizer shard and the HF
//! model files of a checkpoint): the same bytes as `safetensors::serialize` of the whole buffers, for
//! sizes that are not multiples of the piece, from host and device buffers; and a write holds one
//! piece in host memory, not the tensor (a counting allocator measures the peak).
use candle_core::{DType, Device, Tensor};
use harpe::comms::zero::{ShardMap, Split};
use harpe::flatbuf::{FlatBuf, Placement};
use harpe::model::layout::ParamLayout;
use harpe::model::weights::{write_safetensors, StreamSrc, TensorBytes};
use harpe::optim::adamw::{AdamW, AdamWHyper};
use harpe::train::checkpoint::write_optim_shard;
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
// SAFETY: forwards to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Ordering::SeqCst) + l.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
        System.dealloc(p, l)
    }
}
#[global_allocator]
static COUNTING: Counting = Counting;
/// one test at a time, so the peak is this test's
static ONE: Mutex<()> = Mutex::new(());

fn values(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37 + k).sin() * 3.0).collect()
}

fn meta(s: &str) -> Option<HashMap<String, String>> {
    Some([("info".to_string(), s.to_string())].into())
}

#[test]
fn streamed_files_equal_serialize_of_the_whole_buffers() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let d = tempfile::tempdir().unwrap();
    let dev = Placement::Device(Device::Cpu);
    for n in [1usize, 7, 1000, 4099] {
        let host = FlatBuf::from_vec(values(n, 0.5));
        let on_dev = FlatBuf::from_vec(values(n + 3, 1.5)).placed(&dev).unwrap();
        let w = Tensor::from_vec(values(3 * n, 2.5), (3, n), &Device::Cpu).unwrap();
        let (wb, wd) = (w.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::F64).unwrap());
        let srcs = [
            ("z.flat".to_string(), StreamSrc::Flat(&host)),
            ("a.flat".to_string(), StreamSrc::Flat(&on_dev)),
            ("w.bf16".to_string(), StreamSrc::Tensor(&wb)),
            ("w.f32".to_string(), StreamSrc::Tensor(&w)),
            ("w.f64".to_string(), StreamSrc::Tensor(&wd)),
        ];
        let whole = [
            ("z.flat", TensorBytes::from_f32(host.host().unwrap())),
            ("a.flat", TensorBytes::from_f32(&on_dev.to_host().unwrap())),
            ("w.bf16", TensorBytes::from_tensor(&wb).unwrap()),
            ("w.f32", TensorBytes::from_tensor(&w).unwrap()),
            ("w.f64", TensorBytes::from_tensor(&wd).unwrap()),
        ];
        let want = safetensors::serialize(whole.iter().map(|(k, v)| (k.to_string(), v)), meta("x")).unwrap();
        for chunk in [4usize, 24, 1000, 1 << 20] {
            let p = d.path().join(format!("t{n}-{chunk}.safetensors"));
            let largest = write_safetensors(&p, &srcs, meta("x"), chunk).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), want, "{n} elements, pieces of {chunk} bytes");
            assert!(largest <= chunk.max(8), "a piece of {largest} bytes with pieces of {chunk}");
        }
    }
}

/// The optimizer shard keeps format 1's bytes: `serialize` of master, m, v with one JSON metadata entry.
#[test]
fn optimizer_shard_bytes_are_format_1_from_either_placement() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let d = tempfile::tempdir().unwrap();
    let l = ParamLayout::new(&[("w".into(), vec![37, 11]), ("model.norm.weight".into(), vec![13])]);
    let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.0, wd_norm: 0.0 };
    let map = ShardMap::new(&l, 1, Split::Slices);
    let p0 = FlatBuf::from_vec(values(l.total, 0.1));
    let g = FlatBuf::from_vec(values(l.total, 0.7));
    let dev = Placement::Device(Device::Cpu);
    for p in [Placement::Host, dev] {
        let mut o = AdamW::new(&l, &p0.try_clone().unwrap().placed(&p).unwrap(), &map, 0, hp).unwrap();
        for _ in 0..2 {
            o.step(&g.try_clone().unwrap().placed(&p).unwrap(), 0.01).unwrap();
        }
        let f = d.path().join("optim.safetensors");
        write_optim_shard(&f, &o, 100).unwrap();
        let views = [("master", o.master()), ("m", o.m()), ("v", o.v())]
            .map(|(k, b)| (k.to_string(), TensorBytes::from_f32(&b.to_host().unwrap())));
        let info = serde_json::json!({"format": 1, "t": 2, "range_start": 0, "range_end": l.total});
        let meta = Some([("harpe_optim".to_string(), info.to_string())].into());
        let want = safetensors::serialize(views.iter().map(|(k, v)| (k.clone(), v)), meta).unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), want, "{p:?}");
    }
}

/// Writing two 16 MiB buffers (a device-placed flat buffer and a tensor) in 256 KiB pieces raises the
/// live heap by a few pieces, never by a buffer (a whole-buffer copy would add 16 MiB or more).
#[test]
fn a_streamed_write_holds_one_piece_not_the_buffer() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let d = tempfile::tempdir().unwrap();
    let n = 4 << 20; // 16 MiB of f32
    let flat = FlatBuf::from_vec(values(n, 0.0)).placed(&Placement::Device(Device::Cpu)).unwrap();
    let w = Tensor::from_vec(values(n, 1.0), (1024, n / 1024), &Device::Cpu).unwrap();
    let srcs = [("flat".to_string(), StreamSrc::Flat(&flat)), ("w".to_string(), StreamSrc::Tensor(&w))];
    let chunk = 256 << 10;
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let largest = write_safetensors(&d.path().join("big.safetensors"), &srcs, None, chunk).unwrap();
    let extra = PEAK.load(Ordering::SeqCst) - base;
    assert_eq!(largest, chunk);
    assert!(extra < 4 * chunk, "the write raised the heap by {extra} bytes (pieces of {chunk})");
    let len = std::fs::metadata(d.path().join("big.safetensors")).unwrap().len() as usize;
    assert!((8 * n..8 * n + 1024).contains(&len), "{len} bytes for two buffers of {n} floats");
}
