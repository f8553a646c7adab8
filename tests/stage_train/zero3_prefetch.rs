//! ZeRO-3's weight prefetch (`ZeroShards::prefetch`, on by default under NCCL and `Local`): a micro-batch's
//! forward/backward with each layer's all-gather started one call ahead (during the previous layer,
//! and across the gap between the last segment's forward and the first recompute) gives exactly the
//! gradients of the resident parameters, for every checkpoint segment length, host and device shards,
//! f32 and bf16 (gathered in the compute dtype), over two thread ranks whose gathers and reduce-scatters
//! run on their communication threads while the layers compute; and it really
//! prefetches: only the first gather of each chain starts cold.
use candle_core::{DType, Device};
use harpe::comms::local::spawn_local;
use harpe::comms::zero::{self, ShardMap, Split, ZeroShards};
use harpe::comms::Comm;
use harpe::flatbuf::{FlatBuf, Placement};
use harpe::grads::GradAccum;
use harpe::model::config::LlamaConfig;
use harpe::model::rope::{Positions, RopeScheme};
use harpe::model::weights::init_flat;
use harpe::train::{batch_tensors, forward_backward, trainable_model, Backward, MicroBatch, Params};
use std::time::Duration;

const LAYERS: usize = 5;

fn config() -> LlamaConfig {
    let mut c = LlamaConfig::tiny(61, RopeScheme::Default { theta: 10000.0 });
    c.num_hidden_layers = LAYERS;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.head_dim = 8;
    c
}

fn seq() -> Vec<u32> {
    (0..23u32).map(|i| (i * 7 + i * i) % 61).collect()
}

/// Gradients of the resident parameters (one rank, the whole flat space).
fn resident(dtype: DType, seg: usize) -> Vec<f32> {
    let cfg = config();
    let (layout, weights) = init_flat(&cfg, 3, &Placement::Host).unwrap();
    let (model, vars) = trainable_model(&cfg, &layout, &weights, dtype, &Device::Cpu).unwrap();
    let tables = model.rope_tables(Positions::new(0, 23)).unwrap();
    let s = seq();
    let (ids, targets) = batch_tensors(&[&s], 61, &Device::Cpu).unwrap();
    let mut g = GradAccum::new(&layout, &Device::Cpu).unwrap();
    let batch = MicroBatch { ids: &ids, targets: &targets, tables: &tables, docs: None };
    forward_backward(
        &model,
        &mut Params::resident(&vars, &layout, &mut g),
        &batch,
        Backward { seg, loss_chunk: 7, scale: 1.0 },
    )
    .unwrap();
    g.buf().to_host().unwrap().to_vec()
}

/// Each of `world` thread ranks' gradient shard (the same micro-batch on every rank, so the sums are
/// `world` times the one-rank gradients) and its number of cold gathers.
fn sharded(world: usize, dtype: DType, seg: usize, placement: &Placement, prefetch: bool) -> Vec<(Vec<f32>, usize)> {
    let cfg = config();
    let (layout, weights) = init_flat(&cfg, 3, &Placement::Host).unwrap();
    let (model, _) = trainable_model(&cfg, &layout, &weights, dtype, &Device::Cpu).unwrap();
    let tables = model.rope_tables(Positions::new(0, 23)).unwrap();
    let map = ShardMap::new(&layout, world, Split::Slices);
    spawn_local(world, Duration::from_secs(20), |c| {
        let comm = Comm::Local(c, 1);
        let me = comm.mesh().rank();
        let own = map.flat_range(me);
        let master = FlatBuf::from_vec(weights.to_host()?[own.clone()].to_vec()).placed(placement)?;
        let mut grads = FlatBuf::zeros_in(own.len(), placement)?;
        let s = seq();
        let (ids, targets) = batch_tensors(&[&s], 61, &Device::Cpu)?;
        let mut z = ZeroShards::new(
            zero::Shards { comm: &comm, map: &map, layout: &layout, master: &master },
            &mut grads,
            dtype,
            Device::Cpu,
            50,
        );
        assert!(z.prefetch, "Local collectives run beside the compute (communication threads): prefetch by default");
        z.prefetch = prefetch;
        let mut params = Params::sharded(z);
        forward_backward(
            &model,
            &mut params,
            &MicroBatch { ids: &ids, targets: &targets, tables: &tables, docs: None },
            Backward { seg, loss_chunk: 7, scale: 1.0 },
        )?;
        let cold = params.shards().expect("ZeRO-3 holds shards").cold_gathers();
        drop(params);
        Ok((grads.to_host()?.to_vec(), cold))
    })
    .map_err(|e| e.to_string())
    .unwrap()
}

#[test]
fn prefetched_gathers_give_the_resident_gradients_and_start_ahead() {
    let world = 2;
    let map_of = |cfg: &LlamaConfig| {
        let (layout, _) = init_flat(cfg, 3, &Placement::Host).unwrap();
        ShardMap::new(&layout, world, Split::Slices)
    };
    let map = map_of(&config());
    let outer_groups = 3; // embedding, final norm, untied head
    for dtype in [DType::F32, DType::BF16] {
        for seg in [1, 2, LAYERS] {
            let want = resident(dtype, seg);
            let recomputed = LAYERS - (LAYERS - 1) % seg - 1; // layers outside the last segment
            for placement in [Placement::Host, Placement::Device(Device::Cpu)] {
                for prefetch in [false, true] {
                    let what = format!("{dtype:?} seg {seg} {placement:?} prefetch {prefetch}");
                    let ranks = sharded(world, dtype, seg, &placement, prefetch);
                    for (r, (g, cold)) in ranks.iter().enumerate() {
                        let own = map.flat_range(r);
                        assert_eq!(g.len(), own.len(), "{what}");
                        for (i, (a, b)) in g.iter().zip(&want[own.clone()]).enumerate() {
                            let b = world as f32 * b;
                            assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "{what} rank {r} elem {i}: {a} vs {b}");
                        }
                        assert!(g.iter().any(|&x| x != 0.0), "{what}: rank {r} got no gradient");
                        let all = outer_groups + LAYERS + recomputed;
                        let want_cold = if prefetch { outer_groups + 1 } else { all };
                        assert_eq!(*cold, want_cold, "{what} rank {r}: cold gathers");
                    }
                }
            }
        }
    }
}
