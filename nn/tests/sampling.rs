//! Token choice in generation (`kiln::nn::generate::choose`): greedy, top-k,
//! top-p, sampling that follows the distribution, and NaN logits refused;
//! the same seed gives the same tokens on the CPU and the PJRT device.
mod support;

use kiln::nn::generate::{choose, Sampling};
use kiln::prelude::*;
use kiln::Generator;

fn pick(logits: &[f32], s: &Sampling, seed: u64) -> i64 {
    let g = Generator::new(Device::Cpu).unwrap().manual_seed(seed).unwrap();
    let x = Tensor::from_vec(logits.to_vec(), &[1, logits.len()]).unwrap();
    choose(&x, s, &g).unwrap().to_vec::<i64>().unwrap()[0]
}

#[test]
fn top_k_one_is_argmax() {
    let s = Sampling::sample(1.0).with_top_k(1);
    assert!(s.is_greedy());
    let s = Sampling::sample(1.0).with_top_k(2);
    for seed in 0..20 {
        let t = pick(&[0.0, 5.0, 4.0, -1.0], &s, seed);
        assert!(t == 1 || t == 2);
    }
}

#[test]
fn top_p_keeps_the_nucleus() {
    let s = Sampling::sample(1.0).with_top_p(0.5);
    // One token holds almost all the mass: it is the only one kept.
    for seed in 0..20 {
        assert_eq!(pick(&[10.0, 0.0, 0.0, 0.0], &s, seed), 0);
    }
}

#[test]
fn sampling_covers_the_distribution() {
    let s = Sampling::sample(1.0);
    let picks: Vec<i64> = (0..200).map(|seed| pick(&[0.0, 0.0, f32::NEG_INFINITY], &s, seed)).collect();
    let ones = picks.iter().filter(|&&t| t == 1).count();
    assert!(picks.iter().all(|&t| t == 0 || t == 1), "{picks:?}");
    assert!((60..140).contains(&ones), "{ones} of 200 draws chose token 1");
}

#[test]
fn nan_logits_are_an_error_when_sampling() {
    let g = Generator::new(Device::Cpu).unwrap();
    let x = Tensor::new([[0.0f32, f32::NAN]]).unwrap();
    let e = choose(&x, &Sampling::sample(1.0), &g).unwrap_err().to_string();
    assert!(e.contains("probability tensor contains either `inf`, `nan` or element < 0"), "{e}");
}

#[test]
fn the_same_seed_samples_the_same_tokens_on_cpu_and_pjrt() {
    support::register_tpu();
    let logits: Vec<f32> = (0..4 * 50).map(|i| ((i * 37 % 101) as f32 / 17.0).sin() * 3.0).collect();
    let x = Tensor::from_vec(logits, &[4, 50]).unwrap();
    for s in [Sampling::sample(0.8), Sampling::sample(1.0).with_top_k(10), Sampling::sample(1.3).with_top_p(0.9)] {
        let gc = Generator::new(Device::Cpu).unwrap().manual_seed(21).unwrap();
        let gt = Generator::new(Device::Tpu(0)).unwrap().manual_seed(21).unwrap();
        let xt = x.to_device(Device::Tpu(0)).unwrap();
        for step in 0..5 {
            let a = choose(&x, &s, &gc).unwrap().to_vec::<i64>().unwrap();
            let b = choose(&xt, &s, &gt).unwrap().to_vec::<i64>().unwrap();
            assert_eq!(a, b, "{s:?}, step {step}");
        }
    }
}
