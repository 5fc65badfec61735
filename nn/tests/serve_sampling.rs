//! The serving engine's sampling surface (`kiln::nn::serve`): log-probabilities
//! equal `log_softmax` of a plain forward's logits; repetition, presence and
//! frequency penalties and logit biases steer decoding as their definitions
//! say (the repetition penalty as transformers' processor computes it); the
//! choices of one prompt share its KV blocks (Note [Shared prompts wait]).
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::serve::{process_logits, Engine, EngineConfig, Event, Penalties, Request, TokenLogprobs};
use kiln::prelude::*;
use std::collections::BTreeMap;

mod support;

fn model() -> LlamaForCausalLM {
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256}"#,
    )
    .unwrap();
    let _rng = support::rng_lock();
    kiln::manual_seed(5);
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap()
}

fn prompt(len: usize, seed: u64) -> Vec<i64> {
    support::random_tokens(len, seed, 96)
}

/// Each request's tokens and log-probabilities, all submitted at once.
fn serve(engine: &mut Engine, reqs: &[Request]) -> Vec<Vec<(i64, Option<TokenLogprobs>)>> {
    let ids: Vec<u64> = reqs.iter().map(|r| engine.add_request(r.clone()).unwrap()).collect();
    let mut got: BTreeMap<u64, Vec<(i64, Option<TokenLogprobs>)>> = BTreeMap::new();
    let mut steps = 0;
    while engine.has_work() {
        for o in engine.step() {
            match o.event {
                Event::Token(t, lp) => got.entry(o.id).or_default().push((t, lp)),
                Event::Finished(f) => assert!(matches!(f, kiln::nn::serve::FinishReason::Length), "{f:?}"),
            }
        }
        steps += 1;
        assert!(steps < 10_000);
    }
    ids.iter().map(|id| got.remove(id).unwrap()).collect()
}

/// The logits `[1, vocab]` a plain forward gives the position after `tokens`.
fn last_logits(m: &LlamaForCausalLM, tokens: &[i64]) -> Tensor {
    let x = Tensor::from_vec(tokens.to_vec(), &[1, tokens.len()]).unwrap();
    let l = m.forward(&x, None).unwrap();
    l.narrow(1, tokens.len() as isize - 1, 1).unwrap().squeeze_dim(1).unwrap()
}

#[test]
fn logprobs_are_log_softmax_of_a_plain_forward() {
    let _invariant = support::batch_invariance(true);
    let m = model();
    let cfg = EngineConfig { block_size: 4, max_batched_tokens: 32, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs = [
        Request::new(prompt(9, 1), 12).with_logprobs(5),
        Request::new(prompt(30, 2), 10).with_sampling(Sampling::sample(0.9).with_seed(4)).with_logprobs(3),
        // Biased: the reported log-probabilities are still the model's own.
        Request::new(prompt(5, 3), 8).with_logprobs(0).with_logit_bias(&[(7, 100.0)]),
    ];
    let got = serve(&mut engine, &reqs);
    // Paged attention against a plain forward under batch-invariant kernels:
    // the worst difference measured over these requests is 0 (bit-equal);
    // the bound allows two float32 ulps at the magnitude of these values (~4).
    let tol = 1e-6f32;
    let mut worst = 0f32;
    for (r, out) in reqs.iter().zip(&got) {
        let mut seq = r.prompt.clone();
        for (t, lp) in out {
            let lp = lp.as_ref().expect("asked for logprobs");
            let want = last_logits(&m, &seq).log_softmax(-1).unwrap().to_vec::<f32>().unwrap();
            let d = (lp.logprob - want[*t as usize]).abs();
            worst = worst.max(d);
            assert!(d <= tol, "token {t}: logprob {} vs {}", lp.logprob, want[*t as usize]);
            let k = r.logprobs.unwrap();
            assert_eq!(lp.top.len(), k);
            let mut order: Vec<usize> = (0..want.len()).collect();
            order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
            for (j, &(id, v)) in lp.top.iter().enumerate() {
                assert_eq!(id as usize, order[j], "top {j} of the step after {} tokens", seq.len());
                assert!((v - want[order[j]]).abs() <= tol);
            }
            seq.push(*t);
        }
    }
    // The bias forced its token, whose log-probability is not near 0.
    assert!(got[2].iter().all(|(t, _)| *t == 7));
    assert!(got[2].iter().any(|(_, lp)| lp.as_ref().unwrap().logprob < -1.0));
    eprintln!("worst logprob difference from a plain forward: {worst:e}");
}

/// The definitions, written out: transformers' repetition penalty over
/// prompt and output, OpenAI's presence and frequency penalties over the
/// output, then the bias.
fn reference_step(logits: &[f32], prompt: usize, seq: &[i64], p: Penalties, bias: &[(i64, f32)]) -> Vec<f32> {
    let mut x = logits.to_vec();
    for &(t, b) in bias {
        x[t as usize] += b;
    }
    let mut seen = std::collections::BTreeSet::new();
    for &t in seq {
        if seen.insert(t) {
            let l = x[t as usize];
            x[t as usize] = if l < 0.0 { l * p.repetition } else { l / p.repetition };
        }
    }
    for (t, l) in x.iter_mut().enumerate() {
        let c = seq[prompt..].iter().filter(|&&u| u == t as i64).count() as f32;
        *l -= c * p.frequency + if c > 0.0 { p.presence } else { 0.0 };
    }
    x
}

#[test]
fn penalties_and_biases_steer_greedy_decoding_as_defined() {
    let _invariant = support::batch_invariance(true);
    let m = model();
    let mut engine = Engine::new(m.clone(), EngineConfig { block_size: 4, ..Default::default() }).unwrap();
    let pens = [
        Penalties { repetition: 1.6, presence: 0.0, frequency: 0.0 },
        Penalties { repetition: 1.0, presence: 0.8, frequency: 0.0 },
        Penalties { repetition: 1.0, presence: 0.0, frequency: 0.9 },
        Penalties { repetition: 0.7, presence: -0.3, frequency: 0.4 },
    ];
    let p = prompt(12, 9);
    let plain = generate(&m, &Tensor::from_vec(p.clone(), &[1, 12]).unwrap(), 24, &Sampling::greedy()).unwrap();
    let plain = plain.to_vec::<i64>().unwrap()[12..].to_vec();
    let bias = [(plain[0], -100.0f32), (plain[3], 3.0)];
    let mut reqs: Vec<Request> = pens.iter().map(|&q| Request::new(p.clone(), 24).with_penalties(q)).collect();
    reqs.push(Request::new(p.clone(), 24).with_logit_bias(&bias));
    let got = serve(&mut engine, &reqs);
    for (r, out) in reqs.iter().zip(&got) {
        let tokens: Vec<i64> = out.iter().map(|(t, _)| *t).collect();
        assert_ne!(tokens, plain, "{:?} / {:?} changed nothing", r.penalties, r.logit_bias);
        let mut seq = p.clone();
        for &t in &tokens {
            let l = last_logits(&m, &seq).to_vec::<f32>().unwrap();
            let x = reference_step(&l, p.len(), &seq, r.penalties, &r.logit_bias);
            // Near-ties: within the bound of the logprobs test above.
            let best = (0..x.len()).max_by(|&a, &b| x[a].total_cmp(&x[b])).unwrap();
            assert!(x[best] - x[t as usize] <= 1e-6, "{:?}: token {t} where the definition gives {best}", r.penalties);
            seq.push(t);
        }
    }
}

#[test]
fn repetition_penalty_equals_transformers_processor() {
    let python = support::python_with_transformers();
    let v = 50;
    let logits: Vec<f32> = (0..v).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
    let tokens: Vec<i64> = vec![3, 3, 7, 12, 40, 7, 0, 49, 20];
    let r = Request::new(tokens[..4].to_vec(), 1).with_penalties(Penalties {
        repetition: 1.37,
        presence: 0.0,
        frequency: 0.0,
    });
    let ours = process_logits(&Tensor::from_vec(logits.clone(), &[1, v]).unwrap(), &r, &tokens).unwrap();
    let script = format!(
        "import torch, json\nfrom transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor as P\n\
         x = torch.tensor([{logits:?}], dtype=torch.float32)\nids = torch.tensor([{tokens:?}])\n\
         print(json.dumps([float(v) for v in P(1.37)(ids, x)[0]]))"
    );
    let out = std::process::Command::new(python).arg("-c").arg(script).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<f32> = serde_json::from_slice(&out.stdout).unwrap();
    // Elementwise float32: bit-equal.
    assert_eq!(ours.to_vec::<f32>().unwrap(), want);
}

#[test]
fn choices_of_one_prompt_share_its_blocks() {
    let _invariant = support::batch_invariance(true);
    let m = model();
    let cfg = EngineConfig { block_size: 4, max_batched_tokens: 64, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let p = prompt(42, 11);
    let reqs: Vec<Request> = (0..3)
        .map(|i| Request::new(p.clone(), 9).with_sampling(Sampling::sample(1.0).with_top_k(20).with_seed(30 + i)))
        .collect();
    let got = serve(&mut engine, &reqs);
    let st = engine.stats();
    // The first computes the prompt; the others wait for its blocks and
    // compute only the last, partial block: (42 - 1) / 4 = 10 shared blocks.
    assert_eq!(st.prefix_hit_tokens, 2 * 40, "{st:?}");
    assert_eq!(st.prefill_tokens, 42 + 2 * 2, "{st:?}");
    for (r, out) in reqs.iter().zip(&got) {
        let x = Tensor::from_vec(p.clone(), &[1, p.len()]).unwrap();
        let want = generate(&m, &x, 9, &r.sampling).unwrap().to_vec::<i64>().unwrap()[p.len()..].to_vec();
        assert_eq!(out.iter().map(|(t, _)| *t).collect::<Vec<_>>(), want);
    }
    assert_ne!(got[0], got[1], "seeds 30 and 31 drew the same tokens");
}

#[test]
fn process_logits_refuses_what_does_not_fit() {
    let l = Tensor::zeros(&[1, 8], DType::F32).unwrap();
    let r = |bias: (i64, f32)| Request::new(vec![1, 2], 4).with_logit_bias(&[bias]);
    for (req, what) in [
        (r((8, 1.0)), "outside the vocabulary"),
        (r((-1, 1.0)), "outside the vocabulary"),
        (r((3, f32::NAN)), "logit bias"),
        (
            Request::new(vec![1], 4).with_penalties(Penalties { repetition: f32::NAN, ..Default::default() }),
            "repetition",
        ),
        (Request::new(vec![9], 4), "outside the vocabulary"),
    ] {
        let e = process_logits(&l, &req, &req.prompt).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
    for bad in [Tensor::zeros(&[2, 8], DType::F32).unwrap(), Tensor::zeros(&[8], DType::F32).unwrap()] {
        let e = process_logits(&bad, &r((1, 1.0)), &[1, 2]).unwrap_err().to_string();
        assert!(e.contains("[1, vocab]"), "{e}");
    }
    let ok = process_logits(&l, &r((3, 2.5)), &[1, 2]).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(ok, [0.0, 0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0]);
}
