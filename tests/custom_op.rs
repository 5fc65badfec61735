//! Custom ops (Note [Custom ops]): the fused `add_rms_norm` of
//! `examples/support` against the built-in ops it fuses, in values and
//! gradients, on the CPU and on the PJRT device in every mode and through
//! `kiln::compile`; gradcheck; fusion, profiles, distributed inputs; custom
//! calls; and the errors of ops that are incomplete or wrong.
#[path = "../examples/support/add_rms_norm.rs"]
mod add_rms_norm;
mod common;
#[path = "../examples/custom_op.rs"]
mod readme_example;

use add_rms_norm::{add_rms_norm, AddRmsNorm};
use common::assert_err;
use kiln::autograd::{gradcheck, GradcheckOptions};
use kiln::prelude::*;
use kiln::{CustomOp, HostBuffer, HostInput, Lowering, Meta};
use std::sync::Arc;

const EPS: f64 = 1e-6;

/// Deterministic values in about [-2, 2], different per `seed`.
fn input(shape: &[usize], seed: u64, dtype: DType, dev: Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> =
        (0..n).map(|i| (((i as u64 * 2654435761 + seed * 40503 + 7) % 1000) as f64 / 250.0) - 2.0).collect();
    Tensor::from_vec(v, shape).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap()
}

/// A fresh leaf that requires grad, with `t`'s values.
fn leaf(t: &Tensor) -> Tensor {
    let l = t.detach();
    l.requires_grad_(true).unwrap();
    l
}

fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (common::f64s(got), common::f64s(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{what}: element {i}: got {a}, want {b}");
    }
}

/// `(h, y)`, a loss weighting both, and the gradients of x, residual, weight:
/// through the custom op or the built-in ops it fuses.
fn run(x: &Tensor, r: &Tensor, w: &Tensor, fused: bool) -> Vec<Tensor> {
    let (x, r, w) = (leaf(x), leaf(r), leaf(w));
    let (h, y) = if fused {
        add_rms_norm(&x, &r, &w, EPS).unwrap()
    } else {
        let h = x.add(&r).unwrap();
        let y = h.rms_norm(Some(&w), EPS).unwrap();
        (h, y)
    };
    let c = input(h.shape(), 9, h.dtype(), h.device());
    let loss = h.mul(&c).unwrap().sum().unwrap().add(&y.mul(&y).unwrap().sum().unwrap()).unwrap();
    loss.backward().unwrap();
    vec![h.detach(), y.detach(), loss.detach(), x.grad().unwrap(), r.grad().unwrap(), w.grad().unwrap()]
}

const NAMES: [&str; 6] = ["h", "y", "loss", "dx", "dresidual", "dweight"];

#[test]
fn equals_the_builtin_ops_on_every_device_and_mode() {
    common::for_each_device_and_mode(|dev, mode| {
        for shape in [&[2, 5, 16][..], &[7, 3], &[8]] {
            let d = shape[shape.len() - 1];
            let (x, r, w) =
                (input(shape, 1, DType::F32, dev), input(shape, 2, DType::F32, dev), input(&[d], 3, DType::F32, dev));
            let (got, want) = (run(&x, &r, &w, true), run(&x, &r, &w, false));
            for ((g, w), n) in got.iter().zip(&want).zip(NAMES) {
                close(&format!("{n} on {dev} ({mode}), {shape:?}"), g, w, 2e-6);
            }
        }
    });
}

#[test]
fn reads_strided_inputs() {
    // A transposed x and a broadcast residual reach the CPU kernel as views.
    let x = input(&[16, 6], 1, DType::F32, Device::Cpu).t().unwrap();
    let r = input(&[16], 2, DType::F32, Device::Cpu).expand(&[6, 16]).unwrap();
    let w = input(&[16], 3, DType::F32, Device::Cpu);
    let (h, y) = add_rms_norm(&x, &r, &w, EPS).unwrap();
    let want_h = x.add(&r).unwrap();
    close("h", &h, &want_h, 0.0);
    close("y", &y, &want_h.rms_norm(Some(&w), EPS).unwrap(), 1e-6);
}

#[test]
fn passes_gradcheck_on_every_device_and_mode() {
    for dev in common::devices_in_every_mode() {
        let ins =
            [input(&[3, 8], 1, DType::F64, dev), input(&[3, 8], 2, DType::F64, dev), input(&[8], 3, DType::F64, dev)];
        let both = |t: &[Tensor]| -> Result<Tensor> {
            let (h, y) = add_rms_norm(&t[0], &t[1], &t[2], EPS)?;
            y.add(&h.mul(0.5)?)
        };
        gradcheck(both, &ins, GradcheckOptions::default()).unwrap_or_else(|e| panic!("both outputs on {dev}: {e}"));
        let only_y = |t: &[Tensor]| add_rms_norm(&t[0], &t[1], &t[2], EPS).map(|o| o.1);
        gradcheck(only_y, &ins, GradcheckOptions::default()).unwrap_or_else(|e| panic!("y on {dev}: {e}"));
    }
}

#[test]
fn applied_as_a_primitive_its_rule_recomputes_the_outputs() {
    let op: Arc<dyn CustomOp> = Arc::new(AddRmsNorm { eps: EPS });
    let (x, r, w) = (
        input(&[4, 8], 1, DType::F32, Device::Cpu),
        input(&[4, 8], 2, DType::F32, Device::Cpu),
        input(&[8], 3, DType::F32, Device::Cpu),
    );
    let xs = [leaf(&x), leaf(&r), leaf(&w)];
    let outs =
        Tensor::apply(kiln::Op::Custom(kiln::tensor::custom::CustomOpRef(op)), &[&xs[0], &xs[1], &xs[2]]).unwrap();
    outs[1].sum().unwrap().backward().unwrap();
    let want = {
        let ys = [leaf(&x), leaf(&r), leaf(&w)];
        ys[0].add(&ys[1]).unwrap().rms_norm(Some(&ys[2]), EPS).unwrap().sum().unwrap().backward().unwrap();
        ys.map(|t| t.grad().unwrap())
    };
    for (i, t) in xs.iter().enumerate() {
        close(&format!("grad {i}"), &t.grad().unwrap(), &want[i], 2e-6);
    }
}

#[test]
fn compiled_replays_and_equals_the_cpu() {
    let tpu = Device::Tpu(0);
    common::devices(); // registers the PJRT backend
    let f = |t: &[Tensor]| Ok(run(&t[0], &t[1], &t[2], true));
    // The loss weights `run` uploads are constants of the trace.
    let mut compiled = kiln::compile(tpu, f).host_values(kiln::HostValues::Constant);
    for call in 0..4u64 {
        let cpu: Vec<Tensor> = vec![
            input(&[2, 4, 32], call, DType::F32, Device::Cpu),
            input(&[2, 4, 32], call + 7, DType::F32, Device::Cpu),
            input(&[32], call + 3, DType::F32, Device::Cpu),
        ];
        let on_tpu: Vec<Tensor> = cpu.iter().map(|t| t.to_device(tpu).unwrap()).collect();
        let got = compiled.call(&on_tpu).unwrap();
        for ((g, w), n) in got.iter().zip(&f(&cpu).unwrap()).zip(NAMES) {
            close(&format!("{n}, call {call}"), g, w, 2e-6);
        }
    }
    let s = compiled.stats();
    assert_eq!(s.retraces, 0, "{s:?}");
    assert!(s.replays >= 2, "the traced step replays: {s:?}");
}

#[test]
fn fuses_under_defer_and_shows_in_profiles() {
    common::devices();
    let dev = Device::Tpu(0);
    kiln::tpu::with_mode(kiln::tpu::Mode::Defer, || {
        let (x, r, w) =
            (input(&[4, 8], 1, DType::F32, dev), input(&[4, 8], 2, DType::F32, dev), input(&[8], 3, DType::F32, dev));
        kiln::tpu::sync().unwrap();
        let before = kiln::tpu::stats().unwrap();
        let (h, y) = add_rms_norm(&x.mul(2.0).unwrap(), &r, &w, EPS).unwrap();
        let total = h.add(&y).unwrap().sum().unwrap().item::<f32>().unwrap();
        let after = kiln::tpu::stats().unwrap();
        assert_eq!(after.graphs - before.graphs, 1, "the mul, the custom op, the add and the sum: one program");
        let (h2, y2) = add_rms_norm(
            &x.mul(2.0).unwrap().to_device(Device::Cpu).unwrap(),
            &r.to_device(Device::Cpu).unwrap(),
            &w.to_device(Device::Cpu).unwrap(),
            EPS,
        )
        .unwrap();
        let want = h2.add(&y2).unwrap().sum().unwrap().item::<f32>().unwrap();
        assert!((total - want).abs() < 1e-4 * (1.0 + want.abs()), "{total} vs {want}");
    });
    kiln::tensor::profile::enable(true);
    let cpu = input(&[4, 8], 1, DType::F32, Device::Cpu);
    add_rms_norm(&cpu, &cpu, &input(&[8], 3, DType::F32, Device::Cpu), EPS).unwrap();
    let rows = kiln::tensor::profile::take();
    kiln::tensor::profile::enable(false);
    assert!(rows.iter().any(|r| r.op == "add_rms_norm" && r.shapes == "[4, 8] [4, 8] [8]"), "{rows:?}");
}

/// A 4-device mesh and x, residual [8, 16] and weight [16] on the CPU.
fn mesh_and_inputs() -> (kiln::DeviceMesh, Tensor, Tensor, Tensor) {
    let mesh = kiln::init_device_mesh(kiln::DeviceKind::Tpu, &[4], &["dp"]).unwrap();
    let cpu = |shape: &[usize], seed| input(shape, seed, DType::F32, Device::Cpu);
    (mesh, cpu(&[8, 16], 1), cpu(&[8, 16], 2), cpu(&[16], 3))
}

#[test]
fn distributed_inputs_are_gathered_whole() {
    common::devices();
    let (mesh, x, r, w) = mesh_and_inputs();
    let split = |t: &Tensor| kiln::distribute_tensor(t, &mesh, &[kiln::Placement::Shard(0)]).unwrap();
    let rep = kiln::distribute_tensor(&w, &mesh, &[kiln::Placement::Replicate]).unwrap();
    let (h, y) = add_rms_norm(&split(&x), &split(&r), &rep, EPS).unwrap();
    let (hw, yw) = add_rms_norm(&x, &r, &w, EPS).unwrap();
    close("h", &h.full_tensor().unwrap(), &hw, 1e-6);
    close("y", &y.full_tensor().unwrap(), &yw, 1e-6);
}

#[test]
fn runs_in_local_regions_eagerly_and_compiled() {
    common::devices();
    let (mesh, x, r, w) = mesh_and_inputs();
    let (hw, yw) = add_rms_norm(&x, &r, &w, EPS).unwrap();
    let (split, rep) = (vec![kiln::Placement::Shard(0)], vec![kiln::Placement::Replicate]);
    let region = |t: &[Tensor]| -> Result<Vec<Tensor>> {
        let (h, y) = add_rms_norm(&t[0], &t[1], &t[2], EPS)?;
        Ok(vec![h, y])
    };
    let m = mesh.clone();
    let places = (vec![split.clone(), split.clone(), rep.clone()], vec![split.clone(), split.clone()]);
    let run = move |t: &[Tensor]| kiln::local_map(region, &m, &places.0, &places.1, &[&t[0], &t[1], &t[2]]);
    let got = run(&[x.clone(), r.clone(), w.clone()]).unwrap();
    close("h, eager region", &got[0].full_tensor().unwrap(), &hw, 1e-6);
    close("y, eager region", &got[1].full_tensor().unwrap(), &yw, 1e-6);
    let on_mesh: Vec<Tensor> = [(&x, &split), (&r, &split), (&w, &rep)]
        .iter()
        .map(|(t, p)| kiln::distribute_tensor(t, &mesh, p).unwrap())
        .collect();
    let mut compiled = kiln::compile(mesh.device(), run);
    for call in 0..3 {
        let got = compiled.call(&on_mesh).unwrap();
        close(&format!("y, compiled region, call {call}"), &got[1].full_tensor().unwrap(), &yw, 1e-6);
    }
    assert!(compiled.stats().replays >= 1, "{:?}", compiled.stats());
}

/// An op with a CPU kernel only, whose kernel can be told to misbehave.
struct Twice {
    wrong_length: bool,
}

impl CustomOp for Twice {
    fn name(&self) -> &'static str {
        "twice"
    }
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }
    fn cpu(&self, inputs: &[HostInput<'_>], _outputs: &[Meta]) -> Result<Vec<HostBuffer>> {
        let mut v: Vec<f32> = inputs[0].contiguous::<f32>()?.iter().map(|x| x * 2.0).collect();
        if self.wrong_length {
            v.pop();
        }
        Ok(vec![HostBuffer::F32(v)])
    }
}

/// An op whose lowering does not compile.
struct BadLowering;

impl CustomOp for BadLowering {
    fn name(&self) -> &'static str {
        "bad_lowering"
    }
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }
    fn cpu(&self, _: &[HostInput<'_>], _: &[Meta]) -> Result<Vec<HostBuffer>> {
        Ok(vec![])
    }
    fn stablehlo(&self, _: &[Meta], _: &[Meta]) -> Result<Lowering> {
        Ok(Lowering::Function(
            "    %y = stablehlo.not_an_op %arg0 : tensor<3xf32>\n    return %y : tensor<3xf32>".into(),
        ))
    }
}

#[test]
fn incomplete_or_wrong_ops_are_clear_errors() {
    common::devices();
    let tpu = Device::Tpu(0);
    let x = Tensor::new([1.0f32, 2.0, 3.0]).unwrap();
    let twice: Arc<dyn CustomOp> = Arc::new(Twice { wrong_length: false });
    let y = Tensor::apply_custom(&twice, &[&x]).unwrap();
    assert_eq!(y[0].to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    // No gradient defined: backward names the op.
    let xg = leaf(&x);
    let y = Tensor::apply_custom(&twice, &[&xg]).unwrap();
    assert_err(y[0].sum().unwrap().backward(), &["twice", "no gradient"]);
    // No lowering: the PJRT device names the op.
    assert_err(Tensor::apply_custom(&twice, &[&x.to_device(tpu).unwrap()]), &["twice", "no StableHLO lowering"]);
    // A kernel that returns the wrong length.
    let short: Arc<dyn CustomOp> = Arc::new(Twice { wrong_length: true });
    assert_err(Tensor::apply_custom(&short, &[&x]), &["twice", "2 x float32", "[3]"]);
    // A lowering the plugin refuses: the error names the custom op.
    let bad: Arc<dyn CustomOp> = Arc::new(BadLowering);
    assert_err(Tensor::apply_custom(&bad, &[&x.to_device(tpu).unwrap()]), &["custom ops", "bad_lowering"]);
    // Deferred, the failure surfaces where the program runs (the first read),
    // and every value of the failed program says it was never computed.
    kiln::tpu::with_mode(kiln::tpu::Mode::Defer, || {
        let xt = x.to_device(tpu).unwrap();
        let before = xt.mul(2.0).unwrap();
        let y = Tensor::apply_custom(&bad, &[&xt]).unwrap();
        assert_err(y[0].to_vec::<f32>(), &["custom ops", "bad_lowering"]);
        assert_err(y[0].to_vec::<f32>(), &["deferred op", "did not run"]);
        assert_err(before.to_vec::<f32>(), &["deferred op", "did not run"]);
        // The device defers afresh.
        assert_eq!(xt.add(1.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 3.0, 4.0]);
    });
    // The op's own typing errors come first.
    let (a, b) = (input(&[2, 4], 1, DType::F32, Device::Cpu), input(&[2, 5], 1, DType::F32, Device::Cpu));
    assert_err(add_rms_norm(&a, &b, &input(&[4], 1, DType::F32, Device::Cpu), EPS), &["add_rms_norm", "one shape"]);
    assert_err(add_rms_norm(&a, &a, &input(&[4], 1, DType::F64, Device::Cpu), EPS), &["add_rms_norm", "float64"]);
    // An output written in place before backward.
    let xg = leaf(&a);
    let (h, y) = add_rms_norm(&xg, &a, &input(&[4], 1, DType::F32, Device::Cpu), EPS).unwrap();
    let loss = y.sum().unwrap();
    {
        let _g = kiln::autograd::no_grad();
        h.add_(1.0).unwrap();
    }
    assert_err(loss.backward(), &["add_rms_norm", "modified by an in-place operation"]);
}

/// The top 3 of each row through XLA's own `TopK` call target: a kernel the
/// plugin provides, called with `stablehlo.custom_call`.
struct TopThree;

impl CustomOp for TopThree {
    fn name(&self) -> &'static str {
        "top_three"
    }
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        let rows = inputs[0].shape[0];
        Ok(vec![Meta::new(&[rows, 3], DType::F32), Meta::new(&[rows, 3], DType::I32)])
    }
    fn cpu(&self, inputs: &[HostInput<'_>], _: &[Meta]) -> Result<Vec<HostBuffer>> {
        let (x, n) = (inputs[0].contiguous::<f32>()?, inputs[0].shape()[1]);
        let (mut v, mut i) = (vec![], vec![]);
        for row in x.chunks(n) {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            v.extend(order[..3].iter().map(|&j| row[j]));
            i.extend(order[..3].iter().map(|&j| j as i32));
        }
        Ok(vec![HostBuffer::F32(v), HostBuffer::I32(i)])
    }
    fn stablehlo(&self, _: &[Meta], _: &[Meta]) -> Result<Lowering> {
        Ok(Lowering::CustomCall { target: "TopK".into(), api_version: 1, backend_config: String::new() })
    }
}

#[test]
fn custom_calls_reach_the_plugins_kernels() {
    common::devices();
    let op: Arc<dyn CustomOp> = Arc::new(TopThree);
    let x = input(&[4, 10], 5, DType::F32, Device::Cpu);
    let want = Tensor::apply_custom(&op, &[&x]).unwrap();
    let got = Tensor::apply_custom(&op, &[&x.to_device(Device::Tpu(0)).unwrap()]).unwrap();
    assert_eq!(got[0].to_vec::<f32>().unwrap(), want[0].to_vec::<f32>().unwrap());
    assert_eq!(got[1].to_vec::<i32>().unwrap(), want[1].to_vec::<i32>().unwrap());
}

#[test]
fn the_readme_example_runs() {
    common::devices();
    readme_example::main().unwrap();
}

/// An op whose gradient has the wrong shape or dtype.
struct WrongGradient {
    dtype: DType,
    shape: Vec<usize>,
}

impl CustomOp for WrongGradient {
    fn name(&self) -> &'static str {
        "wrong_gradient"
    }
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }
    fn cpu(&self, inputs: &[HostInput<'_>], _: &[Meta]) -> Result<Vec<HostBuffer>> {
        Ok(vec![HostBuffer::F32(inputs[0].contiguous::<f32>()?.into_owned())])
    }
    fn backward(&self, _: &[Tensor], _: &[Tensor], _: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(Tensor::zeros(&self.shape, self.dtype)?)])
    }
}

#[test]
fn gradients_of_the_wrong_shape_or_dtype_are_errors() {
    let x = leaf(&Tensor::new([1.0f32, 2.0, 3.0]).unwrap());
    for (op, want) in [
        (WrongGradient { dtype: DType::F64, shape: vec![3] }, "dtype float64"),
        (WrongGradient { dtype: DType::F32, shape: vec![2] }, "shape [2]"),
    ] {
        let op: Arc<dyn CustomOp> = Arc::new(op);
        let y = Tensor::apply_custom(&op, &[&x]).unwrap();
        assert_err(y[0].sum().unwrap().backward(), &["wrong_gradient", want]);
    }
}

/// Records whether its CPU kernel ran on a thread of rayon's pool.
struct WhereAmI(std::sync::Mutex<Vec<bool>>);

impl CustomOp for WhereAmI {
    fn name(&self) -> &'static str {
        "where_am_i"
    }
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }
    fn cpu(&self, inputs: &[HostInput<'_>], _outputs: &[Meta]) -> Result<Vec<HostBuffer>> {
        self.0.lock().unwrap().push(rayon::current_thread_index().is_some());
        Ok(vec![HostBuffer::F32(inputs[0].contiguous::<f32>()?.into_owned())])
    }
}

/// A program captured on the CPU replays on the compute threads (a team's
/// leader, Note [Teams of compute threads] in kiln-cpu), whatever thread
/// calls it, as a loop of eager ops run through `on_compute_threads` does.
#[test]
fn compiled_programs_replay_on_the_compute_threads() {
    let probe = Arc::new(WhereAmI(Default::default()));
    let op: Arc<dyn CustomOp> = probe.clone();
    let mut step = kiln::compile(Device::Cpu, move |xs: &[Tensor]| {
        Ok(vec![Tensor::apply_custom(&op, &[&xs[0].add(&xs[0])?])?.remove(0)])
    });
    let x = Tensor::new([1.0f32, 2.0]).unwrap();
    for _ in 0..4 {
        assert_eq!(step.call(std::slice::from_ref(&x)).unwrap()[0].to_vec::<f32>().unwrap(), [2.0, 4.0]);
    }
    assert!(step.stats().replays >= 1, "{:?}", step.stats());
    assert!(rayon::current_thread_index().is_none(), "the test calls from outside the pool");
    let seen = probe.0.lock().unwrap().clone();
    assert_eq!(seen.last(), Some(&true), "the replay's kernel ran on the calling thread: {seen:?}");
}
