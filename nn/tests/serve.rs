//! The serving engine (`kiln::nn::serve`): continuous batching over a paged
//! KV cache gives each request exactly what `generate()` gives it alone
//! (Note [Batch invariance]), whatever else runs beside it, with chunked
//! prefill, arrivals over time, prefix sharing and preemption; requests that
//! cannot run are refused with a clear error.
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::quantize::{quantize_model, QuantScheme};
use kiln::nn::serve::{Engine, EngineConfig, Event, FinishReason, PagedKvCache, Request};
use kiln::nn::Module;
use kiln::prelude::*;

mod support;

fn model(seed: u64) -> LlamaForCausalLM {
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512}"#,
    )
    .unwrap();
    // Seeded draws from the global generator, not interleaved with another test's.
    let _rng = support::rng_lock();
    kiln::manual_seed(seed);
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap()
}

/// A prompt of `len` tokens of the test models' vocabulary, drawn from `seed`.
fn prompt(len: usize, seed: u64) -> Vec<i64> {
    support::random_tokens(len, seed, 96)
}

/// The new tokens `generate()` gives the request alone.
fn alone(m: &LlamaForCausalLM, r: &Request) -> Vec<i64> {
    let p = Tensor::from_vec(r.prompt.clone(), &[1, r.prompt.len()]).unwrap();
    let s = r.sampling.clone().with_eos(&r.stop_token_ids);
    let out = generate(m, &p, r.max_new_tokens, &s).unwrap().to_vec::<i64>().unwrap();
    let mut new = out[r.prompt.len()..].to_vec();
    // generate() pads a finished row with the stop token: the stream ends at the first.
    if let Some(i) = new.iter().position(|t| r.stop_token_ids.contains(t)) {
        new.truncate(i + 1);
    }
    new
}

/// Runs the engine, submitting `arrivals[i].1` once `arrivals[i].0` steps have
/// run; returns each request's tokens and end by submission order.
fn serve(engine: &mut Engine, arrivals: Vec<(u64, Request)>) -> Vec<(Vec<i64>, FinishReason)> {
    support::serve_arrivals(engine, &arrivals)
}

fn requests() -> Vec<(u64, Request)> {
    let sampled = |t: f64, seed: u64| Sampling::sample(t).with_top_k(40).with_top_p(0.9).with_seed(seed);
    vec![
        (0, Request::new(prompt(3, 1), 20)),
        (0, Request::new(prompt(41, 2), 12).with_sampling(sampled(0.8, 7))),
        (1, Request::new(prompt(70, 3), 25)),
        (2, Request::new(prompt(1, 4), 30).with_sampling(sampled(1.3, 8))),
        (5, Request::new(prompt(17, 5), 16)),
        (9, Request::new(prompt(33, 6), 9).with_sampling(sampled(0.5, 9))),
        (9, Request::new(prompt(8, 7), 40)),
    ]
}

fn check(m: &LlamaForCausalLM, reqs: &[(u64, Request)], got: &[(Vec<i64>, FinishReason)]) {
    for ((_, r), (tokens, why)) in reqs.iter().zip(got) {
        let want = alone(m, r);
        assert_eq!(
            tokens,
            &want,
            "prompt of {} tokens: the engine's tokens (ended by {why:?}) differ from generate()'s",
            r.prompt.len()
        );
        let stopped = want.last().is_some_and(|t| r.stop_token_ids.contains(t));
        assert_eq!(*why, if stopped { FinishReason::Stop } else { FinishReason::Length });
    }
}

#[test]
fn batched_requests_equal_generate_alone() {
    let _invariant = support::batch_invariance(true);
    let m = model(0);
    // Small steps force chunked prefill; small blocks cross many block edges.
    let cfg = EngineConfig { block_size: 4, max_batched_tokens: 24, max_num_seqs: 4, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs = requests();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
    let st = engine.stats();
    assert!(st.steps > 0 && st.kv_blocks_used == 0 && st.running == 0 && st.waiting == 0, "{st:?}");
    assert_eq!(st.generated_tokens as usize, got.iter().map(|g| g.0.len()).sum::<usize>());
    assert_eq!(st.ttft_count as usize, reqs.len());
    assert!(st.ttft_quantile(0.5).is_some() && st.ttft_quantile(0.5) <= st.ttft_quantile(0.99));
}

#[test]
fn kept_quantized_models_serve_what_generate_gives() {
    let _invariant = support::batch_invariance(true);
    for scheme in [QuantScheme::Nvfp4, QuantScheme::Fp8Block([16, 16])] {
        let mut m = model(3);
        quantize_model(&mut m, scheme).unwrap();
        let cfg = EngineConfig { block_size: 8, max_batched_tokens: 32, max_num_seqs: 3, ..Default::default() };
        let mut engine = Engine::new(m.clone(), cfg).unwrap();
        let reqs: Vec<(u64, Request)> = requests().into_iter().take(5).collect();
        let got = serve(&mut engine, reqs.clone());
        check(&m, &reqs, &got);
    }
}

/// A Qwen3-MoE model (sparse and dense layers) serves what generate() gives:
/// tokens are routed row by row, so an expert's group changes with the batch
/// while each row's product does not.
#[test]
fn moe_models_serve_what_generate_gives() {
    let _invariant = support::batch_invariance(true);
    let m = moe_model();
    let ecfg = EngineConfig { block_size: 4, max_batched_tokens: 24, max_num_seqs: 4, ..Default::default() };
    let mut engine = Engine::new(m.clone(), ecfg).unwrap();
    let reqs = requests();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
}

/// On PJRT a Qwen3-MoE model decodes through captured programs (its
/// experts run as grouped products, nothing read on the host), with the
/// tokens generate() gives on the same device.
#[test]
fn pjrt_serves_moe_models_through_captured_programs() {
    let _one = pjrt_lock();
    support::register_tpu();
    let mut m = moe_model();
    m.to_device(Device::Tpu(0)).unwrap();
    let cfg = EngineConfig { block_size: 8, max_batched_tokens: 32, max_num_seqs: 4, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs: Vec<(u64, Request)> = requests().into_iter().take(4).collect();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
    let st = engine.stats();
    assert!(st.decode_traces >= 1 && st.decode_replays >= 1, "{st:?}");
}

/// Held by this binary's PJRT tests, one at a time.
fn pjrt_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A small Qwen3-MoE model: a dense first layer, then a sparse one.
fn moe_model() -> LlamaForCausalLM {
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true,
            "mlp_only_layers": [0], "max_position_embeddings": 512}"#,
    )
    .unwrap();
    let _rng = support::rng_lock();
    kiln::manual_seed(11);
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap()
}

/// On PJRT, decoding sequences run through one captured program per
/// batch-size bucket (Note [Step programs]): traced twice per bucket, then
/// replayed, with the tokens `generate()` gives on the same device.
#[test]
fn pjrt_decodes_through_one_captured_program_per_bucket() {
    let _one = pjrt_lock();
    support::register_tpu();
    let mut m = model(5);
    m.to_device(Device::Tpu(0)).unwrap();
    let cfg = EngineConfig { block_size: 8, max_batched_tokens: 32, max_num_seqs: 4, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs = requests();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
    let st = engine.stats();
    // Buckets 1, 2 and 4: at most two traces each, every other decode step a replay.
    assert!(st.decode_traces >= 2 && st.decode_traces <= 6, "{st:?}");
    assert!(st.decode_replays > 20, "{st:?}");
    assert_eq!(st.kv_blocks_used, 0);
}

/// On PJRT, prompt chunks run through captured chunk programs too (Note
/// [Step programs]): once every bucket is traced, serving the same
/// requests again runs no model op outside a program: the PJRT executions
/// are the programs' calls and the sampler's ops (greedy: a concatenation
/// and an argmax per step, slicing padded rows off the decode logits);
/// with prompt chunks run eagerly, each chunk would add one execution per op.
#[test]
fn pjrt_prefills_through_captured_chunk_programs() {
    // The PJRT execution counter is the process's: no other PJRT test runs meanwhile.
    let _one = pjrt_lock();
    support::register_tpu();
    let mut m = model(5);
    m.to_device(Device::Tpu(0)).unwrap();
    let cfg = EngineConfig { block_size: 8, max_batched_tokens: 32, max_num_seqs: 4, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs: Vec<(u64, Request)> = requests().into_iter().filter(|(_, r)| r.sampling.is_greedy()).collect();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
    let (st0, ex0) = (engine.stats(), kiln::tpu::stats().unwrap().executions);
    let again = serve(&mut engine, reqs.clone());
    assert_eq!(again, got);
    let (st, ex) = (engine.stats(), kiln::tpu::stats().unwrap().executions - ex0);
    let calls =
        |s: &kiln::nn::serve::EngineStats| s.decode_traces + s.decode_replays + s.chunk_traces + s.chunk_replays;
    let (programs, steps) = (calls(&st) - calls(&st0), st.steps - st0.steps);
    eprintln!("{steps} steps: {ex} PJRT executions, {programs} program calls");
    assert!(st.chunk_traces >= 2 && st.chunk_replays > st0.chunk_replays, "{st:?}");
    assert!(ex <= programs + 3 * steps, "{ex} executions for {programs} program calls in {steps} steps");
}

/// A stop string ends a request at the token that completes it, however
/// long the output and however many tokens decode to nothing (the engine
/// decodes only a window of the latest tokens).
#[test]
fn stop_strings_end_a_request_at_the_token_that_completes_them() {
    let _invariant = support::batch_invariance(true);
    let m = model(6);
    // Every third token decodes to nothing (as special tokens do), the others to one letter.
    let text = |t: &[i64]| -> String {
        t.iter().filter(|&&x| x % 3 != 0).map(|&x| char::from(b'a' + (x % 26) as u8)).collect()
    };
    let d: kiln::nn::serve::Detokenizer = std::sync::Arc::new(move |t: &[i64]| text(t));
    let free = alone(&m, &Request::new(prompt(9, 11), 60));
    for k in [3usize, 25, 59] {
        // The stop string: the text of tokens k-7..=k; the request must end
        // at the first token whose text contains it.
        let stop = text(&free[k.saturating_sub(7)..=k]);
        assert!(!stop.is_empty());
        let end = (0..free.len()).find(|&j| text(&free[..=j]).contains(&stop)).unwrap();
        let cfg = EngineConfig { detokenizer: Some(d.clone()), ..Default::default() };
        let mut engine = Engine::new(m.clone(), cfg).unwrap();
        let r = Request::new(prompt(9, 11), 60).with_stop_strings(&[stop.as_str()]);
        let got = serve(&mut engine, vec![(0, r)]);
        assert_eq!(got[0], (free[..=end].to_vec(), FinishReason::Stop), "stop string {stop:?}");
    }
}

#[test]
fn stop_tokens_end_a_request_and_free_its_place() {
    let _invariant = support::batch_invariance(true);
    let m = model(1);
    let base = Request::new(prompt(12, 11), 30);
    let third = alone(&m, &base)[2];
    let reqs = vec![(0, base.clone().with_stop_tokens(&[third])), (0, Request::new(prompt(5, 12), 10))];
    let mut engine = Engine::new(m.clone(), EngineConfig { max_num_seqs: 1, ..Default::default() }).unwrap();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
    assert_eq!(got[0].1, FinishReason::Stop);
    assert_eq!(got[0].0.last(), Some(&third));
}

/// A shared system prompt is computed once: later requests find its blocks,
/// and their tokens are still generate()'s.
#[test]
fn shared_prefixes_are_computed_once() {
    let _invariant = support::batch_invariance(true);
    let m = model(2);
    let system = prompt(48, 21);
    let reqs: Vec<(u64, Request)> = (0..4)
        .map(|i| {
            let mut p = system.clone();
            p.extend(prompt(5 + 3 * i as usize, 30 + i));
            (i * 3, Request::new(p, 8))
        })
        .collect();
    for sharing in [true, false] {
        let cfg = EngineConfig { block_size: 8, prefix_sharing: sharing, ..Default::default() };
        let mut engine = Engine::new(m.clone(), cfg).unwrap();
        let got = serve(&mut engine, reqs.clone());
        check(&m, &reqs, &got);
        let hits = engine.stats().prefix_hit_tokens;
        if sharing {
            // The first request computes the 48 shared tokens; each later one finds 6 blocks of 8.
            assert_eq!(hits, 3 * 48);
        } else {
            assert_eq!(hits, 0);
        }
    }
}

/// A pool too small for every request at once: sequences are preempted and
/// recomputed, never crashed, and their tokens do not change.
#[test]
fn preemption_under_a_small_pool_keeps_the_tokens() {
    let _invariant = support::batch_invariance(true);
    let m = model(3);
    let per_block = PagedKvCache::bytes_per_block(&m, 4, m.dtype());
    // 40 blocks of 4 positions: each request needs up to 28 blocks alone.
    let cfg =
        EngineConfig { block_size: 4, kv_cache_bytes: 40 * per_block, max_batched_tokens: 32, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs: Vec<(u64, Request)> =
        (0..5).map(|i| (i, Request::new(prompt(30 + 7 * i as usize, 40 + i), 40))).collect();
    let got = serve(&mut engine, reqs.clone());
    check(&m, &reqs, &got);
    assert!(engine.stats().preemptions > 0, "{:?}", engine.stats());
}

/// Preemption with sampled requests and with shared prefix blocks: a
/// preempted sequence keeps the tokens it drew and its generator's state
/// (recomputing its keys draws nothing), and giving back blocks that other
/// sequences share leaves theirs intact; every request's tokens are
/// generate()'s alone.
#[test]
fn preemption_keeps_sampled_tokens_and_shared_prefixes() {
    let _invariant = support::batch_invariance(true);
    let m = model(6);
    let per_block = PagedKvCache::bytes_per_block(&m, 4, m.dtype());
    let system = prompt(24, 61);
    let reqs: Vec<(u64, Request)> = (0..6)
        .map(|i| {
            let mut p = if i % 2 == 0 { system.clone() } else { vec![] };
            p.extend(prompt(9 + 5 * i as usize, 70 + i));
            let s = Sampling::sample(0.6 + 0.15 * i as f64).with_top_k(30).with_top_p(0.95).with_seed(80 + i);
            (i, Request::new(p, 36).with_sampling(if i == 3 { Sampling::greedy() } else { s }))
        })
        .collect();
    for sharing in [true, false] {
        // 44 blocks of 4 positions: each request needs up to 24 blocks alone.
        let cfg = EngineConfig {
            block_size: 4,
            kv_cache_bytes: 44 * per_block,
            max_batched_tokens: 32,
            prefix_sharing: sharing,
            ..Default::default()
        };
        let mut engine = Engine::new(m.clone(), cfg).unwrap();
        let got = serve(&mut engine, reqs.clone());
        check(&m, &reqs, &got);
        let st = engine.stats();
        assert!(st.preemptions > 0, "sharing {sharing}: {st:?}");
        assert_eq!(st.prefix_hit_tokens > 0, sharing, "sharing {sharing}: {st:?}");
        assert_eq!(st.kv_blocks_used, 0, "every block comes back: {st:?}");
    }
}

/// A model step that fails (sampling from NaN logits) ends every sequence
/// of the step with `FinishReason::Error` and the op's message, frees their
/// blocks, and the engine goes on serving the next request.
#[test]
fn a_failed_step_ends_its_sequences_with_the_error() {
    let broken = model(8);
    {
        let _g = kiln::autograd::no_grad();
        let named = broken.named_parameters();
        let (_, head) = named.iter().find(|(n, _)| n == "lm_head.weight").expect("an untied head");
        head.fill_(f64::NAN).unwrap();
    }
    let mut engine = Engine::new(broken, EngineConfig { block_size: 4, ..Default::default() }).unwrap();
    let sampled = Request::new(prompt(6, 91), 5).with_sampling(Sampling::sample(1.0).with_seed(1));
    let greedy = Request::new(prompt(9, 92), 5);
    let got = serve(&mut engine, vec![(0, sampled), (0, greedy)]);
    for (tokens, why) in &got {
        assert!(tokens.is_empty(), "no token before the failure: {tokens:?}");
        match why {
            FinishReason::Error(e) => assert!(e.contains("probability tensor contains either `inf`, `nan`"), "{e}"),
            other => panic!("expected an error finish, got {other:?}"),
        }
    }
    let st = engine.stats();
    assert_eq!((st.running, st.kv_blocks_used), (0, 0), "{st:?}");
    // The engine goes on: greedy decoding of NaN logits is argmax's answer (NaN
    // counts as the largest), so a greedy request alone runs to its length.
    let after = serve(&mut engine, vec![(0, Request::new(prompt(4, 93), 3))]);
    assert_eq!(after[0], (vec![0, 0, 0], FinishReason::Length));
}

#[test]
fn bad_requests_are_refused() {
    let m = model(4);
    let per_block = PagedKvCache::bytes_per_block(&m, 16, m.dtype());
    let mut engine = Engine::new(m, EngineConfig { kv_cache_bytes: 8 * per_block, ..Default::default() }).unwrap();
    let mut err = |r: Request| engine.add_request(r).unwrap_err().to_string();
    assert!(err(Request::new(vec![], 4)).contains("empty"));
    assert!(err(Request::new(vec![1, 96], 4)).contains("token 96"));
    assert!(err(Request::new(vec![1, -1], 4)).contains("token -1"));
    assert!(err(Request::new(vec![1], 0)).contains("at least 1"));
    // 8 blocks of 16 hold 128 positions, less than the model's 512.
    assert!(err(Request::new(vec![1; 100], 29)).contains("context of 128"));
    assert!(err(Request::new(vec![1], usize::MAX)).contains("exceed"));
    assert!(err(Request::new(vec![1], 4).with_stop_strings(&["x"])).contains("detokenizer"));
    assert!(err(Request::new(vec![1], 4).with_sampling(Sampling::sample(f64::NAN))).contains("temperature"));
    assert!(!engine.has_work());
    assert!(Engine::new(model(4), EngineConfig { max_num_seqs: 0, ..Default::default() }).is_err());
    // Sizes past usize or a zero block size are errors, not panics.
    assert!(Engine::new(model(4), EngineConfig { block_size: usize::MAX, ..Default::default() }).is_err());
    use kiln::nn::serve::{PagedBatch, SeqChunk};
    let chunk = |start: usize| [SeqChunk { tokens: &[1, 2], start, blocks: &[0], logits: 1 }];
    assert!(PagedBatch::new(&chunk(0), 0, Device::Cpu).is_err());
    assert!(PagedBatch::new(&chunk(usize::MAX), 4, Device::Cpu).is_err());
    assert!(PagedBatch::new(&chunk(0), 4, Device::Cpu).is_ok());
}

/// The paged forward gives a sequence's logits bit for bit as incremental
/// decoding of it alone does, with its prompt in chunks and other sequences
/// packed beside it (Note [Batch invariance]).
#[test]
fn paged_logits_are_those_of_incremental_decoding() {
    let _invariant = support::batch_invariance(true);
    paged_logits_equal_incremental_ones(&model(5));
}

/// The same for a bfloat16 model (its KV cache bfloat16 too): its paged
/// logits agree with incremental decoding's to rounding, as the README says
/// (not bit for bit: greedy tokens may then differ where two logits are
/// within rounding of each other).
#[test]
fn bf16_paged_logits_agree_to_rounding() {
    let _invariant = support::batch_invariance(true);
    let mut m = model(9);
    m.to_dtype(DType::BF16).unwrap();
    assert_eq!(m.dtype(), DType::BF16);
    paged_logits_equal_incremental_ones(&m);
}

fn paged_logits_equal_incremental_ones(m: &LlamaForCausalLM) {
    use kiln::nn::serve::{PagedBatch, SeqChunk};
    let (a, b) = (prompt(23, 51), prompt(9, 52));
    let ta = Tensor::from_vec(a.clone(), &[1, a.len()]).unwrap();
    let mut cache = m.new_cache(64);
    let f32s = |t: Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    let want = f32s(m.forward_cached(&ta, None, &mut cache, true).unwrap());
    let pool = PagedKvCache::new(m, 16, 4, m.dtype()).unwrap();
    let blocks_a: Vec<usize> = vec![7, 2, 9, 0, 11, 3];
    let blocks_b: Vec<usize> = vec![5, 14, 1];
    // Step 1: a's first 10 tokens and all of b; step 2: the rest of a.
    let step1 = [
        SeqChunk { tokens: &a[..10], start: 0, blocks: &blocks_a, logits: 0 },
        SeqChunk { tokens: &b, start: 0, blocks: &blocks_b, logits: 1 },
    ];
    m.forward_paged(&PagedBatch::new(&step1, 4, Device::Cpu).unwrap(), &pool).unwrap();
    let step2 = [SeqChunk { tokens: &a[10..], start: 10, blocks: &blocks_a, logits: 1 }];
    let got = m.forward_paged(&PagedBatch::new(&step2, 4, Device::Cpu).unwrap(), &pool).unwrap();
    assert_eq!((got.shape(), got.dtype()), (&[1usize, 96][..], m.dtype()));
    let got = f32s(got);
    if m.dtype() == DType::F32 {
        assert!(
            got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
            "the paged logits differ in their bits"
        );
    } else {
        // bfloat16 agrees to rounding: within two bfloat16 ulps of the largest
        // logit (measured: 30 of 96 logits differ, by at most 9.8e-4, a
        // quarter of the bound, at a largest logit of 0.33).
        let largest = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        let bound = 2.0 * 2f32.powi(largest.log2().floor() as i32 - 7);
        let worst = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        eprintln!("bf16 paged logits: max |diff| {worst} (bound {bound})");
        assert!(worst <= bound, "bf16 paged logits {worst} from incremental decoding's (bound {bound})");
    }
}

fn wait_for(handle: &kiln::nn::serve::EngineHandle, what: &str, f: impl Fn(&kiln::nn::serve::Metrics) -> bool) {
    let t0 = std::time::Instant::now();
    while !f(&handle.metrics()) {
        assert!(t0.elapsed().as_secs() < 60, "timed out waiting for {what}: {:?}", handle.metrics());
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn tokens_of(events: impl IntoIterator<Item = Event>) -> (Vec<i64>, Option<FinishReason>) {
    let (mut t, mut end) = (vec![], None);
    for e in events {
        assert!(end.is_none(), "an event after the end");
        match e {
            Event::Token(x, _) => t.push(x),
            Event::Finished(f) => end = Some(f),
        }
    }
    (t, end)
}

/// The handle from several threads at once and from async tasks: every stream
/// carries generate()'s tokens for its request, then its end.
#[test]
fn the_handle_serves_threads_and_async_tasks() {
    use kiln::nn::serve::EngineHandle;
    let _invariant = support::batch_invariance(true);
    let m = model(6);
    let cfg = EngineConfig { block_size: 8, max_batched_tokens: 48, ..Default::default() };
    let handle = EngineHandle::spawn(Engine::new(m.clone(), cfg).unwrap()).unwrap();
    let reqs: Vec<Request> = requests().into_iter().map(|(_, r)| r).collect();
    let threads: Vec<_> = reqs
        .iter()
        .cloned()
        .map(|r| {
            let h = handle.clone();
            std::thread::spawn(move || tokens_of(h.submit(r).unwrap()))
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let from_async: Vec<(Vec<i64>, Option<FinishReason>)> = rt.block_on(async {
        let mut streams: Vec<_> = reqs.iter().take(3).map(|r| handle.submit(r.clone()).unwrap()).collect();
        let mut out = vec![];
        for s in &mut streams {
            let mut events = vec![];
            while let Some(e) = s.next_event().await {
                events.push(e);
            }
            out.push(tokens_of(events));
        }
        out
    });
    for (r, t) in reqs.iter().zip(threads) {
        let (tokens, end) = t.join().unwrap();
        assert_eq!(tokens, alone(&m, r));
        assert_eq!(end, Some(FinishReason::Length));
    }
    for (r, (tokens, _)) in reqs.iter().zip(from_async) {
        assert_eq!(tokens, alone(&m, r));
    }
    wait_for(&handle, "an idle engine", |x| x.engine.running == 0 && x.queue_depth() == 0);
    let text = handle.metrics().to_prometheus();
    assert!(
        text.contains("kiln_generated_tokens_total ") && text.contains("kiln_time_to_first_token_seconds_count 10"),
        "{text}"
    );
}

/// A dropped stream cancels its request and frees its blocks; a full queue
/// refuses at once; bad requests are refused by the handle too.
#[test]
fn cancellation_backpressure_and_refusals() {
    use kiln::nn::serve::{EngineHandle, SubmitError};
    let m = model(7);
    let cfg = EngineConfig { max_num_seqs: 1, max_queue: 1, ..Default::default() };
    let handle = EngineHandle::spawn(Engine::new(m, cfg).unwrap()).unwrap();
    let mut long = handle.submit(Request::new(prompt(10, 61), 400)).unwrap();
    assert!(matches!(long.next(), Some(Event::Token(..))));
    wait_for(&handle, "a running sequence", |x| x.engine.running == 1);
    let queued = handle.submit(Request::new(prompt(4, 62), 3)).unwrap();
    wait_for(&handle, "a waiting request", |x| x.engine.waiting == 1);
    match handle.submit(Request::new(prompt(4, 63), 3)) {
        Err(e @ SubmitError::QueueFull(1)) => assert!(e.to_string().contains("queue is full")),
        other => panic!("expected a full queue, got {other:?}"),
    }
    assert!(matches!(handle.submit(Request::new(vec![], 3)), Err(SubmitError::Invalid(_))));
    // Cancelling the long request lets the queued one run and finish.
    drop(long);
    let (tokens, end) = tokens_of(queued);
    assert_eq!((tokens.len(), end), (3, Some(FinishReason::Length)));
    wait_for(&handle, "freed blocks", |x| x.engine.running == 0 && x.engine.kv_blocks_used == 0);
    assert!(handle.metrics().engine.generated_tokens < 400, "the cancelled request ran to its end");
}

/// `forward_decode` refuses out-of-range slots and positions and mismatched
/// inputs with errors; an empty batch gives empty logits.
#[test]
fn forward_decode_refuses_bad_inputs() {
    let m = model(7);
    let cache = PagedKvCache::new(&m, 4, 4, m.dtype()).unwrap();
    let rope = m.model.rotary().tables(0, 16, DType::F32, Device::Cpu).unwrap();
    let t = |v: Vec<i64>, s: &[usize]| Tensor::from_vec(v, s).unwrap();
    let batch = |slot: i64, pos: i64| kiln::nn::serve::DecodeBatch {
        input_ids: t(vec![5], &[1]),
        positions: t(vec![pos], &[1]),
        slots: t(vec![slot], &[1]),
        block_tables: t(vec![0, 1, 2, 3], &[1, 4]),
        context_lens: t(vec![pos + 1], &[1]),
    };
    assert_eq!(m.forward_decode(&batch(3, 3), &rope, &cache).unwrap().shape(), &[1, 96]);
    assert!(m.forward_decode(&batch(16, 3), &rope, &cache).is_err(), "slot past the pool");
    assert!(m.forward_decode(&batch(-20, 3), &rope, &cache).is_err(), "negative slot");
    assert!(m.forward_decode(&batch(3, 16), &rope, &cache).is_err(), "position past the tables");
    let mut bad = batch(3, 3);
    bad.positions = t(vec![1, 2], &[2]);
    assert!(m.forward_decode(&bad, &rope, &cache).is_err(), "positions of another length");
    let empty = kiln::nn::serve::DecodeBatch {
        input_ids: t(vec![], &[0]),
        positions: t(vec![], &[0]),
        slots: t(vec![], &[0]),
        block_tables: t(vec![], &[0, 4]),
        context_lens: t(vec![], &[0]),
    };
    assert_eq!(m.forward_decode(&empty, &rope, &cache).unwrap().shape(), &[0, 96]);
}

/// Two LoRA adapters served beside the base model (Note [Serving adapters]):
/// in one engine, with shared prompts and prefix sharing on, each request
/// gets the tokens `generate()` gives with its adapter alone (the same
/// computation) and those of the merged model; on PJRT the base rows keep
/// the captured decode step.
#[test]
fn several_adapters_are_served_beside_the_base_model() {
    use kiln::nn::lora::{
        inject_adapter, load_adapter, merge_and_unload, save_adapter, LoraConfig, LoraInit, TargetModules,
    };
    let _invariant = support::batch_invariance(true);
    let _one = pjrt_lock();
    support::register_tpu();
    let base = model(8);
    let dir = support::temp_dir("served-adapters");
    let make = |name: &str, r: usize, targets: TargetModules, seed: u64| {
        let mut m = base.clone();
        let mut c = LoraConfig::new(r, targets);
        c.lora_alpha = 2.0 * r as f64;
        c.init_lora_weights = LoraInit::Random;
        {
            let _rng = support::rng_lock();
            kiln::manual_seed(seed);
            inject_adapter(&mut m, &c).unwrap();
        }
        save_adapter(dir.join(name), &m, &c).unwrap();
    };
    make("a", 4, TargetModules::AllLinear, 1);
    make("b", 8, TargetModules::Names(vec!["q_proj".into(), "v_proj".into()]), 2);
    // A fresh base each time: merging writes into the weights in place, and a
    // clone of a model shares its parameters' storage (as in PyTorch).
    let with = |name: Option<&str>, merged: bool| {
        let mut m = model(8);
        if let Some(n) = name {
            load_adapter(&mut m, dir.join(n), false).unwrap();
            if merged {
                merge_and_unload(&mut m).unwrap();
            }
        }
        m
    };
    let shared = prompt(41, 11);
    let reqs = vec![
        (0, Request::new(shared.clone(), 12)),
        (0, Request::new(shared.clone(), 12).with_adapter("a")),
        (0, Request::new(shared.clone(), 12).with_adapter("b")),
        (1, Request::new(prompt(7, 12), 20).with_adapter("a")),
        (2, Request::new(prompt(19, 13), 15)),
        (3, Request::new(shared.clone(), 10).with_adapter("a")),
    ];
    for dev in [Device::Cpu, Device::Tpu(0)] {
        let mut m = base.clone();
        m.to_device(dev).unwrap();
        let cfg = EngineConfig { block_size: 4, max_batched_tokens: 48, max_num_seqs: 6, ..Default::default() };
        let mut engine = Engine::new(m, cfg).unwrap();
        engine.load_adapter("a", dir.join("a")).unwrap();
        engine.load_adapter("b", dir.join("b")).unwrap();
        assert!(engine.load_adapter("a", dir.join("b")).unwrap_err().to_string().contains("loaded already"));
        let e = engine.add_request(Request::new(prompt(3, 1), 2).with_adapter("c")).unwrap_err().to_string();
        assert!(e.contains("no adapter named \"c\""), "{e}");
        let got = serve(&mut engine, reqs.clone());
        for ((_, r), (tokens, _)) in reqs.iter().zip(&got) {
            let what = format!("{dev}, adapter {:?}, prompt of {}", r.adapter, r.prompt.len());
            let mut alone_model = with(r.adapter.as_deref(), false);
            alone_model.to_device(dev).unwrap();
            assert_eq!(tokens, &alone(&alone_model, r), "{what}: the adapter alone");
            let mut merged = with(r.adapter.as_deref(), true);
            merged.to_device(dev).unwrap();
            assert_eq!(tokens, &alone(&merged, r), "{what}: the merged model");
        }
        // The three adapters' answers to one prompt differ: each ran its own weights.
        assert!(got[0].0 != got[1].0 && got[1].0 != got[2].0 && got[0].0 != got[2].0, "{got:?}");
        let st = engine.stats();
        if dev != Device::Cpu {
            assert!(st.decode_replays > 0, "the base rows decode through the captured step: {st:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
