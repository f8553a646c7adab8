//! One training step against references: torch AdamW (golden), gradient accumulation, activation
//! checkpointing on/off, every parameter reached, loss equal to the model's full-logits loss.
//! These call the same functions the `harpe train` loop calls (`forward_backward`, `AdamW::step`).
use crate::common::ops::rel_err;
use candle_core::{DType, Device, Tensor};
use harpe::comms::zero::{ShardMap, Split};
use harpe::config::Checkpointing;
use harpe::data::{Sequence, SourceSpan};
use harpe::flatbuf::FlatBuf;
use harpe::grads::{flatten_params, GradAccum};
use harpe::model::config::LlamaConfig;
use harpe::model::layout::ParamLayout;
use harpe::model::rope::{Positions, RopeScheme};
use harpe::model::weights::{init_random, load_tensors};
use harpe::model::Llama;
use harpe::optim::adamw::{AdamW, AdamWHyper};
use harpe::train::{batch_tensors, forward_backward, trainable_model, Backward, LossSums, MicroBatch, Params};
use std::path::Path;

fn tiny(layers: usize, rope: RopeScheme) -> (LlamaConfig, ParamLayout, FlatBuf) {
    let mut cfg = harpe::model::testing::tiny_config(rope);
    cfg.num_hidden_layers = layers;
    let t = init_random(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    let (layout, flat) = flatten_params(&t).unwrap();
    (cfg, layout, flat)
}

fn seqs(n: usize, t: usize, v: u32) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..t).map(|j| ((i * 131 + j * 17 + j * j) as u32) % v).collect()).collect()
}

/// Gradients of one optimizer step made of `micro` micro-batches over `data`.
fn step_grads(
    cfg: &LlamaConfig,
    layout: &ParamLayout,
    flat: &FlatBuf,
    data: &[Vec<u32>],
    micro: usize,
    ck: Checkpointing,
    dtype: DType,
) -> (Vec<f32>, f64) {
    let (model, vars) = trainable_model(cfg, layout, flat, dtype, &Device::Cpu).unwrap();
    let t = data[0].len();
    let tables = model.rope_tables(Positions::new(0, t)).unwrap();
    let mut g = GradAccum::new(layout, &Device::Cpu).unwrap();
    let total = (data.len() * (t - 1)) as f64;
    let mut nll = 0.0;
    for chunk in data.chunks(data.len() / micro) {
        let refs: Vec<&[u32]> = chunk.iter().map(|s| s.as_slice()).collect();
        let (ids, tg) = batch_tensors(&refs, cfg.vocab_size, &Device::Cpu).unwrap();
        let seg = ck.segment_len(cfg.num_hidden_layers);
        let out = forward_backward(
            &model,
            &mut Params::resident(&vars, layout, &mut g),
            &MicroBatch { ids: &ids, targets: &tg, tables: &tables, docs: None },
            Backward { seg, loss_chunk: 7, scale: 1.0 / total },
        )
        .unwrap();
        nll += out.nll.to_vec1::<f32>().unwrap().iter().map(|&x| x as f64).sum::<f64>();
    }
    (g.buf().host().unwrap().to_vec(), nll / total)
}

#[test]
fn accumulation_equals_a_larger_batch_and_checkpointing_changes_nothing() {
    let (cfg, layout, flat) = tiny(3, RopeScheme::Harpe { head_bases: vec![1e4, 5e5], layer_head_bases: None });
    let data = seqs(4, 24, cfg.vocab_size as u32);
    let (g1, l1) = step_grads(&cfg, &layout, &flat, &data, 1, Checkpointing::None, DType::F32);
    let (g4, l4) = step_grads(&cfg, &layout, &flat, &data, 4, Checkpointing::None, DType::F32);
    assert!(rel_err(&g4, &g1, 0.0) < 1e-5, "accumulation: {}", rel_err(&g4, &g1, 0.0));
    assert!((l1 - l4).abs() < 1e-6);
    for ck in [Checkpointing::EveryLayer, Checkpointing::Every(2)] {
        let (gc, lc) = step_grads(&cfg, &layout, &flat, &data, 2, ck, DType::F32);
        assert!(rel_err(&gc, &g1, 0.0) < 1e-5, "{ck:?}: {}", rel_err(&gc, &g1, 0.0));
        assert!((lc - l1).abs() < 1e-6);
    }
    // every parameter gets a non-zero gradient (no op in the path without a backward)
    for p in &layout.params {
        let n: f32 = g1[p.range.clone()].iter().map(|x| x.abs()).sum();
        assert!(n > 0.0, "{} got no gradient", p.name);
    }
    // the loss is the model's own full-logits cross-entropy (candle_nn) on the same batch
    let mut m = std::collections::HashMap::new();
    for p in &layout.params {
        m.insert(p.name.clone(), flat.param_tensor(p.range.clone(), &p.shape, DType::F32, &Device::Cpu).unwrap());
    }
    let model = Llama::from_tensors(cfg.clone(), m, "test").unwrap();
    let flat_ids: Vec<u32> = data.concat();
    let ids = Tensor::from_vec(flat_ids, (4, 24), &Device::Cpu).unwrap();
    let full = model.loss_full(&ids).unwrap().to_scalar::<f32>().unwrap() as f64;
    assert!((full - l1).abs() < 1e-5, "{full} vs {l1}");
}

#[test]
fn bf16_compute_with_fp32_master_tracks_f32() {
    let (cfg, layout, flat) = tiny(2, RopeScheme::Default { theta: 10000.0 });
    let data = seqs(2, 16, cfg.vocab_size as u32);
    let (g32, l32) = step_grads(&cfg, &layout, &flat, &data, 1, Checkpointing::EveryLayer, DType::F32);
    let (g16, l16) = step_grads(&cfg, &layout, &flat, &data, 1, Checkpointing::EveryLayer, DType::BF16);
    assert!((l32 - l16).abs() / l32 < 0.01, "{l32} vs {l16}");
    let cos = {
        let dot: f64 = g32.iter().zip(&g16).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
        let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        dot / (n(&g32) * n(&g16))
    };
    assert!(cos > 0.99, "bf16 gradient direction: cos {cos}");
}

/// The model of the AdamW goldens (tests/golden/adamw/model) as training holds it: its config and its
/// parameters flattened in HF order.
fn golden_model() -> (LlamaConfig, ParamLayout, FlatBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/adamw/model");
    let cfg = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    let mut w = load_tensors(&dir, DType::F32, &Device::Cpu).unwrap();
    if cfg.tie_word_embeddings {
        w.remove("lm_head.weight");
    }
    let model = Llama::from_tensors(cfg.clone(), w, "golden").unwrap();
    let (layout, flat) = flatten_params(&model.tensors()).unwrap();
    (cfg, layout, flat)
}

/// The largest relative error (|a - b| / max(|b|, 1e-3)) of the optimizer's master weights against the
/// golden's `param.NAME` tensors, and the parameter it is in.
fn worst_param_error(
    layout: &ParamLayout,
    opt: &AdamW,
    golden: &std::collections::HashMap<String, Tensor>,
) -> (f32, String) {
    let mut worst = (0f32, String::new());
    for p in &layout.params {
        let want = golden[&format!("param.{}", p.name)].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in opt.master().host().unwrap()[p.range.clone()].iter().zip(&want) {
            let rel = (a - b).abs() / b.abs().max(1e-3);
            if rel > worst.0 {
                worst = (rel, p.name.clone());
            }
        }
    }
    worst
}

/// tests/golden/`name`: its golden.safetensors (inputs, losses, the parameters after the steps) and its
/// hparams.json.
fn golden_run(name: &str) -> (std::collections::HashMap<String, Tensor>, serde_json::Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu).unwrap();
    let hp = serde_json::from_str(&std::fs::read_to_string(dir.join("hparams.json")).unwrap()).unwrap();
    (golden, hp)
}

#[test]
fn one_step_matches_torch_adamw_golden() {
    let (cfg, layout, flat) = golden_model();
    let (golden, hp) = golden_run("adamw");
    let f = |k: &str| hp[k].as_f64().unwrap();
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    let (g, loss) = step_grads(&cfg, &layout, &flat, &ids, 1, Checkpointing::EveryLayer, DType::F32);
    let torch_loss = golden["loss"].to_vec1::<f32>().unwrap()[0] as f64;
    assert!((loss - torch_loss).abs() < 1e-5 * torch_loss, "loss {loss} vs torch {torch_loss}");
    let wd = f("weight_decay") as f32;
    let h = AdamWHyper {
        beta1: f("beta1") as f32,
        beta2: f("beta2") as f32,
        eps: f("eps") as f32,
        wd_matrix: wd,
        wd_embedding: wd,
        wd_norm: 0.0,
    };
    let mut opt = AdamW::new(&layout, &flat, &ShardMap::new(&layout, 1, Split::Slices), 0, h).unwrap();
    opt.step(&FlatBuf::from_vec(g), f("lr")).unwrap();
    let worst = worst_param_error(&layout, &opt, &golden);
    assert!(worst.0 < 1e-5, "worst relative error {} in {}", worst.0, worst.1);
}

#[test]
fn several_steps_match_torch_adamw_with_decay_groups_and_clipping() {
    // Five steps (bias correction no longer cancels the betas), a different lr each step, three
    // weight-decay groups (matrices, embedding, norms) and clip_grad_norm_ active at every step.
    let (cfg, layout, flat) = golden_model();
    let (golden, hp) = golden_run("adamw_steps");
    let f = |k: &str| hp[k].as_f64().unwrap() as f32;
    let h = AdamWHyper {
        beta1: f("beta1"),
        beta2: f("beta2"),
        eps: f("eps"),
        wd_matrix: f("wd_matrix"),
        wd_embedding: f("wd_embedding"),
        wd_norm: f("wd_norm"),
    };
    let lrs: Vec<f64> = hp["lrs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let losses = golden["loss"].to_vec1::<f32>().unwrap();
    let norms = golden["grad_norm"].to_vec1::<f32>().unwrap();
    let mut opt = AdamW::new(&layout, &flat, &ShardMap::new(&layout, 1, Split::Slices), 0, h).unwrap();
    for (k, &lr) in lrs.iter().enumerate() {
        let ids = golden[&format!("input_ids.{k}")].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
        let (g, loss) = step_grads(&cfg, &layout, opt.master(), &ids, 1, Checkpointing::None, DType::F32);
        let mut g = FlatBuf::from_vec(g);
        assert!(
            (loss - losses[k] as f64).abs() < 1e-5 * losses[k] as f64,
            "step {k}: loss {loss} vs torch {}",
            losses[k]
        );
        let norm = harpe::grads::global_norm(&g).unwrap();
        assert!((norm - norms[k] as f64).abs() < 1e-4 * norms[k] as f64, "step {k}: grad norm {norm} vs {}", norms[k]);
        let scale = harpe::grads::clip_by_global_norm(&mut g, norm, hp["max_norm"].as_f64().unwrap()).unwrap();
        assert!(scale < 1.0, "step {k}: clipping must be active");
        opt.step(&g, lr).unwrap();
    }
    let worst = worst_param_error(&layout, &opt, &golden);
    // 2e-4: f32 summation order alone moves this. The worst element (layer 0's k_proj) is 5.0e-5 off
    // with one thread or one GEMM over all rows, 1.0e-4 when the linear op cuts the rows into one
    // single-threaded GEMM per thread (`ops::linear`: a band's k-blocking follows its own row count);
    // five clipped Adam steps, each dividing by sqrt(v), carry such differences into the weights.
    assert!(worst.0 < 2e-4, "after {} steps: worst relative error {} in {}", lrs.len(), worst.0, worst.1);
}

/// The host computation `LossSums` replaced: every predicted token's nll added, in position order, to
/// the total and to its source's (sum, count) (position p predicts p + 1).
fn host_loss_sums(micro: &[(Vec<f32>, Vec<Sequence>)], start: usize, len: usize, n: usize) -> (f64, Vec<f64>) {
    let (mut total, mut acc) = (0f64, vec![0f64; if n < 2 { 0 } else { 2 * n }]);
    for (nll, seqs) in micro {
        total += nll.iter().map(|&x| x as f64).sum::<f64>();
        if acc.is_empty() {
            continue;
        }
        for (i, s) in seqs.iter().enumerate() {
            for p in start..(start + len).min(s.tokens.len() - 1) {
                if let Some(id) = s.source_of(p + 1) {
                    acc[2 * id as usize] += nll[i * len + p - start] as f64;
                    acc[2 * id as usize + 1] += 1.0;
                }
            }
        }
    }
    (total, acc)
}

/// Random sequences of `t` tokens whose spans leave gaps (tokens of no source) and a random nll for
/// positions start..start + len of each, 0 where the target is ignored (the last position).
fn random_micro(rng: &mut u64, b: usize, t: usize, start: usize, len: usize, n: u32) -> (Vec<f32>, Vec<Sequence>) {
    let mut next = move || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    };
    let seqs: Vec<Sequence> = (0..b)
        .map(|_| {
            let mut sources = vec![];
            let mut p = 0;
            while p < t {
                let end = (p + 1 + (next() % 9) as usize).min(t);
                if next() % 4 != 0 {
                    sources.push(SourceSpan { source: (next() % n as u64) as u32, start: p, end });
                }
                p = end;
            }
            Sequence { tokens: vec![0; t], sources, doc_starts: vec![0], index: 0, epoch: 0 }
        })
        .collect();
    let nll = (0..b * len)
        .map(|k| if start + k % len == t - 1 { 0.0 } else { (next() % 1_000_000) as f32 * 1.3e-5 })
        .collect();
    (nll, seqs)
}

/// One micro-batch: the bits of the host loop; several: the same sums up to the f64 association of the
/// micro-batches' partial sums (the total is still exact: the host also summed each micro-batch first).
#[test]
fn loss_sums_on_the_device_equal_the_host_sums() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut unsourced = 0;
    // (sources, whole sequence or one sequence-parallel part)
    for (n, start, len) in [(1usize, 0usize, 37usize), (3, 0, 37), (5, 0, 37), (4, 13, 12), (4, 25, 12)] {
        for k in [1, 3] {
            let micro: Vec<_> = (0..k).map(|_| random_micro(&mut rng, 2, 37, start, len, n.max(1) as u32)).collect();
            let mut sums = LossSums::new(n, &Device::Cpu).unwrap();
            for (nll, seqs) in &micro {
                sums.add(&Tensor::new(nll.as_slice(), &Device::Cpu).unwrap(), seqs, start, len).unwrap();
            }
            let (total, by_source) = sums.read().unwrap();
            let (want_total, want) = host_loss_sums(&micro, start, len, n);
            assert_eq!(total.to_bits(), want_total.to_bits(), "{n} sources: {total} vs {want_total}");
            assert_eq!(by_source.len(), want.len());
            for (j, (a, b)) in by_source.iter().zip(&want).enumerate() {
                if k == 1 {
                    assert_eq!(a.to_bits(), b.to_bits(), "{n} sources, value {j}: {a} vs {b}");
                } else {
                    assert!((a - b).abs() <= 1e-14 * b.abs(), "{n} sources, {k} micro-batches, value {j}: {a} vs {b}");
                }
            }
            if n >= 2 {
                assert!(want.chunks(2).filter(|c| c[1] > 0.0).count() >= 2, "tokens of several sources");
                let targets = 2 * k * ((start + len).min(36) - start); // the last position has no target
                unsourced += targets - want.chunks(2).map(|c| c[1]).sum::<f64>() as usize;
            }
        }
    }
    assert!(unsourced > 0, "the cases include targets in no source's span");
}

#[test]
fn loss_sums_refuse_an_unknown_source_id() {
    let (nll, mut seqs) = random_micro(&mut 7u64.wrapping_mul(0x2545_f491_4f6c_dd1d), 1, 9, 0, 9, 2);
    seqs[0].sources = vec![SourceSpan { source: 2, start: 0, end: 9 }];
    let mut sums = LossSums::new(2, &Device::Cpu).unwrap();
    let e = sums.add(&Tensor::new(nll.as_slice(), &Device::Cpu).unwrap(), &seqs, 0, 9).unwrap_err();
    assert!(e.to_string().contains("source id 2"), "{e}");
}

/// `batch_tensors` checks every token id against the vocabulary while it is host data (the loss checks
/// only on the CPU): an out-of-vocab input id (position 0, only an input) and target (the last position,
/// only a target's source besides its own input) are refused naming row, position and id, with a hint.
#[test]
fn batch_tensors_refuses_ids_outside_the_vocabulary() {
    let ok: Vec<u32> = vec![0, 1, 2, 9];
    let (ids, tg) = batch_tensors(&[&ok, &ok], 10, &Device::Cpu).unwrap();
    assert_eq!(ids.dims(), [2, 4]);
    assert_eq!(tg.to_vec1::<u32>().unwrap(), [1, 2, 9, u32::MAX, 1, 2, 9, u32::MAX]);
    for (bad, pos, id) in [(vec![10u32, 1, 2, 3], 0, 10), (vec![0, 1, 2, 4000], 3, 4000)] {
        let e = batch_tensors(&[&ok, &bad], 10, &Device::Cpu).unwrap_err().to_string();
        let want = format!("batch row 1, position {pos}: token id {id} is outside the model's vocabulary of 10");
        assert!(e.starts_with(&want), "{e}");
        assert!(e.contains("hint:") && e.contains("tokenizer"), "{e}");
    }
}
