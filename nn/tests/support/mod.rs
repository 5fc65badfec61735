//! Helpers shared by the kiln-nn integration tests: fixture paths, tolerances
//! and an allclose that reports the worst element.
#![allow(dead_code)]
use kiln::prelude::*;
use std::path::PathBuf;

#[path = "../../../tests/common/pjrt_plugin.rs"]
mod pjrt_plugin;

#[path = "../../../tests/common/venv.rs"]
mod venv;

#[path = "../../../tests/common/child.rs"]
mod child;
#[allow(unused_imports)] // each test binary uses a different subset
pub use child::run_ignored_test_in_child;

#[path = "../../../tests/common/invariance.rs"]
mod invariance;
#[allow(unused_imports)]
pub use invariance::batch_invariance;

/// The logits of `model` on `ids` and their causal-LM loss, checked against
/// fixture `name`'s golden values (`g`) with its tolerances; returns the loss.
pub fn check_logits_and_loss(
    what: &str,
    name: &str,
    model: &kiln::nn::models::LlamaForCausalLM,
    ids: &Tensor,
    g: &std::collections::BTreeMap<String, Tensor>,
) -> Tensor {
    let logits = model.forward(ids, None).unwrap();
    let (la, lr) = tolerance(name, "logits");
    assert_close(&format!("{what} logits"), &logits, &g["logits"], la, lr);
    let loss = kiln::nn::models::causal_lm_loss(&logits, ids, None).unwrap();
    let (sa, sr) = tolerance(name, "loss");
    assert_close(&format!("{what} loss"), &loss, &g["loss"], sa, sr);
    loss
}

/// Checks that `norm` (what gradient clipping computed) is the global L2
/// norm of fixture `g`'s golden gradients, to 1e-5 relative.
#[track_caller]
pub fn assert_golden_grad_norm(what: &str, norm: f64, g: &std::collections::BTreeMap<String, Tensor>) {
    let want: f64 = g
        .iter()
        .filter(|(k, _)| k.starts_with("grad."))
        .flat_map(|(_, t)| t.to_vec_f64().unwrap())
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt();
    assert!((norm - want).abs() <= 1e-5 * want, "{what}: global gradient norm {norm} vs {want}");
}

/// Steps 2 to 10 of the fixtures' AdamW schedule on `ids` (each step's
/// loss), eagerly or captured by `kiln::compile` on `device` (which must
/// replay, never retrace), then the loss after the last step.
pub fn nine_more_steps(
    what: &str,
    model: &kiln::nn::models::LlamaForCausalLM,
    opt: &mut kiln::nn::optim::AdamW,
    ids: &Tensor,
    device: Device,
    compiled: bool,
) -> Vec<f32> {
    use kiln::nn::models::causal_lm_loss;
    use kiln::nn::optim::Optimizer;
    let step = |opt: &mut kiln::nn::optim::AdamW| -> kiln::Result<Tensor> {
        opt.zero_grad();
        let l = causal_lm_loss(&model.forward(ids, None)?, ids, None)?;
        l.backward()?;
        opt.step()?;
        Ok(l)
    };
    let mut curve = vec![];
    if compiled {
        let mut c = kiln::compile(device, |_: &[Tensor]| Ok(vec![step(opt)?]));
        for _ in 1..10 {
            curve.push(c.call(&[]).unwrap()[0].item::<f32>().unwrap());
        }
        let s = c.stats();
        assert_eq!(s.retraces, 0, "{what}: {s:?}");
        assert!(s.replays >= 7, "{what}: the step replays once stable: {s:?}");
    } else {
        for _ in 1..10 {
            curve.push(step(opt).unwrap().item::<f32>().unwrap());
        }
    }
    let _ng = kiln::autograd::no_grad();
    curve.push(causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap().item::<f32>().unwrap());
    curve
}

/// `shared/fixtures/<name>` (reached from the crate directory).
pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures").join(name)
}

/// `(atol, rtol)` for `model` / `what` from `tolerances.json` (`suggested` section when present).
pub fn tolerance(model: &str, what: &str) -> (f64, f64) {
    let t = &suggested(model)[what];
    (t["atol"].as_f64().expect("atol"), t["rtol"].as_f64().expect("rtol"))
}

/// A fixture's suggested tolerances: its entry in `tolerances.json`, else the
/// `suggested_tolerance_f32` of its own `golden.json` (the fixtures made later).
fn suggested(model: &str) -> serde_json::Value {
    let read = |p: std::path::PathBuf| -> serde_json::Value {
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).expect("valid JSON")
    };
    let all = read(fixture_dir("tolerances.json"));
    match all.get(model) {
        Some(m) if m.get("suggested").is_some() => m["suggested"].clone(),
        Some(m) => m.clone(),
        None => read(fixture_dir(model).join("golden.json"))["suggested_tolerance_f32"].clone(),
    }
}

/// The worst `|got - want|` and whether every element is within `atol + rtol * |want|`.
pub fn compare(got: &Tensor, want: &Tensor, atol: f64, rtol: f64) -> (f64, bool) {
    assert_eq!(got.shape(), want.shape(), "shapes differ");
    let g = got.to_vec_f64().unwrap();
    let w = want.to_vec_f64().unwrap();
    let mut worst = 0f64;
    let mut ok = true;
    for (a, b) in g.iter().zip(&w) {
        let d = (a - b).abs();
        if d.is_nan() || d > atol + rtol * b.abs() {
            ok = false;
        }
        if d > worst || d.is_nan() {
            worst = d;
        }
    }
    (worst, ok)
}

/// Asserts allclose and returns the max abs error.
#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, atol: f64, rtol: f64) -> f64 {
    let (worst, ok) = compare(got, want, atol, rtol);
    assert!(ok, "{what}: max abs error {worst:e} exceeds atol {atol:e} + rtol {rtol:e} * |golden|");
    worst
}

/// Serialises the tests of one binary that draw from kiln's global generator
/// (tests run on parallel threads; a seeded sequence must not be interleaved).
pub fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers the PJRT backend on the XLA:CPU plugin, fetching the plugin first
/// (`scripts/fetch-pjrt-plugin`) when neither `KILN_PJRT_PLUGIN` nor the cache holds one.
pub fn register_tpu() {
    fetch_pjrt_plugin();
    kiln::tpu::register().unwrap_or_else(|e| panic!("registering the PJRT backend: {e}"));
}

/// [`register_tpu`] with `n` XLA:CPU devices (every test of a binary must ask
/// for the same count: the first registration fixes it).
pub fn register_tpu_with_devices(n: usize) {
    fetch_pjrt_plugin();
    kiln::tpu::register_with_cpu_devices(n).unwrap_or_else(|e| panic!("registering the PJRT backend: {e}"));
}

pub fn fetch_pjrt_plugin() {
    static READY: std::sync::Once = std::sync::Once::new();
    READY.call_once(|| pjrt_plugin::fetch_pjrt_plugin_unless(kiln::tpu::pjrt::find_plugin().is_ok()));
}

/// A fresh, empty directory under the system's temporary directory, named for
/// `tag` and this process.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-nn-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn adam_tolerance(name: &str, what: &str) -> (f64, f64, f64, f64) {
    let t = &suggested(name)[what];
    let f = |k: &str| t[k].as_f64().unwrap();
    (f("atol"), f("rtol"), f("small_grad_threshold"), f("small_grad_atol"))
}

/// Parameters after AdamW steps vs golden, with the fixture README's rule for
/// elements whose golden step-1 gradient is tiny but not zero.
pub fn check_params(
    name: &str,
    params: &[(String, kiln::Tensor)],
    g: &std::collections::BTreeMap<String, kiln::Tensor>,
    what: &str,
) -> f64 {
    let (atol, rtol, thr, small_atol) = adam_tolerance(name, what);
    let mut worst = 0f64;
    for (n, p) in params {
        let got = p.to_vec_f64().unwrap();
        let want = g[&format!("{what}.{n}")].to_vec_f64().unwrap();
        let grad = g[&format!("grad.{n}")].to_vec_f64().unwrap();
        for i in 0..got.len() {
            let d = (got[i] - want[i]).abs();
            let a = if grad[i] != 0.0 && grad[i].abs() < thr { small_atol } else { atol };
            assert!(
                d <= a + rtol * want[i].abs(),
                "{name} {what}.{n}[{i}]: got {} want {} (grad {})",
                got[i],
                want[i],
                grad[i]
            );
            worst = worst.max(d);
        }
    }
    worst
}

/// The python of a virtual environment with `safetensors` and `numpy`
/// (`scripts/setup-py-venv` creates it on first use; PyPI must be reachable).
pub fn python_with_safetensors() -> String {
    venv::python_from("setup-py-venv")
}

/// Runs `nn/tests/gguf_reference.py` (the `gguf` package's side of the GGUF
/// tests) with `args`; its stdout, or a panic with its stderr.
pub fn gguf_reference(args: &[&std::ffi::OsStr]) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_reference.py");
    let out = std::process::Command::new(python_with_safetensors()).arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "gguf_reference.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The elements' bits, as float32.
pub fn f32_bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// The python of a virtual environment with torch, transformers and
/// compressed-tensors (`scripts/setup-transformers-venv` creates it on first
/// use, about 3 GB from PyPI).
pub fn python_with_transformers() -> String {
    venv::python_from("setup-transformers-venv")
}

/// Checks that low-precision logits `ours` are nearer to PyTorch's
/// low-precision logits `want` than PyTorch's own float32 logits rounded to
/// bfloat16 (`f32_rounded`, what float32 compute cast at the end gives) are:
/// equal to `want` in more places, by 1% of the logits. A float32 computation
/// differs from PyTorch's by ~2e-5, which moves ~0.1% of the logits across a
/// bfloat16 rounding boundary, so float32 compute cannot pass; the bounds of
/// an allclose at bfloat16's spread would let it. Prints the counts.
#[track_caller]
pub fn assert_nearer_than_f32(what: &str, ours: &Tensor, want: &Tensor, f32_rounded: &Tensor) {
    let vals = |t: &Tensor| t.to_dtype(DType::F64).and_then(|t| t.to_vec::<f64>()).unwrap();
    let (ours, want, f32_rounded) = (vals(ours), vals(want), vals(&f32_rounded.to_dtype(DType::BF16).unwrap()));
    let mean = |a: &[f64]| a.iter().zip(&want).map(|(x, y)| (x - y).abs()).sum::<f64>() / want.len() as f64;
    let same = |a: &[f64]| a.iter().zip(&want).filter(|(x, y)| x == y).count();
    let (same_kiln, same_f32) = (same(&ours), same(&f32_rounded));
    eprintln!(
        "{what}: {same_kiln} of {} logits equal PyTorch's (its float32 ones rounded: {same_f32}), mean |diff| {:.2e} ({:.2e})",
        want.len(),
        mean(&ours),
        mean(&f32_rounded)
    );
    assert!(
        same_kiln > same_f32 + want.len() / 100,
        "{what}: the logits are no nearer to PyTorch's than its float32 ones rounded to bfloat16 are"
    );
}

/// `len` token ids below `vocab` drawn from `seed` (xorshift; no global
/// generator, so no other test's draws interleave).
pub fn random_tokens(len: usize, seed: u64, vocab: u64) -> Vec<i64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab) as i64
        })
        .collect()
}

/// Runs `engine`, submitting `arrivals[i].1` once `arrivals[i].0` steps have
/// run; returns each request's tokens and end by submission order, checking
/// that no request gets an event after its end and that the engine makes
/// progress.
#[allow(dead_code)]
pub fn serve_arrivals(
    engine: &mut kiln::nn::serve::Engine,
    arrivals: &[(u64, kiln::nn::serve::Request)],
) -> Vec<(Vec<i64>, kiln::nn::serve::FinishReason)> {
    use kiln::nn::serve::{Event, FinishReason};
    let mut ids = vec![];
    let mut got: std::collections::BTreeMap<u64, (Vec<i64>, Option<FinishReason>)> = Default::default();
    let mut pending: std::collections::VecDeque<_> = arrivals.iter().cloned().collect();
    let mut step = 0;
    while !pending.is_empty() || engine.has_work() {
        while pending.front().is_some_and(|(at, _)| *at <= step) {
            let (_, r) = pending.pop_front().expect("a front");
            let id = engine.add_request(r).unwrap();
            ids.push(id);
            got.insert(id, (vec![], None));
        }
        for o in engine.step() {
            let e = got.get_mut(&o.id).unwrap();
            assert!(e.1.is_none(), "request {} got an event after its end", o.id);
            match o.event {
                Event::Token(t, _) => e.0.push(t),
                Event::Finished(f) => e.1 = Some(f),
            }
        }
        step += 1;
        assert!(step < 10_000, "the engine does not make progress");
    }
    ids.iter().map(|id| got.remove(id).map(|(t, f)| (t, f.expect("every request ends"))).unwrap()).collect()
}
