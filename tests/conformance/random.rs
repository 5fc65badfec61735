//! Generators and distributions: the same seed gives the same bits, uniforms,
//! integers, permutations, Bernoulli draws, dropout masks and categorical
//! samples on every device and in every mode (the CPU kernel and the PJRT
//! lowering of `random_bits` are one Philox4x32-10 stream); normals agree to
//! the rounding of `log`, `sqrt`, `cos`, `sin`. Also the distributions'
//! shapes, ranges and moments, the generator API and its errors.
use super::on_devices;
use crate::common::{assert_err, f64s};
use kiln::prelude::*;
use kiln::Generator;

/// Draws of every distribution from a generator seeded with `seed` on `dev`, read back.
fn draws(dev: Device, seed: u64) -> Result<Vec<(&'static str, Vec<f64>)>> {
    let g = Generator::new(dev)?.manual_seed(seed)?;
    let probs = Tensor::new([[0.1f32, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]])?.to_device(dev)?;
    let x = Tensor::ones(&[3, 7], (DType::F32, dev))?;
    Ok(vec![
        ("bits", f64s(&g.random_bits(&[5, 3])?)),
        ("bits, empty", f64s(&g.random_bits(&[0])?)),
        ("rand f32", f64s(&g.rand(&[9], DType::F32)?)),
        ("rand f64", f64s(&g.rand(&[6], DType::F64)?)),
        ("rand bf16", f64s(&g.rand(&[6], DType::BF16)?)),
        ("rand f16", f64s(&g.rand(&[6], DType::F16)?)),
        ("randint", f64s(&g.randint(-5, 17, &[12], DType::I64)?)),
        ("randint, wide", f64s(&g.randint(-(1 << 40), 1 << 40, &[7], DType::I64)?)),
        ("randperm", f64s(&g.randperm(11, DType::I64)?)),
        ("bernoulli", f64s(&g.bernoulli(&Tensor::full(&[10], 0.3, (DType::F32, dev))?)?)),
        ("dropout", f64s(&x.dropout_with(0.4, true, &g)?)),
        ("multinomial", f64s(&g.multinomial(&probs, 6, true)?)),
        ("multinomial, no replacement", f64s(&g.multinomial(&probs, 3, false)?)),
        ("state", f64s(&g.get_state()?)),
    ])
}

#[test]
fn the_same_seed_draws_the_same_numbers_on_every_device() {
    let want = draws(Device::Cpu, 2024).unwrap();
    on_devices(|dev| {
        let got = draws(dev, 2024)?;
        for ((name, w), (_, g)) in want.iter().zip(&got) {
            assert_eq!(g, w, "{name} on {dev}");
        }
        // Normals go through log/sqrt/cos/sin: equal to their rounding.
        let a = f64s(&Generator::new(Device::Cpu)?.manual_seed(5)?.randn(&[33], DType::F32)?);
        let b = f64s(&Generator::new(dev)?.manual_seed(5)?.randn(&[33], DType::F32)?);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "randn on {dev}: {a:?} vs {b:?}");
        }
        Ok(())
    });
}

#[test]
fn draws_advance_the_state_by_blocks_of_four() {
    on_devices(|dev| {
        let g = Generator::new(dev)?.manual_seed(3)?;
        assert_eq!(g.get_state()?.to_vec::<i64>()?, vec![3, 0]);
        g.random_bits(&[5])?; // two blocks
        assert_eq!(g.get_state()?.to_vec::<i64>()?, vec![3, 2]);
        g.random_bits(&[4])?;
        g.random_bits(&[0])?;
        assert_eq!(g.get_state()?.to_vec::<i64>()?, vec![3, 3]);
        // Two draws of 4 are one draw of 8.
        let h = Generator::new(dev)?.manual_seed(3)?;
        let eight = f64s(&h.random_bits(&[8])?);
        let h = Generator::new(dev)?.manual_seed(3)?;
        let mut two = f64s(&h.random_bits(&[4])?);
        two.extend(f64s(&h.random_bits(&[4])?));
        assert_eq!(two, eight);
        assert!(eight.iter().all(|&b| (0.0..4294967296.0).contains(&b) && b.fract() == 0.0));
        // get_state / set_state replay a stream.
        let s = h.get_state()?;
        let a = f64s(&h.rand(&[10], DType::F32)?);
        h.set_state(&s)?;
        assert_eq!(f64s(&h.rand(&[10], DType::F32)?), a);
        h.set_state(&s.to_device(Device::Cpu)?)?;
        assert_eq!(f64s(&h.rand(&[10], DType::F32)?), a, "a state from another device");
        assert_eq!(h.initial_seed(), 3);
        assert_eq!(h.device(), dev);
        Ok(())
    });
}

#[test]
fn distributions_have_their_ranges_and_moments() {
    on_devices(|dev| {
        let g = Generator::new(dev)?.manual_seed(11)?;
        for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let u = g.rand(&[20000], dt)?;
            assert_eq!((u.dtype(), u.shape()), (dt, &[20000usize][..]));
            let v = f64s(&u);
            assert!(v.iter().all(|&x| (0.0..1.0).contains(&x)), "rand {dt} in [0, 1)");
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            assert!((mean - 0.5).abs() < 0.02, "rand {dt} mean {mean}");
        }
        let z = f64s(&g.randn(&[20001], DType::F32)?);
        let mean = z.iter().sum::<f64>() / z.len() as f64;
        let var = z.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / z.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "randn: mean {mean}, var {var}");
        let r = f64s(&g.randint(10, 13, &[3000], DType::I32)?);
        for k in 10..13 {
            let n = r.iter().filter(|&&x| x == k as f64).count();
            assert!((850..1150).contains(&n), "randint drew {k} {n} times of 3000");
        }
        let mut p = f64s(&g.randperm(1000, DType::I64)?);
        assert_ne!(p, (0..1000).map(|i| i as f64).collect::<Vec<_>>(), "randperm shuffles");
        p.sort_by(f64::total_cmp);
        assert_eq!(p, (0..1000).map(|i| i as f64).collect::<Vec<_>>(), "randperm is a permutation");
        let b = f64s(&g.bernoulli(&Tensor::full(&[10000], 0.2, (DType::F64, dev))?)?);
        let ones = b.iter().filter(|&&x| x == 1.0).count();
        assert!(b.iter().all(|&x| x == 0.0 || x == 1.0) && (1800..2200).contains(&ones), "bernoulli: {ones}");
        // Dropout keeps 1 - p of the elements, scaled by 1 / (1 - p).
        let d = f64s(&Tensor::ones(&[10000], (DType::F32, dev))?.dropout_with(0.25, true, &g)?);
        let kept = d.iter().filter(|&&x| x != 0.0).count();
        assert!(d.iter().all(|&x| x == 0.0 || (x - 4.0 / 3.0).abs() < 1e-6) && (7300..7700).contains(&kept));
        // Categorical draws follow the weights, never pick a zero weight, and
        // without replacement never repeat within a row.
        let w = Tensor::new([1.0f32, 0.0, 3.0, 0.0])?.to_device(dev)?;
        let m = f64s(&g.multinomial(&w, 4000, true)?);
        let twos = m.iter().filter(|&&x| x == 2.0).count();
        assert!(m.iter().all(|&x| x == 0.0 || x == 2.0) && (2850..3150).contains(&twos), "multinomial: {twos}");
        let rows = Tensor::new([[5.0f32, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])?.to_device(dev)?;
        for _ in 0..20 {
            let s = g.multinomial(&rows, 4, false)?;
            assert_eq!((s.shape(), s.dtype()), (&[2usize, 4][..], DType::I64));
            for row in s.to_vec::<i64>()?.chunks(4) {
                let mut r = row.to_vec();
                r.sort();
                r.dedup();
                assert_eq!(r.len(), 4, "no repeats without replacement: {row:?}");
            }
            assert!(!s.to_vec::<i64>()?[..4].contains(&4), "a zero weight is never drawn");
        }
        Ok(())
    });
}

#[test]
fn default_generators_are_per_device_and_seeded_together() {
    let _g = crate::creation::RNG.lock().unwrap_or_else(|e| e.into_inner());
    on_devices(|dev| {
        kiln::manual_seed(77);
        let a = f64s(&Tensor::rand(&[8], (DType::F32, dev))?);
        let x = f64s(&Tensor::ones(&[64], (DType::F32, dev))?.dropout(0.5, true)?);
        kiln::manual_seed(77);
        assert_eq!(f64s(&Tensor::rand(&[8], (DType::F32, dev))?), a);
        assert_eq!(f64s(&Tensor::ones(&[64], (DType::F32, dev))?.dropout(0.5, true)?), x);
        assert_eq!(kiln::default_generator(dev)?.initial_seed(), 77);
        // The same seed on the CPU's default generator gives the same numbers.
        kiln::manual_seed(77);
        assert_eq!(f64s(&Tensor::rand(&[8], DType::F32)?), a);
        let p = Tensor::new([[0.5f32, 0.5]])?.to_device(dev)?;
        let s = p.multinomial(1, true)?;
        assert_eq!((s.shape(), s.device()), (&[1usize, 1][..], dev));
        Ok(())
    });
}

#[test]
fn threads_sharing_a_generator_get_disjoint_numbers() {
    on_devices(|dev| {
        let g = Generator::new(dev)?.manual_seed(8)?;
        let per_thread = 25;
        let blocks: Vec<Vec<i64>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let g = g.clone();
                    s.spawn(move || {
                        (0..per_thread)
                            .map(|_| g.random_bits(&[4]).unwrap().to_vec::<i64>().unwrap())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut got = blocks;
        got.sort();
        let h = Generator::new(dev)?.manual_seed(8)?;
        let all = h.random_bits(&[4 * 4 * per_thread])?.to_vec::<i64>()?;
        let mut want: Vec<Vec<i64>> = all.chunks(4).map(|c| c.to_vec()).collect();
        want.sort();
        assert_eq!(got, want, "every block drawn exactly once");
        Ok(())
    });
}

#[test]
fn bad_random_requests_are_errors() {
    on_devices(|dev| {
        let g = Generator::new(dev)?;
        let other = if dev == Device::Cpu { Generator::new(Device::Tpu(0))? } else { Generator::new(Device::Cpu)? };
        let x = Tensor::ones(&[4], (DType::F32, dev))?;
        assert_err(x.dropout_with(0.5, true, &other), &["dropout", "expected a generator on"]);
        assert_err(x.dropout(1.5, true), &["dropout probability has to be between 0 and 1, but got 1.5"]);
        assert_err(g.set_state(&Tensor::zeros(&[3], DType::I64)?), &["set_state", "shape [2] and dtype int64"]);
        assert_err(g.set_state(&Tensor::zeros(&[2], DType::F32)?), &["set_state", "int64"]);
        assert_err(g.randint(3, 3, &[2], DType::I64), &["from=3 >= to=3"]);
        assert_err(g.randint(i64::MIN, i64::MAX, &[2], DType::I64), &["randint", "wider than 2^63 - 1"]);
        assert_err(g.rand(&[2], DType::I32), &["rand", "floating point"]);
        let p = |v: Vec<f32>| Tensor::from_vec(v, &[1, 3]).and_then(|t| t.to_device(dev));
        let nan = "probability tensor contains either `inf`, `nan` or element < 0";
        assert_err(g.multinomial(&p(vec![0.5, f32::NAN, 0.5])?, 1, true), &["multinomial", nan]);
        assert_err(g.multinomial(&p(vec![0.5, f32::INFINITY, 0.5])?, 1, true), &[nan]);
        assert_err(g.multinomial(&p(vec![0.5, -0.1, 0.5])?, 1, true), &[nan]);
        assert_err(g.multinomial(&p(vec![0.0, 0.0, 0.0])?, 1, true), &["sum of probabilities <= 0"]);
        assert_err(g.multinomial(&p(vec![0.5, 0.0, 0.5])?, 3, false), &["not enough non-negative category"]);
        assert_err(g.multinomial(&p(vec![0.5, 0.2, 0.5])?, 4, false), &["n_sample > prob_dist.size(-1)"]);
        assert_err(g.multinomial(&p(vec![0.5, 0.2, 0.5])?, 0, true), &["n_sample <= 0"]);
        assert_err(g.multinomial(&Tensor::ones(&[1, 1, 2], (DType::F32, dev))?, 1, true), &["1 or 2 dim"]);
        assert_err(g.bernoulli(&Tensor::full(&[2], 1.5, (DType::F32, dev))?), &["bernoulli", "p_in <= 1"]);
        Ok(())
    });
}
