//! The host emulation's measuring (`ops::emu::profile`, kernels/emu.h) on toy kernels whose counts are
//! computed here by hand (kernels/emu_toys.cu), cp.async's commit/wait semantics with its poison, and the
//! attention kernels' counts that follow from their tiling.
//! Measuring is process-wide, so every test takes `LOCK` and resets the table first.
use half::bf16;
use harpe::ops::attention_shape::{AttnDims, AttnKernel, AttnMask};
use harpe::ops::emu::attention as ka;
use harpe::ops::emu::profile::{self, Profile};
use std::sync::Mutex;

static LOCK: Mutex<()> = Mutex::new(());

/// Run `f` measured and return the counts of kernel `name`.
fn measured(name: &str, f: impl FnOnce()) -> Profile {
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    profile::reset();
    profile::enable(true);
    f();
    profile::enable(false);
    profile::get(name).unwrap_or_else(|| panic!("{name} did not run measured"))
}

#[test]
fn coalesced_and_strided_loads_count_their_sectors() {
    let x: Vec<f32> = (0..32 * 8).map(|i| i as f32).collect();
    // one warp, 32 floats: 128 contiguous aligned bytes are 4 sectors, for the load and for the store
    let p = measured("toy_copy", || assert_eq!(profile::toy_copy(&x, 1).unwrap(), x[..32]));
    assert_eq!((p.launches, p.global_instr, p.global_sectors, p.useful_bytes), (1, 2, 8, 256));
    assert_eq!(p.sector_efficiency(), 1.0);
    // stride 8 floats = 32 bytes: every lane's float in its own sector (32 sectors for 128 useful bytes);
    // the store stays 4 sectors
    let want: Vec<f32> = (0..32).map(|i| (8 * i) as f32).collect();
    let p = measured("toy_copy", || assert_eq!(profile::toy_copy(&x, 8).unwrap(), want));
    assert_eq!((p.global_instr, p.global_sectors, p.useful_bytes), (2, 36, 256));
    assert!((p.sector_efficiency() - 256.0 / (36.0 * 32.0)).abs() < 1e-12);
    assert_eq!((p.shared_instr, p.bank_conflicts, p.barriers, p.atomics, p.mma), (0, 0, 0, 0, 0));
}

#[test]
fn a_column_of_an_unpadded_tile_is_a_32_way_bank_conflict() {
    let want: Vec<f32> = (0..32).map(|l| (32 * l) as f32).collect();
    // 32 row stores (lane l -> bank l: one wavefront each), one column load (every lane in bank 0: 32
    // wavefronts for 32 distinct words, 31 of them conflicts), one barrier
    let p = measured("toy_shared_column", || assert_eq!(profile::toy_shared_column(false), want));
    assert_eq!((p.shared_instr, p.shared_wavefronts, p.bank_conflicts, p.barriers), (33, 64, 31, 1));
    // rows of 33 floats: lane l's column word sits in bank l, and every row store still spans 32 banks
    let p = measured("toy_shared_column_padded", || assert_eq!(profile::toy_shared_column(true), want));
    assert_eq!((p.shared_instr, p.shared_wavefronts, p.bank_conflicts, p.barriers), (33, 33, 0, 1));
}

#[test]
fn cp_async_lands_group_by_group_and_poisons_early_reads() {
    let x: Vec<f32> = (0..256).map(|i| i as f32 + 0.5).collect();
    let p = measured("toy_cp_async", || {
        let y = profile::toy_cp_async(&x, false).unwrap();
        // after wait_group 1 the first group (floats 0..128) has landed, the second has not
        assert_eq!(y[..128], x[..128]);
        assert!(y[128..256].iter().all(|v| v.to_bits() == u32::MAX), "the pending group reads as poison");
        // after wait_group 0 everything has
        assert_eq!(y[256..], x[..]);
    });
    // 2 x 32 copies of 16 bytes: per group 512 contiguous bytes = 16 sectors, and 4 conflict-free phases of
    // 8 lanes on the shared side
    assert_eq!((p.cp_async, p.global_instr, p.global_sectors, p.useful_bytes), (64, 2, 32, 1024));
    assert_eq!((p.shared_instr, p.shared_wavefronts, p.bank_conflicts), (2, 8, 0));
}

#[test]
fn reading_cp_async_data_before_the_wait_fails() {
    // the broken kernel (reads before cp.async.wait_group) sees poison, never the data: a test comparing
    // its output with the input fails, as it must
    let x: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let y = profile::toy_cp_async(&x, true).unwrap();
    assert!(y.iter().all(|v| v.is_nan()), "an early read must not see the copied data");
    assert_ne!(y[..256], x[..]);
}

#[test]
fn attention_forward_counts_follow_from_its_tiles() {
    // tensor-core forward, D = 64: one 128-row query tile (8 warps of 16 rows) against 64-key tiles. The input
    // starts on a 128-byte boundary as a GPU tensor does: sectors are counted by address, and the heap puts a
    // Vec only 16-byte aligned (the shifted run below)
    let q = profile::Aligned::new(&vec![bf16::from_f32(0.1); 128 * 64 + 8]);
    // Tq = Tk = 64, causal: warps 4-7 hold no valid row and skip the one key tile; per live warp S = Q K^T is
    // (64 / 8) x (64 / 16) mma and O += P V (64 / 16) x (64 / 8): 64
    let dims = AttnDims { b: 1, h: 1, hkv: 1, tq: 64, tk: 64, d: 64 };
    let p = measured("attn_fwd_tc_bf16_d64", || {
        ka::attention_fwd(
            AttnKernel::TensorCore,
            (&q[..64 * 64], &q[..64 * 64], &q[..64 * 64]),
            dims,
            AttnMask::new(0.125, true, None),
        )
        .unwrap();
    });
    assert_eq!(p.mma, 4 * 64);
    // the Q tile landed, every warp holds its Q fragments (the rows become K/V stages), one per key tile
    assert_eq!(p.barriers, 3);
    // every tile load is whole 128-byte rows of bf16 by 16-byte cp.async: fully used sectors; Q's 64 valid
    // rows, K's and V's 64 rows, 8 copies each
    assert_eq!(p.sector_efficiency(), 1.0);
    assert_eq!(p.cp_async, 3 * 64 * 8);
    assert_eq!(p.global_sectors, 3 * 64 * 128 / 32);
    assert_eq!((p.atomics, p.bank_conflicts), (0, 0));
    // the same launch on inputs 16 bytes past a sector boundary (still 16-byte aligned, as cp.async needs):
    // each warp copy is 32 x 16 = 512 contiguous bytes (4 rows), 16 per tensor, and now straddles 17 sectors:
    // 16/17 of the bytes moved are used, with no change to the kernel
    let shifted = &q[8..8 + 64 * 64];
    let p = measured("attn_fwd_tc_bf16_d64", || {
        ka::attention_fwd(AttnKernel::TensorCore, (shifted, shifted, shifted), dims, AttnMask::new(0.125, true, None))
            .unwrap();
    });
    assert_eq!((p.global_instr, p.useful_bytes, p.global_sectors), (3 * 16, 3 * 16 * 512, 3 * 16 * 17));
    assert_eq!(p.sector_efficiency(), 16.0 / 17.0);
    // Tq = Tk = 128, causal: two key tiles; warps 0-3 (rows 0..63) see only the first and skip the second,
    // warps 4-7 compute both: 4 x 64 + 4 x 128 mma (8 x 128 without the per-warp skip); the second tile's
    // cp.async group is in flight while the first is computed
    let dims = AttnDims { tq: 128, tk: 128, ..dims };
    let p = measured("attn_fwd_tc_bf16_d64", || {
        let q = &q[..128 * 64];
        ka::attention_fwd(AttnKernel::TensorCore, (q, q, q), dims, AttnMask::new(0.125, true, None)).unwrap();
    });
    assert_eq!(p.mma, 4 * 64 + 4 * 128);
    assert_eq!(p.barriers, 2 + 2);
    assert_eq!(p.cp_async, (128 + 2 * 2 * 64) * 8);
    assert_eq!((p.sector_efficiency(), p.bank_conflicts), (1.0, 0));
}

#[test]
fn attention_backward_adds_each_dq_element_once_per_tile_pair() {
    // tensor-core backward, D = 64: key tiles of 64, query tiles of 32; Tq = Tk = 64 causal gives one key
    // tile against two query tiles, so at most 2 x 32 x 64 atomics (FA2's bound: one per dQ element per
    // (query tile, key tile)). Zero partial sums are skipped: query row 0 sees key 0 alone (p = 1, so
    // dS = dO.v0 - dO.O = 0 exactly) and adds nothing; every other row's D elements are added once
    let dims = AttnDims { b: 1, h: 1, hkv: 1, tq: 64, tk: 64, d: 64 };
    let mut seed = 12345u32;
    let mut next = || {
        seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
        bf16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
    };
    let x: Vec<bf16> = (0..3 * 64 * 64).map(|_| next()).collect();
    let (q, k, v) = (&x[..4096], &x[4096..8192], &x[8192..]);
    let (o, lse) =
        ka::attention_fwd(AttnKernel::TensorCore, (q, k, v), dims, AttnMask::new(0.125, true, None)).unwrap();
    let p = measured("attn_bwd_tc_bf16_d64", || {
        ka::attention_bwd(AttnKernel::TensorCore, (q, k, v), (&o, &lse), q, dims, AttnMask::new(0.125, true, None))
            .unwrap();
    });
    assert_eq!(p.atomics, 2 * 32 * 64 - 64);
    // per warp (16 keys, a half) and query tile: S^T and dP^T over its 16 queries (16 / 8) x (64 / 16) x 2,
    // dV and dK over its 32 columns (32 / 16) x (32 / 8) x 2, its dQ tile (64 / 16) x 2: 8 warps x 2 tiles x
    // (16 + 16 + 8) — the 4-warp layout's 4 x 2 x 80, split without duplicated work
    assert_eq!(p.mma, 8 * 2 * (16 + 16 + 8));
    // K and V landed, every warp holds its V fragments (the rows become Q/dO stages), then two per query tile
    assert_eq!(p.barriers, 2 + 2 * 2);
    // K, V: 64 rows; Q, dO: 2 tiles x 32 rows; 8 copies of 16 bytes per row
    assert_eq!(p.cp_async, (2 * 64 + 2 * 2 * 32) * 8);
    assert_eq!(p.bank_conflicts, 0, "{p:?}");
}
