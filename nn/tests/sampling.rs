//! Token choice in generation (`kiln::nn::generate::choose`): greedy; the
//! temperature, top-k, top-p and min-p warpers against transformers' own on
//! random logits; draws that follow the warped distribution (a chi-squared
//! test); NaN logits refused;
//! the same seed gives the same tokens on the CPU and the PJRT device.
mod support;

use kiln::nn::generate::{choose, warp_logits, Sampling};
use kiln::prelude::*;
use kiln::Generator;

fn pick(logits: &[f32], s: &Sampling, seed: u64) -> i64 {
    let g = Generator::new(Device::Cpu).unwrap().manual_seed(seed).unwrap();
    let x = Tensor::from_vec(logits.to_vec(), &[1, logits.len()]).unwrap();
    choose(&x, s, &g).unwrap().to_vec::<i64>().unwrap()[0]
}

#[test]
fn top_k_one_is_argmax() {
    assert!(Sampling::sample(1.0).with_top_k(1).is_greedy());
    assert!(!Sampling::sample(1.0).with_top_k(2).is_greedy());
    let logits = [0.3f32, -1.0, 2.5, 2.4];
    for seed in 0..5 {
        assert_eq!(pick(&logits, &Sampling::sample(1.7).with_top_k(1), seed), 2);
    }
}

/// The sampling settings checked against transformers: `(name, temperature, top_k, top_p, min_p)`.
const SETTINGS: [(&str, f64, usize, f64, f64); 8] = [
    ("top_k", 1.0, 5, 1.0, 0.0),
    ("top_p", 0.7, 0, 0.9, 0.0),
    ("top_k_top_p", 1.3, 20, 0.8, 0.0),
    ("min_p", 1.0, 0, 1.0, 0.05),
    ("all", 0.8, 40, 0.95, 0.1),
    ("narrow_top_p", 1.0, 0, 0.3, 0.0),
    ("wide_min_p", 2.0, 0, 1.0, 0.3),
    ("k_is_vocab", 0.5, 64, 1.0, 0.0),
];

fn setting(t: f64, k: usize, p: f64, m: f64) -> Sampling {
    Sampling::sample(t).with_top_k(k).with_top_p(p).with_min_p(m)
}

/// transformers' warpers (tests/check_sampling_warpers.py, in the
/// transformers venv) on `logits` for each of `settings`, by name.
fn transformers_warp(
    tag: &str,
    logits: &Tensor,
    settings: &[(&str, f64, usize, f64, f64)],
) -> std::collections::BTreeMap<String, Tensor> {
    let dir = support::temp_dir(tag);
    let input = dir.join("logits.safetensors");
    let inputs = std::collections::BTreeMap::from([("logits".to_string(), logits.clone())]);
    kiln::nn::io::save_safetensors(&input, &inputs, None).unwrap();
    let configs: Vec<serde_json::Value> = settings
        .iter()
        .map(|(n, t, k, p, m)| serde_json::json!({"name": n, "temperature": t, "top_k": k, "top_p": p, "min_p": m}))
        .collect();
    let cfg = dir.join("configs.json");
    std::fs::write(&cfg, serde_json::Value::from(configs).to_string()).unwrap();
    let out = dir.join("warped.safetensors");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_sampling_warpers.py");
    let run = std::process::Command::new(support::python_with_transformers())
        .arg(&script)
        .arg(&input)
        .arg(&cfg)
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "transformers' warpers failed:\n{}", String::from_utf8_lossy(&run.stderr));
    let warped = kiln::nn::io::load_safetensors(&out).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    warped
}

/// `warp_logits` removes exactly the tokens transformers' temperature, top-k,
/// top-p and min-p warpers remove, and leaves the others' scaled logits, on
/// random logits of many spreads (rows scaled from 0.25 to 6: a few tokens
/// or most of the vocabulary in the nucleus), on every device.
#[test]
fn warpers_remove_what_transformers_removes() {
    let (b, v) = (48usize, 64usize);
    let g = Generator::new(Device::Cpu).unwrap().manual_seed(5).unwrap();
    let scale: Vec<f32> = (0..b).map(|i| 0.25 + 5.75 * i as f32 / (b - 1) as f32).collect();
    let logits = g.randn(&[b, v], DType::F32).unwrap().mul(&Tensor::from_vec(scale, &[b, 1]).unwrap()).unwrap();
    let theirs = transformers_warp("warpers", &logits, &SETTINGS);
    support::register_tpu();
    for dev in [Device::Cpu, Device::Tpu(0)] {
        let x = logits.to_device(dev).unwrap();
        for (name, t, k, p, m) in SETTINGS {
            let ours = warp_logits(&x, &setting(t, k, p, m)).unwrap().to_vec::<f32>().unwrap();
            let want = theirs[name].to_vec::<f32>().unwrap();
            let removed = want.iter().filter(|w| w.is_infinite()).count();
            for (i, (o, w)) in ours.iter().zip(&want).enumerate() {
                let (row, col) = (i / v, i % v);
                assert_eq!(
                    o.is_infinite(),
                    w.is_infinite(),
                    "{dev} {name}: row {row} token {col}: kiln {o}, transformers {w}"
                );
                if w.is_finite() {
                    assert!((o - w).abs() <= f32::EPSILON * w.abs(), "{dev} {name}: row {row} token {col}: {o} vs {w}");
                }
            }
            // Every setting removes some tokens, and keeps some in every row.
            if name != "k_is_vocab" {
                assert!(removed > 0 && removed < b * (v - 1), "{name}: {removed} removed");
            }
        }
    }
}

/// Draws follow the warped distribution: 4000 draws from one row under
/// each setting never pick a removed token and pass Pearson's chi-squared
/// test against transformers' warped probabilities at significance 1e-4.
/// Power, on these logits: a no-op filter puts 18% (top-k 3), 33% (top-p
/// 0.6) and 25% (min-p 0.3) of the mass on removed tokens, so it draws one
/// with probability 1 - 0.82^4000 ~ 1; ignoring a temperature of 0.7 gives a
/// noncentrality of 372 on 5 degrees of freedom (power ~ 1); misweighting
/// the kept tokens as a temperature of 1.2 would (top-k 3, lambda 17) has
/// power 0.48.
#[test]
fn draws_follow_the_warped_distribution() {
    const N: usize = 4000;
    // Pearson's chi-squared critical values at 1e-4 for 1..=5 degrees of freedom.
    const CRITICAL: [f64; 5] = [15.137, 18.421, 21.108, 23.513, 25.745];
    let row = [2.0f32, 1.5, 1.0, 0.5, 0.0, -0.5];
    let settings = [
        ("temperature", 0.7, 0, 1.0, 0.0),
        ("top_k", 1.0, 3, 1.0, 0.0),
        ("top_p", 1.0, 0, 0.6, 0.0),
        ("min_p", 1.0, 0, 1.0, 0.3),
    ];
    let one = Tensor::from_vec(row.to_vec(), &[1, row.len()]).unwrap();
    let theirs = transformers_warp("draws", &one, &settings);
    let batch = one.expand(&[N as isize, row.len() as isize]).unwrap().contiguous().unwrap();
    for (i, (name, t, k, p, m)) in settings.into_iter().enumerate() {
        let g = Generator::new(Device::Cpu).unwrap().manual_seed(100 + i as u64).unwrap();
        let draws = choose(&batch, &setting(t, k, p, m), &g).unwrap().to_vec::<i64>().unwrap();
        let want = theirs[name].softmax(-1).unwrap().to_vec::<f32>().unwrap();
        let mut counts = vec![0usize; row.len()];
        for d in draws {
            counts[d as usize] += 1;
        }
        let mut chi2 = 0.0;
        let mut kept = 0;
        for (c, w) in counts.iter().zip(&want) {
            if *w == 0.0 {
                assert_eq!(*c, 0, "{name}: a removed token was drawn: {counts:?}");
            } else {
                let e = N as f64 * *w as f64;
                chi2 += (*c as f64 - e).powi(2) / e;
                kept += 1;
            }
        }
        assert!(kept >= 2, "{name}: the test needs two kept tokens at least");
        let critical = CRITICAL[kept - 2];
        assert!(chi2 < critical, "{name}: counts {counts:?} vs probabilities {want:?}: chi2 {chi2:.1} >= {critical}");
    }
}

#[test]
fn bad_min_p_and_empty_logits_are_errors() {
    let g = Generator::new(Device::Cpu).unwrap();
    let x = Tensor::new([[0.0f32, 1.0]]).unwrap();
    for m in [-0.1, 1.5, f64::NAN] {
        let e = choose(&x, &Sampling::sample(1.0).with_min_p(m), &g).unwrap_err().to_string();
        assert!(e.contains("min_p must be in [0, 1]"), "{e}");
    }
    let e = warp_logits(&x, &Sampling::greedy()).unwrap_err().to_string();
    assert!(e.contains("temperature of 0"), "{e}");
    // No vocabulary: an error, sampled or greedy, never a guess (or an index underflow).
    let empty = Tensor::zeros(&[2, 0], DType::F32).unwrap();
    for s in [Sampling::sample(1.0).with_top_p(0.9), Sampling::greedy()] {
        let e = choose(&empty, &s, &g).unwrap_err().to_string();
        assert!(e.contains("V >= 1"), "{e}");
    }
    assert!(warp_logits(&empty, &Sampling::sample(1.0)).unwrap_err().to_string().contains("V >= 1"));
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
