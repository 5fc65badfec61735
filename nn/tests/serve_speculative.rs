//! Speculative decoding in the serving engine (Note [Speculative decoding]):
//! prompt lookup and a draft model propose, the model verifies several
//! tokens per step; greedy tokens are exactly non-speculative decoding's,
//! sampled ones are distributed as the model's (a goodness-of-fit test),
//! under continuous batching with stops, penalties, prefix sharing and
//! preemption.
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::serve::{Engine, EngineConfig, EngineStats, Event, FinishReason, Penalties, Request, Speculation};
use kiln::prelude::*;

mod support;

fn model(seed: u64, vocab: usize, layers: usize) -> LlamaForCausalLM {
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "llama", "vocab_size": {vocab}, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": {layers}, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512}}"#
    ))
    .unwrap();
    let _rng = support::rng_lock();
    kiln::manual_seed(seed);
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap()
}

/// A prompt that repeats a phrase, so prompt lookup finds matches.
fn repetitive(len: usize, seed: u64) -> Vec<i64> {
    let phrase = support::random_tokens(7, seed, 96);
    (0..len).map(|i| phrase[i % 7]).collect()
}

fn greedy_requests() -> Vec<(u64, Request)> {
    vec![
        (0, Request::new(repetitive(30, 1), 40)),
        (0, Request::new(support::random_tokens(12, 2, 96), 25)),
        (1, Request::new(repetitive(9, 3), 33).with_stop_tokens(&[5])),
        (3, Request::new(repetitive(50, 4), 18)),
        (4, Request::new(support::random_tokens(3, 5, 96), 30)),
    ]
}

fn cfg(spec: Option<Speculation>) -> EngineConfig {
    EngineConfig { block_size: 4, max_batched_tokens: 40, max_num_seqs: 4, speculative: spec, ..Default::default() }
}

/// The tokens the engine gives without speculation (each request's
/// `generate()` tokens, Note [Batch invariance]).
fn plain(m: &LlamaForCausalLM, reqs: &[(u64, Request)]) -> Vec<(Vec<i64>, FinishReason)> {
    support::serve_arrivals(&mut Engine::new(m.clone(), cfg(None)).unwrap(), reqs)
}

fn report(what: &str, st: &EngineStats) {
    eprintln!(
        "{what}: {} proposed, {} kept ({:.2}), {:.2} tokens per verifying step",
        st.spec_proposed_tokens,
        st.spec_accepted_tokens,
        st.spec_acceptance_rate().unwrap_or(0.0),
        st.spec_tokens_per_step().unwrap_or(0.0)
    );
}

/// Greedy tokens under prompt lookup and under a draft model are exactly
/// those of decoding one token at a time (and of `generate()` alone), with
/// several tokens per verifying step.
#[test]
fn greedy_speculation_gives_the_same_tokens() {
    let _invariant = support::batch_invariance(true);
    let m = model(0, 96, 2);
    let reqs = greedy_requests();
    let want = plain(&m, &reqs);
    for ((_, r), (tokens, _)) in reqs.iter().zip(&want) {
        let p = Tensor::from_vec(r.prompt.clone(), &[1, r.prompt.len()]).unwrap();
        let g = generate(&m, &p, r.max_new_tokens, &Sampling::greedy().with_eos(&r.stop_token_ids)).unwrap();
        let g = g.to_vec::<i64>().unwrap()[r.prompt.len()..].to_vec();
        assert_eq!(tokens[..], g[..tokens.len()], "the engine without speculation differs from generate()");
    }
    let lookup = Speculation::NGram { k: 4, n_min: 1, n_max: 3 };
    let draft = |d: &LlamaForCausalLM| Speculation::Draft { model: Box::new(d.clone()), k: 3 };
    // A draft that is the model itself proposes what the model would say.
    for (name, spec) in
        [("prompt lookup", lookup), ("a smaller draft", draft(&model(9, 96, 1))), ("the model as draft", draft(&m))]
    {
        let mut engine = Engine::new(m.clone(), cfg(Some(spec))).unwrap();
        let got = support::serve_arrivals(&mut engine, &reqs);
        assert_eq!(got, want, "{name}: speculative greedy tokens differ");
        let st = engine.stats();
        report(name, &st);
        assert!(st.spec_accepted_tokens > 0 && st.spec_tokens_per_step().unwrap() > 1.0, "{name}: {st:?}");
        assert_eq!(st.generated_tokens as usize, want.iter().map(|w| w.0.len()).sum::<usize>());
        if name == "the model as draft" {
            assert_eq!(st.spec_acceptance_rate(), Some(1.0), "the model's own proposals are all kept");
        }
    }
}

/// Stop strings, stop tokens, penalties and lengths end or steer a request
/// at the same token with speculation as without, also when the stop falls
/// inside a verified proposal; prefix sharing and preemption under a small
/// pool keep the tokens.
#[test]
fn stops_penalties_sharing_and_preemption_under_speculation() {
    let _invariant = support::batch_invariance(true);
    let m = model(1, 96, 2);
    let text = |t: &[i64]| -> String { t.iter().map(|&x| char::from(b'a' + (x % 26) as u8)).collect() };
    let d: kiln::nn::serve::Detokenizer = std::sync::Arc::new(move |t: &[i64]| text(t));
    let free = plain(&m, &[(0, Request::new(repetitive(20, 7), 60))])[0].0.clone();
    let stop = text(&free[20..23]);
    let pens = Penalties { presence: 0.5, frequency: 0.3, repetition: 1.3 };
    let shared = repetitive(40, 8);
    let reqs = vec![
        (0, Request::new(repetitive(20, 7), 60).with_stop_strings(&[stop.as_str()])),
        (0, Request::new(repetitive(20, 7), 60).with_stop_tokens(&[free[30]])),
        (1, Request::new(repetitive(25, 9), 40).with_penalties(pens)),
        (2, Request::new(shared.clone(), 30)),
        (2, Request::new(shared, 30)),
        (5, Request::new(repetitive(33, 10), 45)),
    ];
    for blocks in [None, Some(24)] {
        let kv = |b: Option<usize>| b.map_or(EngineConfig::default().kv_cache_bytes, |n| n * per_block(&m));
        let base = EngineConfig { detokenizer: Some(d.clone()), kv_cache_bytes: kv(blocks), ..cfg(None) };
        let want = support::serve_arrivals(&mut Engine::new(m.clone(), base.clone()).unwrap(), &reqs);
        assert_eq!(want[0].1, FinishReason::Stop);
        for spec in
            [Speculation::NGram { k: 5, n_min: 1, n_max: 4 }, Speculation::Draft { model: Box::new(m.clone()), k: 4 }]
        {
            let mut engine =
                Engine::new(m.clone(), EngineConfig { speculative: Some(spec.clone()), ..base.clone() }).unwrap();
            let got = support::serve_arrivals(&mut engine, &reqs);
            assert_eq!(got, want, "{spec:?} with {blocks:?} blocks");
            let st = engine.stats();
            assert!(st.spec_accepted_tokens > 0 && st.prefix_hit_tokens > 0, "{st:?}");
            if blocks.is_some() {
                assert!(st.preemptions > 0, "the small pool preempts: {st:?}");
            }
        }
    }
}

fn per_block(m: &LlamaForCausalLM) -> usize {
    kiln::nn::serve::PagedKvCache::bytes_per_block(m, 4, DType::F32)
}

/// Bad settings are refused when the engine is built.
#[test]
fn bad_speculation_settings_are_refused() {
    let m = model(0, 96, 1);
    let bad = [
        (Speculation::NGram { k: 0, n_min: 1, n_max: 2 }, "k must be at least 1"),
        (Speculation::NGram { k: 2, n_min: 3, n_max: 2 }, "n_min <= n_max"),
        (Speculation::Draft { model: Box::new(model(0, 64, 1)), k: 2 }, "share the target's vocabulary"),
    ];
    for (spec, msg) in bad {
        let e = Engine::new(m.clone(), cfg(Some(spec))).err().expect("refused").to_string();
        assert!(e.contains(msg), "{e}");
    }
}

/// The probabilities the engine samples from after `context` at temperature `t`.
fn next_probs(m: &LlamaForCausalLM, context: &[i64], t: f64) -> Vec<f64> {
    let x = Tensor::from_vec(context.to_vec(), &[1, context.len()]).unwrap();
    let l = m.forward(&x, None).unwrap().narrow(1, context.len() as isize - 1, 1).unwrap().squeeze_dim(1).unwrap();
    let w = kiln::nn::generate::warp_logits(&l, &Sampling::sample(t)).unwrap();
    w.softmax(-1).unwrap().to_vec::<f32>().unwrap().iter().map(|&p| p as f64).collect()
}

/// The upper `z`-sigma point of a chi-square with `df` degrees of freedom
/// (Wilson and Hilferty's approximation).
fn chi2_critical(df: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

/// The standard normal distribution function (Abramowitz and Stegun 7.1.26 on erf).
fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / 2f64.sqrt();
    let t = 1.0 / (1.0 + 0.3275911 * z);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    let erf = 1.0 - poly * (-z * z).exp();
    0.5 * (1.0 + if x < 0.0 { -erf } else { erf })
}

/// Sampled speculation keeps the model's distribution: tokens 2 and 3 of
/// 4000 seeded requests (token 1 comes from the prompt's step; then one
/// proposed token is verified, so every path runs: a kept proposal and a
/// last draw, a refused one and its replacement) follow `sum over t1 of
/// p1(t1) p2(t2 | t1) p3(t3 | t1, t2)`, computed from plain forwards, by a
/// chi-square test at significance 1e-3 over the 64 cells (those expecting
/// fewer than 5 merged). Its power is stated against the two likeliest bugs,
/// each a distribution the test must tell apart: keeping every proposal (the
/// output then follows the proposer), and replacing a refused proposal by a
/// draw from `p` instead of the residual; the test asserts a power of at
/// least 0.99 against both (normal approximation of the noncentral
/// chi-square) before it looks at the counts.
#[test]
fn sampled_speculation_keeps_the_models_distribution() {
    let _invariant = support::batch_invariance(true);
    let (v, n, t) = (8usize, 4000usize, 0.05);
    let (m, drafter) = (model(21, v, 2), model(22, v, 1));
    // The model's own greedy continuation: it repeats itself, so prompt
    // lookup proposes tokens the model finds likely (and a refused proposal's
    // replacement matters).
    let seed = Tensor::new([[1i64, 3]]).unwrap();
    let prompt = generate(&m, &seed, 12, &Sampling::greedy()).unwrap().to_vec::<i64>().unwrap();
    eprintln!("prompt {prompt:?}");
    let ctx = |x: &[i64]| [prompt.clone(), x.to_vec()].concat();
    let p1 = next_probs(&m, &prompt, t);
    let p2: Vec<Vec<f64>> = (0..v).map(|a| next_probs(&m, &ctx(&[a as i64]), t)).collect();
    let p3: Vec<Vec<Vec<f64>>> =
        (0..v).map(|a| (0..v).map(|b| next_probs(&m, &ctx(&[a as i64, b as i64]), t)).collect()).collect();
    // The distribution of (t2, t3) when t2 given t1 = a follows second(a).
    let joint = |second: &dyn Fn(usize) -> Vec<f64>| -> Vec<f64> {
        let mut j = vec![0.0; v * v];
        for a in 0..v {
            let s2 = second(a);
            for c in 0..v * v {
                j[c] += p1[a] * s2[c / v] * p3[a][c / v][c % v];
            }
        }
        j
    };
    let want = joint(&|a| p2[a].clone());
    // The proposers' distributions of t2 after t1 = a: the draft model's, or
    // prompt lookup's certain token (the one after a's latest occurrence;
    // none for a token not in the prompt: no proposal, t2 drawn from p2).
    let draft_q: Vec<Vec<f64>> = (0..v).map(|a| next_probs(&drafter, &ctx(&[a as i64]), t)).collect();
    let lookup_q: Vec<Vec<f64>> = (0..v)
        .map(|a| {
            let c = ctx(&[a as i64]);
            match c[..c.len() - 1].iter().rposition(|&x| x == a as i64) {
                Some(i) => (0..v).map(|b| if b as i64 == c[i + 1] { 1.0 } else { 0.0 }).collect(),
                None => p2[a].clone(),
            }
        })
        .collect();
    for (name, spec, q) in [
        ("a draft model", Speculation::Draft { model: Box::new(drafter.clone()), k: 1 }, draft_q),
        ("prompt lookup", Speculation::NGram { k: 1, n_min: 1, n_max: 1 }, lookup_q),
    ] {
        // The alternatives the test must detect.
        let keep_all = joint(&|a| q[a].clone());
        let from_p = joint(&|a| {
            let kept: f64 = (0..v).map(|d| p2[a][d].min(q[a][d])).sum();
            (0..v).map(|b| p2[a][b].min(q[a][b]) + (1.0 - kept) * p2[a][b]).collect()
        });
        // Cells expecting fewer than 5 are merged into one.
        let small: Vec<bool> = want.iter().map(|&w| w * (n as f64) < 5.0).collect();
        let cells = |x: &[f64]| -> Vec<f64> {
            let mut c: Vec<f64> = x.iter().zip(&small).filter(|(_, s)| !**s).map(|(a, _)| *a).collect();
            c.push(x.iter().zip(&small).filter(|(_, s)| **s).map(|(a, _)| *a).sum());
            c
        };
        let w = cells(&want);
        let df = (w.len() - 1) as f64;
        let crit = chi2_critical(df, 3.09);
        for (bug, alt) in [("keeping every proposal", keep_all), ("refused proposals redrawn from p", from_p)] {
            let dev: f64 =
                cells(&alt).iter().zip(&w).filter(|(_, e)| **e > 0.0).map(|(a, e)| (a - e).powi(2) / e).sum();
            let lambda = dev * n as f64;
            let power = normal_cdf((df + lambda - crit) / (2.0 * (df + 2.0 * lambda)).sqrt());
            eprintln!("{name}: power against {bug}: {power:.4} (noncentrality {lambda:.1})");
            assert!(power >= 0.99, "{name}: the test cannot tell {bug} apart (power {power:.3})");
        }
        let ecfg = EngineConfig { max_num_seqs: 64, speculative: Some(spec), ..Default::default() };
        let mut engine = Engine::new(m.clone(), ecfg).unwrap();
        let reqs: Vec<(u64, Request)> = (0..n)
            .map(|i| (0, Request::new(prompt.clone(), 3).with_sampling(Sampling::sample(t).with_seed(1000 + i as u64))))
            .collect();
        let got = support::serve_arrivals(&mut engine, &reqs);
        let mut counts = vec![0f64; v * v];
        for (tokens, _) in &got {
            counts[tokens[1] as usize * v + tokens[2] as usize] += 1.0;
        }
        let c = cells(&counts);
        let chi2: f64 = c.iter().zip(&w).map(|(o, e)| (o - e * n as f64).powi(2) / (e * n as f64)).sum();
        let st = engine.stats();
        report(name, &st);
        eprintln!("{name}: chi-square {chi2:.1} over {} cells (critical {crit:.1} at 1e-3)", c.len());
        assert!(st.spec_accepted_tokens > 0 && st.spec_accepted_tokens < st.spec_proposed_tokens, "{st:?}");
        assert!(
            chi2 < crit,
            "{name}: the outputs do not follow the model's distribution (chi-square {chi2:.1} >= {crit:.1})"
        );
    }
}

/// `/metrics` reports speculation: proposed and kept tokens, the acceptance
/// rate and tokens per verifying step (a draft that is the model itself:
/// every proposal kept).
#[test]
fn metrics_report_the_acceptance_rate() {
    let m = model(3, 96, 1);
    let spec = Speculation::Draft { model: Box::new(m.clone()), k: 3 };
    let handle = kiln::nn::serve::EngineHandle::spawn(Engine::new(m, cfg(Some(spec))).unwrap()).unwrap();
    let events: Vec<Event> = handle.submit(Request::new(repetitive(10, 1), 21)).unwrap().collect();
    assert_eq!(events.len(), 22);
    // The metrics are the engine thread's snapshot after its step: wait for the last one.
    let t0 = std::time::Instant::now();
    while handle.metrics().engine.spec_emitted_tokens < 20 && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let text = handle.metrics().to_prometheus();
    let value = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("kiln_{name} ")))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    // The prompt's step gives the first token; five steps of three kept proposals and one more the other 20.
    assert_eq!((value("spec_proposed_tokens_total"), value("spec_accepted_tokens_total")), (15.0, 15.0));
    assert_eq!((value("spec_acceptance_rate"), value("spec_tokens_per_step")), (1.0, 4.0));
}
