//! KV caches narrower than the model (Note [KV cache dtypes] in kiln-tensor):
//! bfloat16, float16 and float8 (e4m3fn with a scale per position and head)
//! under a float32 model. The engine gives each request what `generate()`
//! gives it alone with the same cache dtype, on the CPU and through PJRT's
//! captured programs; a block holds two to four times the tokens in the same
//! bytes, with logits near the float32 cache's.
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::layers::{load_rows, parse_kv_cache_dtype, store_rows};
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::serve::{Engine, EngineConfig, Event, PagedBatch, PagedKvCache, Request, SeqChunk};
use kiln::nn::Module;
use kiln::prelude::*;

mod support;

const VOCAB: u64 = 96;

fn model(seed: u64) -> LlamaForCausalLM {
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512}"#,
    )
    .unwrap();
    let _rng = support::rng_lock();
    kiln::manual_seed(seed);
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap()
}

fn prompt(len: usize, seed: u64) -> Vec<i64> {
    support::random_tokens(len, seed, VOCAB)
}

/// The new tokens `generate()` gives the request alone with a `kv` cache.
fn alone(m: &LlamaForCausalLM, r: &Request, kv: DType) -> Vec<i64> {
    let p = Tensor::from_vec(r.prompt.clone(), &[1, r.prompt.len()]).unwrap();
    let s = r.sampling.clone().with_kv_cache_dtype(kv);
    let out = generate(m, &p, r.max_new_tokens, &s).unwrap().to_vec::<i64>().unwrap();
    out[r.prompt.len()..].to_vec()
}

/// Each request's tokens, all submitted at once.
fn serve(engine: &mut Engine, reqs: &[Request]) -> Vec<Vec<i64>> {
    let ids: Vec<u64> = reqs.iter().map(|r| engine.add_request(r.clone()).unwrap()).collect();
    let mut got = vec![vec![]; reqs.len()];
    while engine.has_work() {
        for o in engine.step() {
            if let Event::Token(t, _) = o.event {
                got[ids.iter().position(|&i| i == o.id).unwrap()].push(t);
            }
        }
    }
    got
}

fn requests() -> Vec<Request> {
    let sampled = |seed| Sampling::sample(0.9).with_top_k(30).with_seed(seed);
    vec![
        Request::new(prompt(37, 1), 14),
        Request::new(prompt(5, 2), 20).with_sampling(sampled(3)),
        Request::new(prompt(61, 3), 9),
        Request::new(prompt(12, 4), 16).with_sampling(sampled(5)),
    ]
}

/// Continuous batching with chunked prefill over a narrow pool gives every
/// request generate()'s tokens under the same cache dtype.
#[test]
fn the_engine_serves_what_generate_gives_under_each_kv_dtype() {
    let _invariant = support::batch_invariance(true);
    let m = model(0);
    let reqs = requests();
    for kv in [DType::BF16, DType::F16, DType::F8E4M3FN] {
        let cfg = EngineConfig {
            block_size: 4,
            max_batched_tokens: 24,
            max_num_seqs: 4,
            kv_cache_dtype: Some(kv),
            ..Default::default()
        };
        let mut engine = Engine::new(m.clone(), cfg).unwrap();
        let got = serve(&mut engine, &reqs);
        for (r, tokens) in reqs.iter().zip(&got) {
            assert_eq!(tokens, &alone(&m, r, kv), "{kv} cache: a prompt of {} tokens", r.prompt.len());
        }
    }
}

/// On PJRT the decode step's captured program reads and writes the float8
/// pools and their scales (state of the program) and gives generate()'s
/// tokens on the same device.
#[test]
fn pjrt_serves_what_generate_gives_over_a_float8_cache() {
    support::register_tpu();
    let mut m = model(0);
    m.to_device(Device::Tpu(0)).unwrap();
    let kv = DType::F8E4M3FN;
    let cfg = EngineConfig {
        block_size: 8,
        max_batched_tokens: 32,
        max_num_seqs: 4,
        kv_cache_dtype: Some(kv),
        ..Default::default()
    };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let reqs = requests();
    let got = serve(&mut engine, &reqs);
    for (r, tokens) in reqs.iter().zip(&got) {
        assert_eq!(tokens, &alone(&m, r, kv), "a prompt of {} tokens", r.prompt.len());
    }
    let st = engine.stats();
    assert!(st.decode_traces >= 1 && st.decode_replays >= 1, "{st:?}");
}

/// The logits of a prompt run in two chunks beside another sequence, over
/// a paged pool of `kv`, and of incremental decoding over a contiguous cache
/// of `kv`.
fn paged_and_incremental(m: &LlamaForCausalLM, kv: DType) -> (Vec<f32>, Vec<f32>) {
    let (a, b) = (prompt(150, 51), prompt(9, 52));
    let ta = Tensor::from_vec(a.clone(), &[1, a.len()]).unwrap();
    let mut cache = m.new_cache_with_dtype(8, kv).unwrap();
    let f32s = |t: Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    let want = f32s(m.forward_cached(&ta, None, &mut cache, true).unwrap());
    let pool = PagedKvCache::new(m, 48, 4, kv).unwrap();
    assert_eq!(pool.dtype(), kv);
    // Blocks out of order, none shared.
    let blocks_a: Vec<usize> = (0..38).map(|i| (i * 5 + 3) % 41).collect();
    let blocks_b: Vec<usize> = vec![44, 41, 47];
    let step1 = [
        SeqChunk { tokens: &a[..70], start: 0, blocks: &blocks_a, logits: 0 },
        SeqChunk { tokens: &b, start: 0, blocks: &blocks_b, logits: 1 },
    ];
    m.forward_paged(&PagedBatch::new(&step1, 4, Device::Cpu).unwrap(), &pool).unwrap();
    let step2 = [SeqChunk { tokens: &a[70..], start: 70, blocks: &blocks_a, logits: 1 }];
    let got = f32s(m.forward_paged(&PagedBatch::new(&step2, 4, Device::Cpu).unwrap(), &pool).unwrap());
    (got, want)
}

/// A narrow pool's logits are bit for bit those of incremental decoding
/// over a contiguous cache of the same dtype, and within a bound of the
/// float32 cache's; a block takes half (bfloat16) or about a quarter
/// (float8 and its scale) of the bytes.
#[test]
fn narrow_caches_take_less_memory_with_logits_near_float32s() {
    let _invariant = support::batch_invariance(true);
    let m = model(7);
    let (f32_logits, _) = paged_and_incremental(&m, DType::F32);
    let largest = f32_logits.iter().fold(0f32, |a, x| a.max(x.abs()));
    let per = |kv| PagedKvCache::bytes_per_block(&m, 16, kv);
    // head_dim 16: 64 bytes a row in float32, 32 in bfloat16, 16 + 4 in float8.
    assert_eq!(
        (per(DType::F32), per(DType::BF16), per(DType::F8E4M3FN)),
        (2 * 2 * 16 * 2 * 64, 2 * 2 * 16 * 2 * 32, 2 * 2 * 16 * 2 * 20)
    );
    // Bounds on the largest logit difference from the float32 cache, relative
    // to the largest logit: four times the largest measured over five models
    // (seeds 7..11: bfloat16 3.4e-4 to 6.2e-4, float16 4.4e-5 to 6.7e-5,
    // float8 3.7e-3 to 8.8e-3).
    for (kv, bound) in [(DType::BF16, 2.5e-3), (DType::F16, 2.7e-4), (DType::F8E4M3FN, 3.5e-2)] {
        let (got, want) = paged_and_incremental(&m, kv);
        let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{kv}: the paged logits differ in their bits from incremental decoding's");
        let err = got.iter().zip(&f32_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / largest;
        eprintln!("{kv} cache: largest logit difference from the float32 cache {err:.2e} of the largest logit");
        assert!(err > 0.0, "{kv}: the logits are the float32 cache's: the cache dtype was not applied");
        assert!(err <= bound, "{kv}: logits {err:.2e} from the float32 cache's (bound {bound:.1e})");
    }
    // The same bytes hold more blocks.
    let blocks = |kv| {
        let cfg = EngineConfig { kv_cache_bytes: 1 << 20, kv_cache_dtype: kv, ..Default::default() };
        Engine::new(m.clone(), cfg).unwrap().stats().kv_blocks_total
    };
    let (b32, b16, b8) = (blocks(None), blocks(Some(DType::BF16)), blocks(Some(DType::F8E4M3FN)));
    assert!(b16 + 1 >= 2 * b32 && b8 * 20 + 64 >= b32 * 64, "{b32} float32 blocks, {b16} bfloat16, {b8} float8");
}

/// Dtypes a model cannot keep its cache in, and names that are not dtypes,
/// are refused with errors that say so.
#[test]
fn kv_dtypes_that_do_not_fit_are_refused() {
    let m = model(1);
    let cfg = |kv| EngineConfig { kv_cache_dtype: Some(kv), ..Default::default() };
    for kv in [DType::I64, DType::F64] {
        let e = Engine::new(m.clone(), cfg(kv)).err().expect("refused").to_string();
        assert!(e.contains("cannot keep its KV cache in"), "{e}");
    }
    let p = Tensor::new([[1i64, 2]]).unwrap();
    let e = generate(&m, &p, 2, &Sampling::greedy().with_kv_cache_dtype(DType::Bool)).unwrap_err().to_string();
    assert!(e.contains("cannot keep its KV cache in bool"), "{e}");
    let mut half = m.clone();
    half.to_dtype(DType::BF16).unwrap();
    let e = half.new_cache_with_dtype(4, DType::F32).expect_err("refused").to_string();
    assert!(e.contains("bfloat16 model cannot keep its KV cache in float32"), "{e}");
    assert_eq!(parse_kv_cache_dtype("auto").unwrap(), None);
    assert_eq!(parse_kv_cache_dtype("fp8").unwrap(), Some(DType::F8E4M3FN));
    assert_eq!(parse_kv_cache_dtype("bfloat16").unwrap(), Some(DType::BF16));
    let e = parse_kv_cache_dtype("fp4").unwrap_err().to_string();
    assert!(e.contains("unknown KV cache dtype \"fp4\""), "{e}");
}

/// A float8 row keeps e4m3's relative precision whatever its magnitude:
/// rows of 1e-6 (below e4m3's smallest subnormal, 2^-9) and of 1e4 (past
/// its largest value, 448) come back within half an ulp (2^-4 of the value,
/// three mantissa bits) of every element, because each row is scaled to
/// e4m3's range first; an all-zero row comes back as zeros.
#[test]
fn float8_rows_keep_their_precision_at_any_magnitude() {
    // Row r: 16 values from 1 to 100 (all normal once scaled), times 10^e.
    let exps = [-6, -2, 0, 4];
    let base: Vec<f32> =
        (0..16).map(|i| (1.0 + 99.0 * i as f32 / 15.0) * if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
    let mut v: Vec<f32> = exps.iter().flat_map(|e| base.iter().map(move |x| x * 10f32.powi(*e))).collect();
    v.extend([0.0; 16]);
    let x = Tensor::from_vec(v.clone(), &[5, 1, 16]).unwrap();
    let (q, scales) = store_rows(&x, DType::F8E4M3FN).unwrap();
    let scales = scales.expect("float8 rows have scales");
    assert_eq!((q.dtype(), scales.shape()), (DType::F8E4M3FN, &[5usize, 1][..]));
    assert_eq!(scales.to_vec::<f32>().unwrap()[4], 1.0, "an all-zero row's scale");
    let back = load_rows(&q, Some(&scales), DType::F32).unwrap().to_vec::<f32>().unwrap();
    for (i, (a, b)) in back.iter().zip(&v).enumerate() {
        assert!((a - b).abs() <= b.abs() / 16.0, "element {i}: {b} came back as {a}");
    }
}
