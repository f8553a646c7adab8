//! `train::plan::largest_fitting_tokens` for Llama-2-7B on one GPU (the `harpe bench model` step row's T):
//! the returned T fits and the next multiple does not, the fitting T are a prefix of the multiples,
//! the multiple is respected, and nothing fits an 80 GB A100 (18 B/param = 121 GB of state alone).
use harpe::config::Checkpointing;
use harpe::config::ZeroStage;
use harpe::model::config::LlamaConfig;
use harpe::train::plan::{largest_fitting_tokens, plan_stage, Arch, Gpu, GpuKind, StageShape, World};
use std::path::Path;

fn llama_7b() -> Arch {
    Arch::from_llama(&LlamaConfig::from_file(Path::new("configs/arch/llama-2-7b/config.json")).unwrap())
}

const ONE: World = World { gpus: 1, zero_stage: ZeroStage::Replicated, sp_degree: 1 };

fn template() -> StageShape {
    StageShape {
        seq_len: 1024,
        micro_batch: 1,
        tokens_per_step: 1024,
        checkpointing: Checkpointing::EveryLayer,
        loss_chunk: 1024,
        bf16: true,
    }
}

fn fits(arch: &Arch, gpu: &Gpu, t: usize) -> bool {
    plan_stage(arch, &StageShape { seq_len: t, tokens_per_step: t, ..template() }, &ONE, gpu).fits
}

#[test]
fn the_7b_step_fits_an_h200_at_the_largest_multiple_and_not_one_more() {
    let (arch, gpu) = (llama_7b(), Gpu::new(GpuKind::H200));
    assert_eq!(arch.params, 6_738_415_616);
    let t = largest_fitting_tokens(&arch, &template(), &ONE, &gpu, 1024).expect("7B fits one H200");
    assert_eq!(t % 1024, 0);
    assert!(fits(&arch, &gpu, t) && !fits(&arch, &gpu, t + 1024), "T = {t}");
    // 141 GB less 10%: 121 GB of state leaves room for a long but not unbounded sequence
    assert!((16384..=1 << 20).contains(&t), "T = {t}");
    // monotone: every multiple below fits, none above (a sample of both sides)
    for k in (1..t / 1024).step_by(7) {
        assert!(fits(&arch, &gpu, k * 1024), "T = {} below {t} must fit", k * 1024);
    }
    for k in [1, 2, 5, 17, 100] {
        assert!(!fits(&arch, &gpu, t + k * 1024), "T = {} above {t} must not fit", t + k * 1024);
    }
    // another multiple: the result is a multiple of it, the largest one that fits
    let t3 = largest_fitting_tokens(&arch, &template(), &ONE, &gpu, 3000).unwrap();
    assert_eq!(t3 % 3000, 0);
    assert!(fits(&arch, &gpu, t3) && !fits(&arch, &gpu, t3 + 3000), "T = {t3}");
    assert!(t3.abs_diff(t) < 3000, "{t3} vs {t}");
    // less memory, shorter T
    let mut less = gpu.clone();
    less.mem_bytes -= 4 << 30;
    let t_less = largest_fitting_tokens(&arch, &template(), &ONE, &less, 1024).unwrap();
    assert!(t_less < t && fits(&arch, &less, t_less) && !fits(&arch, &less, t_less + 1024), "{t_less} vs {t}");
}

#[test]
fn nothing_fits_an_80_gb_gpu_and_a_shorter_stack_fits_long_sequences() {
    let arch = llama_7b();
    for kind in [GpuKind::A100, GpuKind::H100] {
        let gpu = Gpu::new(kind);
        assert!(!fits(&arch, &gpu, 1024));
        assert_eq!(largest_fitting_tokens(&arch, &template(), &ONE, &gpu, 1024), None, "{kind:?}");
    }
    // a 2-layer 7B-wide stack on an H200: still a bounded T, a multiple of 1024; multiple 0 is taken as 1
    let mut c = LlamaConfig::from_file(Path::new("configs/arch/llama-2-7b/config.json")).unwrap();
    c.num_hidden_layers = 2;
    let small = Arch::from_llama(&c);
    let gpu = Gpu::new(GpuKind::H200);
    let t = largest_fitting_tokens(&small, &template(), &ONE, &gpu, 1024).unwrap();
    assert!(t > 131072 && fits(&small, &gpu, t) && !fits(&small, &gpu, t + 1024), "T = {t}");
    let t1 = largest_fitting_tokens(&arch, &template(), &ONE, &gpu, 0).unwrap();
    assert!(fits(&arch, &gpu, t1) && !fits(&arch, &gpu, t1 + 1), "T = {t1}");
}
