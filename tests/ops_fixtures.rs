//! PyTorch's own outputs for 52 op cases (`../shared/fixtures/ops.json` and
//! `ops.safetensors`): each case's PyTorch `code` translated into kiln calls, run on
//! every registered device, and every output checked for dtype, shape, values
//! (within the case's tolerance; 0/0 is bit-exact including NaN positions and the
//! sign of zero) and, for views, strides, storage offset, contiguity and aliasing.
//!
//! Gradient outputs are computed with kiln's autograd (`x.clone().requires_grad_()`
//! in the case's code becomes a fresh leaf: `deep_clone` + `requires_grad_`).
mod common;

use common::buffer_mismatch;
use kiln::prelude::*;
use kiln::tensor::HostBuffer;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::OnceLock;

// ---- the fixture files ------------------------------------------------------------------

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures")
}

fn json() -> &'static Value {
    static J: OnceLock<Value> = OnceLock::new();
    J.get_or_init(|| {
        let p = fixture_dir().join("ops.json");
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", p.display()))
    })
}

fn tensors() -> &'static SafeTensors<'static> {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    static ST: OnceLock<SafeTensors<'static>> = OnceLock::new();
    ST.get_or_init(|| {
        let bytes = BYTES.get_or_init(|| {
            let p = fixture_dir().join("ops.safetensors");
            std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
        });
        SafeTensors::deserialize(bytes).unwrap_or_else(|e| panic!("parsing ops.safetensors: {e}"))
    })
}

fn kiln_dtype(d: StDtype) -> DType {
    match d {
        StDtype::BOOL => DType::Bool,
        StDtype::U8 => DType::U8,
        StDtype::I8 => DType::I8,
        StDtype::I16 => DType::I16,
        StDtype::I32 => DType::I32,
        StDtype::I64 => DType::I64,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        StDtype::F32 => DType::F32,
        StDtype::F64 => DType::F64,
        other => panic!("ops.safetensors holds a dtype kiln does not have: {other:?}"),
    }
}

/// The stored tensor `key` as a host buffer and its shape.
fn stored(key: &str) -> (HostBuffer, Vec<usize>) {
    let v = tensors().tensor(key).unwrap_or_else(|e| panic!("ops.safetensors has no tensor {key:?}: {e}"));
    let buf = HostBuffer::from_le_bytes(kiln_dtype(v.dtype()), v.data()).unwrap_or_else(|e| panic!("{key}: {e}"));
    (buf, v.shape().to_vec())
}

fn case_json(name: &str) -> &'static Value {
    json()["cases"]
        .as_array()
        .expect("ops.json: `cases` is a list")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("ops.json has no case {name:?}"))
}

// ---- one case ------------------------------------------------------------------------------

/// A case bound to a device: its inputs (loaded once, like Python's bound names),
/// and the bookkeeping that every output gets checked.
struct Case {
    name: &'static str,
    dev: Device,
    spec: &'static Value,
    atol: f64,
    rtol: f64,
    inputs: Vec<(String, Tensor)>,
    checked: BTreeSet<String>,
    failures: Vec<String>,
}

impl Case {
    fn load(name: &'static str, dev: Device) -> Case {
        let spec = case_json(name);
        let tol = &spec["tolerance"];
        let inputs = spec["inputs"]
            .as_object()
            .expect("inputs")
            .iter()
            .map(|(var, s)| {
                let (buf, shape) = stored(s["key"].as_str().expect("key"));
                let t = Tensor::from_host(buf, &shape, dev).unwrap_or_else(|e| panic!("{name}: input {var}: {e}"));
                (var.clone(), t)
            })
            .collect();
        Case {
            name,
            dev,
            spec,
            atol: tol["atol"].as_f64().expect("atol"),
            rtol: tol["rtol"].as_f64().expect("rtol"),
            inputs,
            checked: BTreeSet::new(),
            failures: vec![],
        }
    }

    /// The input bound to `var` (the same tensor on every call).
    fn input(&self, var: &str) -> Tensor {
        let found = self.inputs.iter().find(|(v, _)| v == var);
        found.unwrap_or_else(|| panic!("{}: no input {var:?}", self.name)).1.clone()
    }

    /// A tensor the case's code creates (`torch.tensor(...)`), moved to the case's device.
    fn new_tensor(&self, t: Result<Tensor>) -> Result<Tensor> {
        t?.to_device(self.dev)
    }

    fn ctx(&self, out: &str) -> String {
        format!("case {} on {}: output {out}", self.name, self.dev)
    }

    /// Checks one output against PyTorch's: dtype, shape, values, and the view metadata.
    /// Mismatches are collected, so one run reports every output that differs.
    fn check(&mut self, out: &str, got: &Tensor) {
        let ctx = self.ctx(out);
        let all: &'static Value = self.spec;
        let spec = &all["outputs"][out];
        assert!(spec.is_object(), "{ctx}: the case has no such output");
        assert!(self.checked.insert(out.to_string()), "{ctx}: checked twice");
        let (atol, rtol) = (self.atol, self.rtol);
        let mut fail = |what: String| self.failures.push(format!("{ctx}: {what}"));
        let want_dtype = DType::from_name(spec["dtype"].as_str().expect("dtype")).expect("known dtype");
        let (want, want_shape) = stored(spec["key"].as_str().expect("key"));
        if got.dtype() != want_dtype {
            fail(format!("dtype {}, expected {want_dtype}", got.dtype()));
        } else if got.shape() != want_shape.as_slice() {
            fail(format!("shape {:?}, expected {want_shape:?}", got.shape()));
        } else {
            match got.to_host() {
                Err(e) => fail(format!("reading the result: {e}")),
                Ok(host) => {
                    if let Some(m) = buffer_mismatch(&host, &want, atol, rtol) {
                        fail(format!("{m}\n got: {got}\nwant: {}", spec["values"]));
                    }
                }
            }
        }
        let view = &spec["view"];
        if view.is_object() {
            let strides: Vec<usize> =
                view["stride"].as_array().expect("stride").iter().map(|s| s.as_u64().unwrap() as usize).collect();
            let offset = view["storage_offset"].as_u64().unwrap() as usize;
            let contiguous = view["is_contiguous"].as_bool().unwrap();
            let is_view = view["is_view"].as_bool().unwrap();
            if got.strides() != strides.as_slice() {
                fail(format!("strides {:?}, expected {strides:?}", got.strides()));
            }
            if got.storage_offset() != offset {
                fail(format!("storage offset {}, expected {offset}", got.storage_offset()));
            }
            if got.is_contiguous() != contiguous {
                fail(format!("is_contiguous() is {}, expected {contiguous}", got.is_contiguous()));
            }
            if got.is_view() != is_view {
                fail(format!("is_view() is {}, expected {is_view}", got.is_view()));
            }
        } else {
            // No metadata: PyTorch's result owns contiguous memory of its own.
            if !got.is_contiguous() {
                fail(format!("expected a contiguous result, got strides {:?}", got.strides()));
            }
            if got.is_view() {
                fail("expected a tensor that is not a view (PyTorch's `_base` is None), got a view".into());
            }
        }
    }

    /// Checks a view output and that it aliases `base` (a write through it reaches `base`).
    fn check_view_of(&mut self, out: &str, got: &Tensor, base: &Tensor) {
        if !got.shares_storage(base) {
            let ctx = self.ctx(out);
            self.failures.push(format!("{ctx}: not a view of the base"));
        }
        self.check(out, got);
    }

    /// Asserts that every output was checked and matched.
    fn finish(&self) {
        for out in self.spec["outputs"].as_object().expect("outputs").keys() {
            assert!(self.checked.contains(out), "{}: output {out} was never checked", self.name);
        }
        assert!(self.failures.is_empty(), "{} mismatch(es):\n{}", self.failures.len(), self.failures.join("\n"));
    }
}

/// Runs a case on every registered device.
fn run(name: &'static str, f: fn(&mut Case) -> Result<()>) {
    common::for_each_device_and_mode(|dev, mode| {
        let mut c = Case::load(name, dev);
        f(&mut c).unwrap_or_else(|e| panic!("case {name} on {dev} ({mode}): {e}"));
        c.finish();
    });
}

macro_rules! fixture_cases {
    ($($name:ident),* $(,)?) => {
        /// The cases that have a test below.
        const COVERED: &[&str] = &[$(stringify!($name)),*];
        mod case {
            $(
                #[test]
                fn $name() {
                    super::run(stringify!($name), super::$name)
                }
            )*
        }
    };
}

fixture_cases!(
    broadcast_col_row,
    broadcast_rank_extend,
    broadcast_both_sides,
    broadcast_where_and_empty,
    type_promotion,
    transpose_view_inplace,
    narrow_view_inplace,
    select_view_inplace,
    expand_view,
    as_strided_overlapping_windows,
    as_strided_inplace,
    chained_views_inplace,
    reshape_view_vs_copy,
    permute_contiguous,
    slice_step_view_inplace,
    broadcast_inplace_into_view,
    diagonal_view_inplace,
    unsqueeze_expand_backward,
    softmax_large_magnitude,
    log_softmax_large_magnitude,
    softmax_inf_entries,
    softmax_non_last_dim,
    logsumexp_large,
    cross_entropy_ignore_index,
    matmul_batch_broadcast,
    matmul_vector_cases,
    matmul_noncontiguous,
    matmul_batch_broadcast_backward,
    index_select,
    gather,
    scatter_add_duplicates,
    scatter_add_inplace_partial,
    embedding_backward_duplicates,
    gather_backward,
    boolean_mask_and_masked_fill,
    cumsum_dims,
    cumsum_integer_promotion,
    argmax_ties,
    max_dim_ties,
    argmax_nan,
    int_division_rounding,
    int_remainder_fmod,
    float_remainder_fmod,
    bf16_round_nearest_even,
    bf16_sum_accumulates_f32,
    bf16_elementwise,
    bf16_matmul,
    round_half_even,
    activations,
    var_std_rmsnorm,
    nan_propagation,
    causal_mask_softmax,
);

// ---- the file itself --------------------------------------------------------------------------

#[test]
fn every_case_has_a_test() {
    let names: BTreeSet<&str> =
        json()["cases"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), json()["num_cases"].as_u64().unwrap() as usize);
    let covered: BTreeSet<&str> = COVERED.iter().copied().collect();
    let missing: Vec<&&str> = names.difference(&covered).collect();
    assert!(missing.is_empty(), "cases without a test: {missing:?}");
}

/// Inline JSON values against a JSON scalar ("nan", "inf", numbers, bools).
fn json_scalar(v: &Value) -> f64 {
    match v {
        Value::Bool(b) => *b as u8 as f64,
        Value::Number(n) => n.as_f64().unwrap(),
        Value::String(s) => match s.as_str() {
            "nan" => f64::NAN,
            "inf" => f64::INFINITY,
            "-inf" => f64::NEG_INFINITY,
            other => panic!("unexpected string value {other:?}"),
        },
        other => panic!("unexpected value {other}"),
    }
}

/// The nearest value of `dtype` (inline values of float32 tensors are decimal approximations).
fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        _ => v,
    }
}

fn flatten(v: &Value, out: &mut Vec<f64>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| flatten(x, out)),
        x => out.push(json_scalar(x)),
    }
}

/// The loader reads what the JSON describes: dtype, shape and inline values of every tensor.
#[test]
fn loader_matches_inline_values() {
    let mut seen = 0;
    for case in json()["cases"].as_array().unwrap() {
        for section in ["inputs", "outputs"] {
            for (var, s) in case[section].as_object().unwrap() {
                let ctx = format!("{}/{section}/{var}", case["name"]);
                let (buf, shape) = stored(s["key"].as_str().unwrap());
                let want_shape: Vec<usize> =
                    s["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
                assert_eq!(shape, want_shape, "{ctx}: shape");
                assert_eq!(buf.dtype(), DType::from_name(s["dtype"].as_str().unwrap()).unwrap(), "{ctx}: dtype");
                let t = Tensor::from_host(buf.clone(), &shape, Device::Cpu).unwrap();
                assert_eq!(t.dtype(), buf.dtype());
                if !s["values"].is_null() {
                    let mut inline = vec![];
                    flatten(&s["values"], &mut inline);
                    // Floats are printed with 15-16 significant digits: round them back to the
                    // dtype (float64 values can only match to that many digits).
                    let inline = inline.into_iter().map(|v| round_to(buf.dtype(), v)).collect();
                    let rtol = if buf.dtype() == DType::F64 { 1e-15 } else { 0.0 };
                    if let Some(m) = buffer_mismatch(&buf, &HostBuffer::F64(inline), 0.0, rtol) {
                        panic!("{ctx}: {m}");
                    }
                    seen += 1;
                }
            }
        }
    }
    assert!(seen > 100, "only {seen} tensors had inline values");
}

// ---- broadcasting and type promotion ---------------------------------------------------------------

fn broadcast_col_row(c: &mut Case) -> Result<()> {
    let y = &c.input("a") + &c.input("b");
    c.check("y", &y);
    Ok(())
}

fn broadcast_rank_extend(c: &mut Case) -> Result<()> {
    let y = c.input("a").mul(&c.input("b"))?;
    c.check("y", &y);
    Ok(())
}

fn broadcast_both_sides(c: &mut Case) -> Result<()> {
    let y = c.input("a").sub(&c.input("b"))?;
    c.check("y", &y);
    Ok(())
}

fn broadcast_where_and_empty(c: &mut Case) -> Result<()> {
    let y = Tensor::where_cond(&c.input("cond"), &c.input("x"), -1.0)?;
    let z = c.input("e").add(&c.input("o"))?;
    c.check("y", &y);
    c.check("z", &z);
    Ok(())
}

fn type_promotion(c: &mut Case) -> Result<()> {
    let i64_ = c.input("i64");
    c.check("r1", &i64_.add(&c.input("f0"))?);
    c.check("r2", &(&i64_ * 2.5));
    c.check("r3", &i64_.add(&c.input("i32_0d"))?);
    c.check("r4", &c.input("i32").add(&c.input("i64_1"))?);
    c.check("r5", &c.input("u8").add(&c.input("i8"))?);
    c.check("r6", &c.input("bl").add(&c.input("br"))?);
    c.check("r7", &c.input("h").add(&c.input("bf"))?);
    let d = c.new_tensor(Tensor::new([2i64, 2, 2, 3]))?;
    c.check("r8", &(&i64_ / &d));
    Ok(())
}

// ---- strided views and in-place writes through them --------------------------------------------------

fn transpose_view_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.t()?;
    let before = base.version();
    v.add_(&c.input("w"))?;
    assert!(base.version() > before, "add_ through a view must bump the shared version counter");
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

fn narrow_view_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.narrow(0, 1, 3)?;
    v.add_(10.0)?;
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

fn select_view_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.select(1, 2)?;
    v.add_(100.0)?;
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

fn expand_view(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    let v = x.expand(&[3, 4])?;
    let y = v.add(&c.new_tensor(Tensor::arange(0.0, 4.0, 1.0, DType::F32))?)?;
    let cont = v.contiguous()?;
    c.check_view_of("v", &v, &x);
    c.check("y", &y);
    c.check("c", &cont);
    assert!(!cont.shares_storage(&x), "contiguous() of an expanded view must copy");
    Ok(())
}

fn as_strided_overlapping_windows(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.as_strided(&[4, 3], &[2, 1], None)?;
    let y = v.mul(1.0)?;
    c.check_view_of("v", &v, &base);
    c.check("y", &y);
    Ok(())
}

fn as_strided_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.as_strided(&[2, 2], &[4, 2], Some(1))?;
    v.add_(1000.0)?;
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

fn chained_views_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.t()?.narrow(0, 1, 3)?.select(1, 2)?;
    v.mul_(-1.0)?;
    c.check_view_of("v", &v, &base);
    assert!(v.base().is_some_and(|b| b.same(&base)), "a view of a view has the root as its base");
    c.check("base", &base);
    Ok(())
}

fn reshape_view_vs_copy(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let r_view = base.reshape(&[12])?;
    let r_copy = base.t()?.reshape(&[12])?;
    r_copy.add_(1000.0)?;
    r_view.add_(1.0)?;
    c.check_view_of("r_view", &r_view, &base);
    assert!(!r_copy.shares_storage(&base), "reshape of a transposed tensor must copy");
    c.check("r_copy", &r_copy);
    c.check("base", &base);
    Ok(())
}

fn permute_contiguous(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    let v = x.permute(&[2, 0, 1])?;
    let cont = v.contiguous()?;
    let flat = cont.view(&[-1])?;
    c.check_view_of("v", &v, &x);
    c.check("c", &cont);
    c.check_view_of("flat", &flat, &cont);
    Ok(())
}

fn slice_step_view_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.i(s(1, None, 3))?; // base[1::3]
    v.add_(100.0)?;
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

fn broadcast_inplace_into_view(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.i((.., 1..3))?;
    v.add_(&c.input("r"))?;
    base.i(1)?.add_(10.0)?;
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

fn diagonal_view_inplace(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let v = base.diagonal(0, 0, 1)?;
    v.add_(1.0)?;
    c.check_view_of("v", &v, &base);
    c.check("base", &base);
    Ok(())
}

/// `x.clone().requires_grad_()`: a fresh leaf holding the input's values.
fn leaf(c: &Case, name: &str) -> Result<Tensor> {
    let x = c.input(name).deep_clone()?;
    x.requires_grad_(true)?;
    Ok(x)
}

/// The accumulated gradient of a leaf, which backward must have produced.
fn grad_of(x: &Tensor) -> Tensor {
    x.grad().expect("backward produced no gradient for the leaf")
}

fn unsqueeze_expand_backward(c: &mut Case) -> Result<()> {
    let x = leaf(c, "x")?;
    let y = x.unsqueeze(0)?.expand(&[2, 3, 4])?.mul(&c.input("w"))?.sum()?;
    y.backward()?;
    c.check("y", &y);
    c.check("gx", &grad_of(&x));
    Ok(())
}

// ---- softmax family ------------------------------------------------------------------------------------

fn softmax_large_magnitude(c: &mut Case) -> Result<()> {
    c.check("y", &c.input("x").softmax(-1)?);
    Ok(())
}

fn log_softmax_large_magnitude(c: &mut Case) -> Result<()> {
    c.check("y", &c.input("x").log_softmax(-1)?);
    Ok(())
}

fn softmax_inf_entries(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("p", &x.softmax(-1)?);
    c.check("lp", &x.log_softmax(-1)?);
    Ok(())
}

fn softmax_non_last_dim(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("y0", &x.softmax(0)?);
    c.check("y1", &x.softmax(1)?);
    Ok(())
}

fn logsumexp_large(c: &mut Case) -> Result<()> {
    c.check("y", &c.input("x").logsumexp(-1, false)?);
    Ok(())
}

fn cross_entropy_ignore_index(c: &mut Case) -> Result<()> {
    // F.cross_entropy's default ignore_index is -100.
    let (logits, target) = (leaf(c, "logits")?, c.input("target"));
    let mean = logits.cross_entropy(&target, Some(-100), Reduction::Mean)?;
    c.check("s", &logits.cross_entropy(&target, Some(-100), Reduction::Sum)?.detach());
    c.check("none", &logits.cross_entropy(&target, Some(-100), Reduction::None)?.detach());
    mean.backward()?;
    c.check("mean", &mean.detach());
    c.check("grad", &grad_of(&logits));
    Ok(())
}

// ---- matmul -----------------------------------------------------------------------------------------------

fn matmul_batch_broadcast(c: &mut Case) -> Result<()> {
    c.check("y", &c.input("a").matmul(&c.input("b"))?);
    Ok(())
}

fn matmul_vector_cases(c: &mut Case) -> Result<()> {
    let v = c.input("v");
    c.check("r1", &v.matmul(&c.input("m43"))?);
    c.check("r2", &c.input("m34").matmul(&v)?);
    c.check("r3", &v.matmul(&v)?);
    c.check("r4", &c.input("t").matmul(&v)?);
    c.check("r5", &v.matmul(&c.input("t243"))?);
    Ok(())
}

fn matmul_noncontiguous(c: &mut Case) -> Result<()> {
    let a_t = c.input("A").t()?;
    let b_cols = c.input("B").i((.., s(None, None, 2)))?; // B[:, ::2]
    assert!(!a_t.is_contiguous() && !b_cols.is_contiguous());
    c.check("y", &a_t.matmul(&b_cols)?);
    Ok(())
}

fn matmul_batch_broadcast_backward(c: &mut Case) -> Result<()> {
    let (a, b) = (leaf(c, "a")?, leaf(c, "b")?);
    a.matmul(&b)?.mul(&c.input("g"))?.sum()?.backward()?;
    c.check("ga", &grad_of(&a));
    c.check("gb", &grad_of(&b));
    Ok(())
}

// ---- indexing ---------------------------------------------------------------------------------------------

fn index_select(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("y1", &x.index_select(1, &c.input("i1"))?);
    c.check("y0", &x.index_select(0, &c.input("i0"))?);
    Ok(())
}

fn gather(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("y1", &x.gather(1, &c.input("i1"))?);
    c.check("y0", &x.gather(0, &c.input("i0"))?);
    Ok(())
}

fn scatter_add_duplicates(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let y = base.scatter_add(0, &c.input("index"), &c.input("src"))?;
    assert!(!y.shares_storage(&base), "scatter_add is out of place");
    c.check("y", &y);
    Ok(())
}

fn scatter_add_inplace_partial(c: &mut Case) -> Result<()> {
    let base = c.input("base");
    let before = base.version();
    let r = base.scatter_add_(1, &c.input("index"), &c.input("src"))?;
    assert!(r.same(&base), "scatter_add_ returns self");
    assert!(base.version() > before, "scatter_add_ bumps the version");
    c.check("base", &base);
    Ok(())
}

fn embedding_backward_duplicates(c: &mut Case) -> Result<()> {
    let w = leaf(c, "W")?;
    let e = Tensor::embedding(&w, &c.input("ids"))?;
    assert_eq!(e.shape(), &[2, 2, 3]);
    e.mul(&c.input("g"))?.sum()?.backward()?;
    c.check("gW", &grad_of(&w));
    Ok(())
}

fn gather_backward(c: &mut Case) -> Result<()> {
    let x = leaf(c, "x")?;
    x.gather(1, &c.input("i"))?.sum()?.backward()?;
    c.check("gx", &grad_of(&x));
    Ok(())
}

fn boolean_mask_and_masked_fill(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("sel", &x.i(&x.gt(2.0)?)?); // x[x > 2]
    c.check("filled", &x.masked_fill(&c.input("m"), f64::NEG_INFINITY)?);
    Ok(())
}

// ---- cumsum and reductions ---------------------------------------------------------------------------

fn cumsum_dims(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("c0", &x.cumsum(0)?);
    c.check("c1", &x.cumsum(1)?);
    c.check("c2", &x.cumsum(-1)?);
    Ok(())
}

fn cumsum_integer_promotion(c: &mut Case) -> Result<()> {
    c.check("ci", &c.input("i32").cumsum(0)?);
    c.check("cu", &c.input("u8").cumsum(0)?);
    c.check("cb", &c.input("b").cumsum(0)?);
    c.check("su", &c.input("u8").sum()?);
    c.check("sb", &c.input("b").sum()?);
    Ok(())
}

fn argmax_ties(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("a1", &x.argmax(Some(1), false)?);
    c.check("a0", &x.argmax(Some(0), false)?);
    c.check("ak", &x.argmax(Some(1), true)?);
    c.check("af", &x.argmax(None, false)?);
    c.check("m1", &x.argmin(Some(1), false)?);
    c.check("mf", &x.argmin(None, false)?);
    Ok(())
}

fn max_dim_ties(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    let (vals, idx) = x.max_dim(1, false)?;
    let (vals0, idx0) = x.min_dim(0, false)?;
    c.check("vals", &vals);
    c.check("idx", &idx);
    c.check("vals0", &vals0);
    c.check("idx0", &idx0);
    c.check("g", &x.max()?);
    Ok(())
}

fn argmax_nan(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("a", &x.argmax(Some(1), false)?);
    c.check("b", &x.argmin(Some(1), false)?);
    c.check("m", &x.max_dim(1, false)?.0);
    Ok(())
}

// ---- integer and float division ------------------------------------------------------------------------

fn int_division_rounding(c: &mut Case) -> Result<()> {
    let (a, b) = (c.input("a"), c.input("b"));
    c.check("fl", &a.floor_divide(&b)?);
    c.check("fd", &a.floor_divide(&b)?);
    c.check("tr", &a.div_trunc(&b)?);
    c.check("td", &(&a / &b));
    Ok(())
}

fn int_remainder_fmod(c: &mut Case) -> Result<()> {
    let (a, b) = (c.input("a"), c.input("b"));
    c.check("r", &a.remainder(&b)?);
    c.check("p", &(&a % &b));
    c.check("f", &a.fmod(&b)?);
    c.check("rs", &(&a % 3i64));
    Ok(())
}

fn float_remainder_fmod(c: &mut Case) -> Result<()> {
    let (a, b) = (c.input("a"), c.input("b"));
    c.check("r", &a.remainder(&b)?);
    c.check("f", &a.fmod(&b)?);
    c.check("fl", &a.floor_divide(&b)?);
    Ok(())
}

// ---- bf16 ------------------------------------------------------------------------------------------------

fn bf16_round_nearest_even(c: &mut Case) -> Result<()> {
    let y = c.input("x").to_dtype(DType::BF16)?;
    let back = y.to_dtype(DType::F32)?;
    c.check("y", &y);
    c.check("back", &back);
    Ok(())
}

fn bf16_sum_accumulates_f32(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("s", &x.sum()?);
    c.check("m", &x.mean()?);
    let cs = x.cumsum(0)?;
    let last = cs.i(-1)?; // c[-1]: a 0-d view
    c.check_view_of("last", &last, &cs);
    c.check("s32", &x.to_dtype(DType::F32)?.sum()?);
    Ok(())
}

fn bf16_elementwise(c: &mut Case) -> Result<()> {
    let (a, b) = (c.input("a"), c.input("b"));
    c.check("s", &(&a + &b));
    c.check("p", &(&a * &b));
    c.check("q", &(&a / &b));
    Ok(())
}

fn bf16_matmul(c: &mut Case) -> Result<()> {
    let (a, b) = (c.input("a"), c.input("b"));
    c.check("y", &a.matmul(&b)?);
    c.check("ref", &a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?);
    Ok(())
}

// ---- misc ------------------------------------------------------------------------------------------------

fn round_half_even(c: &mut Case) -> Result<()> {
    c.check("y", &c.input("x").round()?);
    Ok(())
}

fn activations(c: &mut Case) -> Result<()> {
    let x = c.input("x");
    c.check("g", &x.gelu()?);
    c.check("gt", &x.gelu_tanh()?);
    c.check("s", &x.silu()?);
    c.check("sg", &x.sigmoid()?);
    Ok(())
}

fn var_std_rmsnorm(c: &mut Case) -> Result<()> {
    let (x, w) = (c.input("x"), c.input("w"));
    c.check("v", &x.var(-1, 1, false)?);
    c.check("vb", &x.var(-1, 0, false)?);
    c.check("s", &x.std_all(1)?);
    let rms = w.mul(&x.mul(&x.pow(2)?.mean_dim(-1, true)?.add(1e-5)?.rsqrt()?)?)?;
    c.check("rms", &rms);
    Ok(())
}

fn nan_propagation(c: &mut Case) -> Result<()> {
    let (a, b) = (c.input("a"), c.input("b"));
    c.check("mx", &a.maximum(&b)?);
    c.check("fm", &a.fmax(&b)?);
    c.check("cl", &a.clamp(Some(0.0), Some(1.0))?);
    c.check("rl", &a.relu()?);
    c.check("sm", &a.sum()?);
    Ok(())
}

fn causal_mask_softmax(c: &mut Case) -> Result<()> {
    let s = c.input("s");
    let mask = Tensor::full(&[4, 4], f64::NEG_INFINITY, (DType::F32, c.dev))?.triu(1)?;
    let p = s.add(&mask)?.softmax(-1)?;
    let keep = Tensor::ones(&[4, 4], (DType::Bool, c.dev))?.tril(0)?;
    let q = s.masked_fill(&!&keep, f64::NEG_INFINITY)?.softmax(-1)?;
    c.check("mask", &mask);
    c.check("p", &p);
    c.check("q", &q);
    Ok(())
}
