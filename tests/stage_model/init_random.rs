//! Random initialization (`init_random`, `init_flat`): the pieces drawn in parallel from a seeked
//! ChaCha8 stream give the bits of the one sequential stream the initialization always used (so seeds,
//! tests and runs keep their values), and `init_flat` puts exactly those values into a host or device
//! flat buffer (CPU and GPU runs start from the same weights).
use candle_core::{DType, Device};
use harpe::flatbuf::Placement;
use harpe::grads::flatten_params;
use harpe::model::config::LlamaConfig;
use harpe::model::llama::param_shapes;
use harpe::model::rope::RopeScheme;
use harpe::model::weights::{init_flat, init_random};
use rand::{Rng, SeedableRng};

/// The sequential initialization `init_pieces` replaced, kept as the reference.
fn sequential(cfg: &LlamaConfig, seed: u64) -> Vec<(String, Vec<f32>)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let std = cfg.initializer_range as f32;
    param_shapes(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let v = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                (0..n)
                    .map(|_| {
                        let u1: f32 = rng.random::<f32>().max(1e-12);
                        let u2: f32 = rng.random::<f32>();
                        std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
                    })
                    .collect()
            };
            (name, v)
        })
        .collect()
}

#[test]
fn parallel_pieces_equal_the_sequential_stream_on_every_placement() {
    let mut cfg = harpe::model::testing::tiny_config(RopeScheme::Default { theta: 10000.0 });
    // a vocabulary large enough that the embedding spans several pieces (2^20 values) and ends in a ragged one
    cfg.vocab_size = 40_961;
    cfg.num_hidden_layers = 2;
    for seed in [0u64, 7] {
        let want = sequential(&cfg, seed);
        let got = init_random(&cfg, seed, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(got.len(), want.len());
        for ((gn, gt), (wn, wv)) in got.iter().zip(&want) {
            assert_eq!(gn, wn);
            let g = gt.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(g.iter().zip(wv).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}: {gn} differs");
        }
        let (_, flat) = flatten_params(&got).unwrap();
        let flat = flat.to_host().unwrap().to_vec();
        for p in [Placement::Host, Placement::Device(Device::Cpu)] {
            let (layout, f) = init_flat(&cfg, seed, &p).unwrap();
            assert_eq!(layout.total, flat.len());
            assert!(f.to_host().unwrap().iter().zip(&flat).all(|(a, b)| a.to_bits() == b.to_bits()), "{p:?}");
        }
    }
    let a = init_random(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    let b = init_random(&cfg, 2, DType::F32, &Device::Cpu).unwrap();
    assert_ne!(a[0].1.to_vec2::<f32>().unwrap(), b[0].1.to_vec2::<f32>().unwrap(), "seeds differ");
}
