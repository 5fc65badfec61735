//! Local regions (`kiln::local_map`) on meshes of the XLA:CPU plugin's
//! devices: per-device code with manual collectives, each collective against
//! its definition computed on the CPU, in Strict, Debug and DeferAndFuse
//! mode and traced into compiled functions; gradients through regions and
//! collectives against the same math on the CPU; and the errors.
mod common;

use common::devices;
use kiln::prelude::*;
use kiln::tensor::collective::{all_gather, all_reduce, all_to_all, permute, reduce_scatter};
use kiln::tpu::{with_mode, Mode};
use kiln::{distribute_tensor, init_device_mesh, local_map, DeviceKind, DeviceMesh, Placement};
use Placement::{Replicate, Shard};

fn mesh(shape: &[usize], names: &[&str]) -> DeviceMesh {
    devices();
    init_device_mesh(DeviceKind::Tpu, shape, names).unwrap()
}

fn tensor(shape: &[usize], seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.61 + seed).sin() * 3.0).round() / 4.0).collect();
    Tensor::from_vec(v, shape).unwrap()
}

fn close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{what}: element {i}: {a} vs {b}\n{g:?}\n{w:?}");
    }
}

type Body = fn(&[Tensor]) -> kiln::Result<Vec<Tensor>>;

/// One region with one input and one output.
fn region(f: Body, m: &DeviceMesh, x: &Tensor, inp: &[Placement], out: &[Placement]) -> kiln::Result<Tensor> {
    Ok(local_map(f, m, &[inp.to_vec()], &[out.to_vec()], &[x])?.remove(0))
}

fn cat(parts: &[Tensor], dim: isize) -> Tensor {
    Tensor::cat(&parts.iter().collect::<Vec<_>>(), dim).unwrap()
}

/// Programs over meshes compile without the plugin's Shardy fallback: the
/// workspace's `.cargo/config.toml` tells XLA the sharding form kiln's SPMD
/// modules reach its compiler in (HloShardingV3 off, see the comment there),
/// so compiling a region's program afresh logs no "Disabling HloShardingV3".
#[test]
fn mesh_programs_compile_without_a_shardy_fallback_warning() {
    let off = std::ffi::OsStr::new("off");
    let (_, log) =
        common::run_ignored_test_in_child_with_stderr("a_region_compiled_afresh", &[("KILN_CACHE_DIR", off)], &[]);
    assert!(!log.contains("HloShardingV3"), "the plugin fell back:\n{log}");
}

#[test]
#[ignore = "a child process of mesh_programs_compile_without_a_shardy_fallback_warning"]
fn a_region_compiled_afresh() {
    let m = mesh(&[2, 2], &["dp", "tp"]);
    let x = tensor(&[4, 8], 0.7);
    let got = region(|b| Ok(vec![all_reduce(&b[0], "tp")?]), &m, &x, &[Shard(0), Shard(1)], &[Shard(0), Replicate]);
    let want = x.narrow(1, 0, 4).unwrap().add(&x.narrow(1, 4, 4).unwrap()).unwrap();
    close("all_reduce", &got.unwrap(), &want);
}

#[test]
fn collectives_exchange_blocks_as_defined() {
    let m22 = mesh(&[2, 2], &["dp", "tp"]);
    let m4 = mesh(&[4], &["x"]);
    let x = tensor(&[4, 8], 0.3); // blocks [2, 4] on the 2 x 2 mesh
    let y = tensor(&[8, 4], 1.1); // blocks [2, 4] on the 4-device mesh
    let (left, right) = (x.narrow(1, 0, 4).unwrap(), x.narrow(1, 4, 4).unwrap());
    let rows = |t: &Tensor, i: usize| t.narrow(0, 2 * i as isize, 2).unwrap();
    for mode in [Mode::Strict, Mode::Debug, Mode::Defer] {
        with_mode(mode, || {
            let what = |c: &str| format!("{c} in {mode:?} mode");
            let sharded = [Shard(0), Shard(1)];
            // The sum over "tp" of each row block's two column blocks, the same on both "tp" devices.
            let got = region(|b| Ok(vec![all_reduce(&b[0], "tp")?]), &m22, &x, &sharded, &[Shard(0), Replicate]);
            close(&what("all_reduce"), &got.unwrap(), &left.add(&right).unwrap());
            // The column blocks gathered back along dimension 1.
            let got = region(|b| Ok(vec![all_gather(&b[0], 1, "tp")?]), &m22, &x, &sharded, &[Shard(0), Replicate]);
            close(&what("all_gather"), &got.unwrap(), &x);
            // The sum's pieces: "tp" device t keeps columns 2t..2t+2 of the sum.
            let got = region(|b| Ok(vec![reduce_scatter(&b[0], 1, "tp")?]), &m22, &x, &sharded, &[Shard(0), Shard(1)]);
            close(&what("reduce_scatter"), &got.unwrap(), &left.add(&right).unwrap());
            // Row blocks become column blocks: device j gets column j of every row block.
            let got = region(|b| Ok(vec![all_to_all(&b[0], 1, 0, "x")?]), &m4, &y, &[Shard(0)], &[Shard(1)]);
            close(&what("all_to_all"), &got.unwrap(), &y);
            // A ring shift: device t gets device t-1's block.
            let ring: Body = |b| Ok(vec![permute(&b[0], &[(0, 1), (1, 2), (2, 3), (3, 0)], "x")?]);
            let got = region(ring, &m4, &y, &[Shard(0)], &[Shard(0)]).unwrap();
            close(&what("permute"), &got, &cat(&[rows(&y, 3), rows(&y, 0), rows(&y, 1), rows(&y, 2)], 0));
            // A device nothing is sent to gets zeros.
            let one: Body = |b| Ok(vec![permute(&b[0], &[(0, 1)], "x")?]);
            let got = region(one, &m4, &y, &[Shard(0)], &[Shard(0)]).unwrap();
            let z = Tensor::zeros(&[2, 4], DType::F32).unwrap();
            close(&what("partial permute"), &got, &cat(&[z.clone(), rows(&y, 0), z.clone(), z], 0));
            // Per-device code around the collectives, and several inputs and outputs.
            let two = local_map(
                |b: &[Tensor]| {
                    let s = all_reduce(&b[0].mul(&b[1])?.sum_dim(1, true)?, "tp")?;
                    Ok(vec![s.exp()?, b[0].add(1.0)?])
                },
                &m22,
                &[vec![Shard(0), Shard(1)], vec![Shard(0), Shard(1)]],
                &[vec![Shard(0), Replicate], vec![Shard(0), Shard(1)]],
                &[&x, &x.mul(0.5).unwrap()],
            )
            .unwrap();
            let want = x.mul(&x.mul(0.5).unwrap()).unwrap().sum_dim(1, true).unwrap().exp().unwrap();
            close(&what("two inputs"), &two[0], &want);
            close(&what("second output"), &two[1], &x.add(1.0).unwrap());
            assert_eq!(two[0].placements().unwrap(), vec![Shard(0), Replicate]);
            kiln::tpu::sync().unwrap();
        });
    }
}

#[test]
fn gradients_flow_through_regions_and_collectives() {
    let m4 = mesh(&[4], &["tp"]);
    let (x, w) = (tensor(&[3, 8], 0.2), tensor(&[8, 5], 0.9));
    // CPU reference: loss = sum((x @ w)^2 * c).
    let c = tensor(&[3, 5], 2.0);
    let reference = |x: &Tensor, w: &Tensor| -> (Tensor, Tensor) {
        let (x, w) = (x.detach(), w.detach());
        x.requires_grad_(true).unwrap();
        w.requires_grad_(true).unwrap();
        let y = x.matmul(&w).unwrap();
        y.mul(&y).unwrap().mul(&c).unwrap().sum().unwrap().backward().unwrap();
        (x.grad().unwrap(), w.grad().unwrap())
    };
    let (gx, gw) = reference(&x, &w);
    // Row parallel: each device multiplies its slice of the contraction, then the partial products are summed.
    let row = |x: &Tensor, w: &Tensor| {
        local_map(
            |b: &[Tensor]| Ok(vec![all_reduce(&b[0].matmul(&b[1])?, "tp")?]),
            &m4,
            &[vec![Shard(1)], vec![Shard(0)]],
            &[vec![Replicate]],
            &[x, w],
        )
        .unwrap()
        .remove(0)
    };
    for mode in [Mode::Strict, Mode::Defer] {
        with_mode(mode, || {
            // Leaves on the CPU: their gradients come back whole, on the CPU.
            let (xl, wl) = (x.detach(), w.detach());
            xl.requires_grad_(true).unwrap();
            wl.requires_grad_(true).unwrap();
            let y = row(&xl, &wl);
            let cm = c.to_device(m4.device()).unwrap();
            y.mul(&y).unwrap().mul(&cm).unwrap().sum().unwrap().backward().unwrap();
            close(&format!("x.grad ({mode:?})"), &xl.grad().unwrap(), &gx);
            close(&format!("w.grad ({mode:?})"), &wl.grad().unwrap(), &gw);
            assert_eq!(xl.grad().unwrap().device(), Device::Cpu);
            // Distributed leaves: their gradients keep the leaves' placements.
            let xd = distribute_tensor(&x, &m4, &[Shard(1)]).unwrap();
            let wd = distribute_tensor(&w, &m4, &[Replicate]).unwrap();
            xd.requires_grad_(true).unwrap();
            wd.requires_grad_(true).unwrap();
            let y = row(&xd, &wd);
            y.mul(&y).unwrap().mul(&cm).unwrap().sum().unwrap().backward().unwrap();
            close(&format!("distributed x.grad ({mode:?})"), &xd.grad().unwrap().full_tensor().unwrap(), &gx);
            close(&format!("distributed w.grad ({mode:?})"), &wd.grad().unwrap().full_tensor().unwrap(), &gw);
            assert_eq!(xd.grad().unwrap().placements().unwrap(), vec![Shard(1)]);
        });
    }
    // Each collective's gradient: loss = sum(out * c) for outputs whose global value is known.
    let y = tensor(&[8, 4], 1.3);
    let cy = tensor(&[8, 4], 0.4);
    let grad_of = |f: Body, inp: Placement, out: Placement| -> Tensor {
        let yl = y.detach();
        yl.requires_grad_(true).unwrap();
        let o = region(f, &m4, &yl, &[inp], &[out]).unwrap();
        o.mul(&cy.to_device(m4.device()).unwrap()).unwrap().sum().unwrap().backward().unwrap();
        yl.grad().unwrap()
    };
    // all_to_all from row to column blocks is the identity on the global value.
    close("all_to_all grad", &grad_of(|b| Ok(vec![all_to_all(&b[0], 1, 0, "tp")?]), Shard(0), Shard(1)), &cy);
    // A ring shift's gradient shifts back.
    let ring: Body = |b| Ok(vec![permute(&b[0], &[(0, 1), (1, 2), (2, 3), (3, 0)], "tp")?]);
    let r = |t: &Tensor, i: isize| t.narrow(0, 2 * i, 2).unwrap();
    close("permute grad", &grad_of(ring, Shard(0), Shard(0)), &cat(&[r(&cy, 1), r(&cy, 2), r(&cy, 3), r(&cy, 0)], 0));
    // Gathering row blocks is the identity on the global value (a replicated result).
    close("all_gather grad", &grad_of(|b| Ok(vec![all_gather(&b[0], 0, "tp")?]), Shard(0), Replicate), &cy);
    // A replicated input summed over the devices: out = 4 y; reduce_scatter keeps that sum's row pieces.
    let got = grad_of(|b| Ok(vec![reduce_scatter(&b[0], 0, "tp")?]), Replicate, Shard(0));
    close("reduce_scatter grad", &got, &cy.mul(4.0).unwrap());
    // The identity on a replicated input and output.
    close("identity grad", &grad_of(|b| Ok(vec![b[0].mul(1.0)?]), Replicate, Replicate), &cy);
}

#[test]
fn ops_that_check_their_indices_run_in_regions_and_report_any_devices_bad_index() {
    let m4 = mesh(&[4], &["x"]);
    let x = tensor(&[4, 3], 0.7);
    let gather: fn(&[Tensor]) -> kiln::Result<Vec<Tensor>> = |b| Ok(vec![b[0].index_select(0, &b[1])?]);
    let run = |idx: Vec<i64>| {
        let idx = Tensor::from_vec(idx, &[8]).unwrap();
        local_map(gather, &m4, &[vec![Replicate], vec![Shard(0)]], &[vec![Shard(0)]], &[&x, &idx])
    };
    for mode in [Mode::Strict, Mode::Debug, Mode::Defer] {
        with_mode(mode, || {
            let got = run(vec![0, 1, 2, 3, 1, 0, 3, 2]).unwrap().remove(0);
            let want = x.index_select(0, &Tensor::from_vec(vec![0i64, 1, 2, 3, 1, 0, 3, 2], &[8]).unwrap()).unwrap();
            close(&format!("index_select in {mode:?} mode"), &got, &want);
            // Only the third device's block holds a bad index: still an error, not a clamped row.
            let e = run(vec![0, 1, 2, 3, 1, 4, 3, 2]).unwrap_err().to_string();
            assert!(e.contains("out of bounds for dimension 0 with size 4"), "{mode:?}: {e}");
        });
    }
}

#[test]
fn regions_trace_into_compiled_functions() {
    let m4 = mesh(&[4], &["x"]);
    let place = |t: &Tensor| distribute_tensor(t, &m4, &[Shard(0)]).unwrap();
    // Per device: gather rows of its block by its indices, exchange them with
    // all_to_all, scale; the loss's gradient flows back through the exchange.
    let body = |b: &[Tensor]| -> kiln::Result<Vec<Tensor>> {
        let rows = b[0].index_select(0, &b[1])?;
        Ok(vec![all_to_all(&rows, 0, 0, "x")?.mul(2.0)?])
    };
    let run = |x: &Tensor, idx: &Tensor| -> kiln::Result<Vec<Tensor>> {
        let y = local_map(body, &m4, &[vec![Shard(0)], vec![Shard(0)]], &[vec![Shard(0)]], &[x, idx])?.remove(0);
        let loss = y.mul(&y)?.sum()?;
        let g = kiln::autograd::grad(&[&loss], &[x], None, false, false)?.remove(0).unwrap();
        Ok(vec![y, g])
    };
    // The body's host scalar (the 2.0) is one of the traced function's host values:
    // by default every call traces again, so that a changed value reaches the program.
    let mut c = kiln::compile(m4.device(), move |xs: &[Tensor]| run(&xs[0], &xs[1]));
    let (x, idx) =
        (tensor(&[16, 3], 0.1), Tensor::from_vec((0..16).map(|i| i % 4).collect::<Vec<i64>>(), &[16]).unwrap());
    for _ in 0..2 {
        let dx = place(&x);
        dx.requires_grad_(true).unwrap();
        c.call(&[dx, place(&idx)]).unwrap();
    }
    let s = c.stats();
    assert_eq!((s.host_value_traces, s.replays), (2, 0), "{s:?}");
    assert!(s.last_host_value.as_deref().unwrap_or("").contains("mul: the host scalar 2"), "{s:?}");
    // Declared constant, it replays.
    let mut c =
        kiln::compile(m4.device(), move |xs: &[Tensor]| run(&xs[0], &xs[1])).host_values(kiln::HostValues::Constant);
    for call in 0..4 {
        let x = tensor(&[16, 3], 0.2 + call as f32);
        let ids: Vec<i64> = (0..16).map(|i| (i * 3 + call) % 4).collect();
        let idx = Tensor::from_vec(ids.clone(), &[16]).unwrap();
        let (dx, didx) = (place(&x), place(&idx));
        dx.requires_grad_(true).unwrap();
        let got = c.call(&[dx.clone(), didx.clone()]).unwrap();
        // The same region run eagerly.
        let want = run(&dx, &didx).unwrap();
        close(&format!("call {call}: the region's result"), &got[0], &want[0]);
        close(&format!("call {call}: its gradient"), &got[1], &want[1]);
    }
    let s = c.stats();
    assert_eq!((s.retraces, s.calls), (0, 4), "{s:?}");
    assert!(s.replays >= 2, "{s:?}");
    // A bad index on one device is still the replayed program's error.
    let idx = Tensor::from_vec((0..16).map(|i| if i == 9 { 7 } else { i % 4 }).collect::<Vec<i64>>(), &[16]).unwrap();
    let x = place(&tensor(&[16, 3], 0.5));
    x.requires_grad_(true).unwrap();
    let e = c.call(&[x, place(&idx)]).unwrap_err().to_string();
    assert!(e.contains("out of bounds for dimension 0 with size 4"), "{e}");
}

#[test]
fn local_regions_refuse_what_they_cannot_do() {
    let m4 = mesh(&[4], &["x"]);
    let x = tensor(&[6, 4], 0.1);
    // Outside a region, a collective is an error.
    let e = all_reduce(&x.to_device(Device::Tpu(0)).unwrap(), "x").unwrap_err().to_string();
    assert!(e.contains("inside the function given to kiln::local_map"), "{e}");
    // Blocks of unequal shapes.
    let e = region(|b| Ok(vec![b[0].clone()]), &m4, &x, &[Shard(0)], &[Shard(0)]).unwrap_err().to_string();
    assert!(e.contains("does not split into equal blocks"), "{e}");
    let x = tensor(&[8, 4], 0.1);
    // An unknown axis, a bad dimension, a bad permutation, a partial placement.
    let e = region(|b| Ok(vec![all_reduce(&b[0], "tp")?]), &m4, &x, &[Shard(0)], &[Shard(0)]).unwrap_err().to_string();
    assert!(e.contains("no axis \"tp\""), "{e}");
    let e = region(|b| Ok(vec![reduce_scatter(&b[0], 0, "x")?]), &m4, &x, &[Shard(0)], &[Shard(0)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not split into 4 equal pieces"), "{e}");
    let e = region(|b| Ok(vec![permute(&b[0], &[(0, 1), (2, 1)], "x")?]), &m4, &x, &[Shard(0)], &[Shard(0)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("receives, twice"), "{e}");
    let partial = Placement::Partial(kiln::PartialOp::Sum);
    let e = region(|b| Ok(vec![b[0].clone()]), &m4, &x, &[Shard(0)], &[partial]).unwrap_err().to_string();
    assert!(e.contains("Shard and Replicate placements"), "{e}");
    // Tensors made outside must come in as inputs; inputs are not written in place.
    let outside = Tensor::ones(&[2, 4], (DType::F32, Device::Tpu(0))).unwrap();
    let e =
        local_map(move |b: &[Tensor]| Ok(vec![b[0].add(&outside)?]), &m4, &[vec![Shard(0)]], &[vec![Shard(0)]], &[&x])
            .unwrap_err()
            .to_string();
    assert!(e.contains("pass it among the inputs"), "{e}");
    let e = region(
        |b| {
            b[0].add_(1.0)?;
            Ok(vec![b[0].clone()])
        },
        &m4,
        &x,
        &[Shard(0)],
        &[Shard(0)],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("wrote in place"), "{e}");
    // A region inside a region.
    let nested: Body = |b| {
        let m = init_device_mesh(DeviceKind::Tpu, &[4], &["x"])?;
        local_map(|c: &[Tensor]| Ok(c.to_vec()), &m, &[vec![Replicate]], &[vec![Replicate]], &[&b[0]])
    };
    let e = region(nested, &m4, &x, &[Shard(0)], &[Shard(0)]).unwrap_err().to_string();
    assert!(e.contains("not inside another local region"), "{e}");
    // The inputs are untouched by the refused region.
    assert_eq!(x.to_vec::<f32>().unwrap(), tensor(&[8, 4], 0.1).to_vec::<f32>().unwrap());
    // A function that panics leaves nothing behind: ops afterwards run as usual.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        region(|_| panic!("inside the region"), &m4, &x, &[Shard(0)], &[Shard(0)])
    }));
    assert!(r.is_err());
    let y = x.to_device(Device::Tpu(0)).unwrap().add(1.0).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap()[0], x.to_vec::<f32>().unwrap()[0] + 1.0);
    // The CPU has no meshes.
    let e = kiln::tensor::collective::all_gather(&x, 0, "x").unwrap_err().to_string();
    assert!(e.contains("inside the function given to kiln::local_map"), "{e}");
}
