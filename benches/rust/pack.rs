//! Criterion bench of the packing core (no Python): 1M lognormal lengths (median 512,
//! sigma 1, clipped to [16, C]) and the "hard" distribution (median 0.3 C, sigma 0.5).
//! `cargo bench -p mmpack-bench --bench pack`
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mmpack_bench::SplitMix64;
use mmpack_core::packing::{pack, Algorithm, PackOptions};

fn lognormal(n: usize, median: f64, sigma: f64, cap: i64, seed: u64) -> Vec<i64> {
    let mut rng = SplitMix64::new(seed);
    let mut unit = move || ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..n)
        .map(|_| {
            // Box-Muller.
            let z = (-2.0 * unit().ln()).sqrt() * (2.0 * std::f64::consts::PI * unit()).cos();
            ((median.ln() + sigma * z).exp().round() as i64).clamp(16, cap)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("pack_1m");
    group.sample_size(10);
    for cap in [4096i64, 8192] {
        let sft = lognormal(1_000_000, 512.0, 1.0, cap, 1);
        for alg in Algorithm::ALL {
            if alg == Algorithm::FirstFitShuffle {
                continue; // needs an order; same engine as first_fit_decreasing
            }
            let opts = PackOptions::new(cap, alg);
            group.bench_with_input(BenchmarkId::new(alg.name(), cap), &sft, |b, x| {
                b.iter(|| pack(x, None, &opts).map(|p| p.num_bins()));
            });
        }
        let hard = lognormal(1_000_000, 0.3 * cap as f64, 0.5, cap, 2);
        for alg in [Algorithm::BestFitDecreasing, Algorithm::MinimumBinSlack] {
            let opts = PackOptions::new(cap, alg);
            let id = format!("hard_{}", alg.name());
            group.bench_with_input(BenchmarkId::new(id, cap), &hard, |b, x| {
                b.iter(|| pack(x, None, &opts).map(|p| p.num_bins()));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
