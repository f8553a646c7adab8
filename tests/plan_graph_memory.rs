//! The plan's activation accounting (`train::plan::activations`, the per-op `layer_graph` shared by the
//! CPU and GPU plans) against the bytes the allocator really holds while one micro-batch runs forward and
//! backward (`train::forward_backward`, checkpointing every layer as the 128K recipe) in bf16 on the CPU,
//! with the real vocabulary (32000) for the loss. The measurement is allocator-level (this binary's
//! global allocator counts live bytes and their peak), so it is exact and repeatable, unlike resident
//! memory; the peak over the step minus the bytes live before it is compared with the plan's
//! `inputs + max(recompute, loss)`. The CPU bf16 path differs from CUDA only where `layer_graph` says:
//! RoPE's and attention's f32 copies, and attention's own backward (a term of its own on CUDA).
//! One process per measurement scale: this file. The 7B-layer shapes (hidden 4096, 32 heads, 11008) are
//! the ignored test, run by hand (`HARPE_PLAN_MEM_T=4096,8192`; benches/results/plan-128k-memory.md).
use candle_core::{DType, Device};
use harpe::config::Checkpointing;
use harpe::flatbuf::Placement;
use harpe::grads::GradAccum;
use harpe::model::config::LlamaConfig;
use harpe::model::rope::{Positions, RopeScheme};
use harpe::model::weights::init_flat;
use harpe::train::plan::{activations, layer_graph, Arch, LayerPath, StageShape};
use harpe::train::{batch_tensors, forward_backward, trainable_model, Backward, MicroBatch, Params};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting live bytes and their peak.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` with the same arguments; the counters are only counters.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A Llama of hidden `c`, `heads` heads of `c / heads`, MLP `i`, `layers` layers, vocabulary `v`.
fn config((c, heads, i): (usize, usize, usize), layers: usize, v: usize, t: usize) -> LlamaConfig {
    let mut cfg = LlamaConfig::tiny(v, RopeScheme::Default { theta: 10000.0 });
    cfg.hidden_size = c;
    cfg.num_attention_heads = heads;
    cfg.num_key_value_heads = heads;
    cfg.head_dim = c / heads;
    cfg.intermediate_size = i;
    cfg.num_hidden_layers = layers;
    cfg.tie_word_embeddings = false;
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(t);
    cfg
}

/// The plan's `inputs + max(recompute, loss)` for one bf16 micro-batch of `t` tokens, and the printed terms.
fn planned(cfg: &LlamaConfig, t: usize, loss_chunk: usize) -> (f64, String) {
    let arch = Arch::from_llama(cfg);
    let shape = StageShape {
        seq_len: t,
        micro_batch: 1,
        tokens_per_step: t,
        checkpointing: Checkpointing::EveryLayer,
        loss_chunk,
        bf16: true,
    };
    let l = cfg.num_hidden_layers;
    let act = activations(&arch, &shape, LayerPath::CpuHalf, (l, 1, 1), t as f64, 0.0);
    let mib = |b: f64| b / (1 << 20) as f64;
    let per_token: f64 = layer_graph(&arch, LayerPath::CpuHalf, 2.0).iter().map(|s| s.per_token).sum();
    let terms = format!(
        "inputs {:.1}, recompute {:.1}, loss {:.1}; graph {:.1}K values/token/layer",
        mib(act.inputs),
        mib(act.recompute),
        mib(act.loss),
        per_token / 1e3
    );
    (act.inputs + act.recompute.max(act.loss), terms)
}

/// (measured extra bytes at the step's peak, planned bytes) of one bf16 micro-batch of `t` tokens.
fn measured_and_planned(cfg: &LlamaConfig, t: usize, loss_chunk: usize) -> (f64, f64) {
    let (planned, terms) = planned(cfg, t, loss_chunk);
    let dev = Device::Cpu;
    let (layout, weights) = init_flat(cfg, 0, &Placement::Host).unwrap();
    let (model, vars) = trainable_model(cfg, &layout, &weights, DType::BF16, &dev).unwrap();
    drop(weights);
    let mut grads = GradAccum::new(&layout, &dev).unwrap();
    let tables = model.rope_tables(Positions::new(0, t)).unwrap();
    let seq: Vec<u32> = (0..t).map(|k| ((k * 7 + k * k) % cfg.vocab_size) as u32).collect();
    let (ids, targets) = batch_tensors(&[&seq], cfg.vocab_size, &dev).unwrap();
    let batch = MicroBatch { ids: &ids, targets: &targets, tables: &tables, docs: None };
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = forward_backward(
        &model,
        &mut Params::resident(&vars, &layout, &mut grads),
        &batch,
        Backward { seg: 1, loss_chunk, scale: 1.0 },
    )
    .unwrap();
    let measured = (PEAK.load(Ordering::Relaxed) - before) as f64;
    assert!(out.nll.sum_all().unwrap().to_scalar::<f32>().unwrap().is_finite());

    let mib = |b: f64| b / (1 << 20) as f64;
    eprintln!(
        "C {} I {} L {} T {t}: measured {:.1} MiB, planned {:.1} MiB ({terms}), measured/planned {:.3}",
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        mib(measured),
        mib(planned),
        measured / planned
    );
    (measured, planned)
}

fn assert_within_10_percent(cfg: &LlamaConfig, t: usize, loss_chunk: usize) {
    let (m, p) = measured_and_planned(cfg, t, loss_chunk);
    let r = m / p;
    assert!((0.9..=1.1).contains(&r), "T {t}: measured/planned = {r:.3}, outside 10%");
}

/// A small layer stack at two lengths, its vocabulary small enough that a recomputed layer (not the loss)
/// is the peak, as at 128K; and with the real vocabulary at 1K tokens, where the loss's backward is.
#[test]
fn plan_is_within_10_percent_of_the_allocator_peak_in_bf16() {
    let cfg = config((512, 4, 1376), 2, 2048, 2048);
    for t in [1024, 2048] {
        assert_within_10_percent(&cfg, t, 256);
    }
    assert_within_10_percent(&config((256, 2, 688), 2, 32000, 1024), 1024, 256);
}

/// The 7B layer shape (hidden 4096, 32 heads of 128, MLP 11008, vocabulary 32000), 2 layers, at the
/// lengths in `HARPE_PLAN_MEM_T` (default 4096); minutes per length on a few cores. With
/// `HARPE_PLAN_MEM_DRY` set it prints the plan only.
#[test]
#[ignore]
fn plan_is_within_10_percent_at_the_7b_layer_shape() {
    let ts = std::env::var("HARPE_PLAN_MEM_T").unwrap_or_else(|_| "4096".into());
    let cfg = config((4096, 32, 11008), 2, 32000, 1 << 17);
    for t in ts.split(',').map(|s| s.trim().parse::<usize>().unwrap()) {
        if std::env::var_os("HARPE_PLAN_MEM_DRY").is_some() {
            // the plan alone (seconds): to set a measurement beside a changed plan
            let (p, terms) = planned(&cfg, t, 4096.min(t));
            eprintln!("C 4096 I 11008 L 2 T {t}: planned {:.1} MiB ({terms})", p / (1 << 20) as f64);
            continue;
        }
        assert_within_10_percent(&cfg, t, 4096.min(t));
    }
}
