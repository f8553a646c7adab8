//! Criterion bench of the HARPE-PV v1 search (`research::bases::search`): the full 32-base search over the 133
//! candidates of the paper's setting (1m..5m, stride 30k, 128K grid of 98,881 distances), plus its
//! parts — one waveform on the grid (64 cosines per point) and the greedy loop on precomputed extrema.
//! The waveforms are ~99% of the time: 134 bases x 98,881 points x 64 cos = 848M cos evaluations.
use criterion::{criterion_group, criterion_main, Criterion};
use harpe::research::bases::search::{candidates, extrema, greedy_select, peak_valley_search, waveform_grid, PvParams};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let p = PvParams::scaled(128, 4096, 131072).expect("params");
    let cands = candidates(1e6, 5e6, 30000.0).expect("candidates");
    let mut g = c.benchmark_group("search_bases");
    g.sample_size(10);
    g.bench_function("waveform_grid_1base_128k", |b| b.iter(|| waveform_grid(black_box(2.17e6), &p)));
    let start = extrema(1e6, &p);
    let pool: Vec<_> = cands.iter().map(|&b| extrema(b, &p)).collect();
    g.bench_function("greedy_select_32_of_133", |b| b.iter(|| greedy_select(&start, black_box(&pool), 32)));
    g.bench_function("peak_valley_search_32_of_133_128k", |b| {
        b.iter(|| peak_valley_search(1e6, black_box(&cands), 32, &p).expect("search"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
