//! SPMD programs over a device mesh on the XLA:CPU plugin's four devices: the
//! compile options, sharded arguments and results (Shardy annotations), one
//! execution over every device in the executable's device order, the compile
//! cache keyed by device assignment, and the errors of a wrong launch.
mod support;

use kiln_tensor::{DType, DeviceKind, DeviceMesh, PartialOp, Placement};
use kiln_tpu::lower::{mesh_decl, Builder, Sharding, Ty};
use kiln_tpu::pjrt::{Buffer, CompileOptions};
use support::setup;

fn tpu_mesh(shape: &[usize], names: &[&str]) -> DeviceMesh {
    setup();
    kiln_tensor::init_device_mesh(DeviceKind::Tpu, shape, names).unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum();
        }
    }
    y
}

/// One output: each device's shard, in mesh order.
type Shards = Vec<Vec<f32>>;

/// A host tensor and its sharding: what each device of the mesh gets.
struct Input<'a> {
    data: &'a [f32],
    shape: &'a [usize],
    sharding: &'a Sharding,
}

/// Compiles `text` for `mesh`, runs it once over every device with each
/// input cut into shards, and returns each output's per-device shards in mesh
/// order (position i = the mesh's i-th device), with the execution's device order.
fn run_spmd(
    mesh: &DeviceMesh,
    text: &str,
    inputs: &[Input<'_>],
    outs: &[(&[usize], &Sharding)],
) -> kiln_tensor::Result<(Vec<Shards>, Vec<usize>)> {
    let b = kiln_tpu::backend()?;
    let client = b.client();
    let ids: Vec<i64> = mesh.devices().iter().map(|&d| client.device_id(d)).collect::<kiln_tensor::Result<_>>()?;
    let exe = b.executable_of_text(text, &CompileOptions::spmd(&ids))?;
    let order = exe.addressable_devices()?;
    let mut bufs: Vec<Vec<Buffer>> = vec![];
    for &d in &order {
        let pos = mesh.devices().iter().position(|&m| m == d).expect("an executable device of the mesh");
        let mut on_d = vec![];
        for inp in inputs {
            let bytes = inp.sharding.shard_bytes(&f32_bytes(inp.data), 4, inp.shape, pos);
            on_d.push(client.buffer_from_host(&bytes, DType::F32, &inp.sharding.shard_shape(inp.shape), d)?);
        }
        bufs.push(on_d);
    }
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|v| v.iter().collect()).collect();
    let meta: Vec<(DType, Vec<usize>)> = outs.iter().map(|(shape, s)| (DType::F32, s.shard_shape(shape))).collect();
    let (results, events) = exe.execute_spmd(&args, &meta, &[], 0)?;
    assert_eq!(events.len(), order.len());
    for e in &events {
        e.wait("an SPMD program")?;
    }
    let mut per_out = vec![vec![vec![]; mesh.devices().len()]; outs.len()];
    for (dev_outs, &d) in results.iter().zip(&order) {
        let pos = mesh.devices().iter().position(|&m| m == d).unwrap();
        for (o, buf) in dev_outs.iter().enumerate() {
            let mut bytes = vec![0u8; buf.numel() * 4];
            buf.copy_to_host(&mut bytes)?;
            per_out[o][pos] = from_bytes(&bytes);
        }
    }
    Ok((per_out, order))
}

/// The full tensor from its shards (each device's shard in mesh order).
fn assemble(shards: &[Vec<f32>], shape: &[usize], s: &Sharding) -> Vec<f32> {
    let mut out = vec![0u8; shape.iter().product::<usize>() * 4];
    for (pos, sh) in shards.iter().enumerate() {
        s.unshard_into(&f32_bytes(sh), 4, shape, pos, &mut out);
    }
    from_bytes(&out)
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()))
}

fn data(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * 0.37 + seed).sin() * 2.0).round() / 2.0).collect()
}

fn matmul_program(sx: &Sharding, sw: &Sharding, sy: &Sharding) -> String {
    let mut b = Builder::new(&[]).0;
    let x = b.add_sharded_arg(Ty::new(&[8, 16], DType::F32), sx.clone()).unwrap();
    let w = b.add_sharded_arg(Ty::new(&[16, 4], DType::F32), sw.clone()).unwrap();
    let y = b.dot_general(&x, &w, &[], &[], &[1], &[0]);
    b.finish_sharded(&[y], std::slice::from_ref(sy)).unwrap().text()
}

#[test]
fn a_sharded_matmul_runs_on_four_devices() {
    setup();
    let mesh = kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[4], &["x"]).unwrap();
    let (x, w) = (data(128, 0.1), data(64, 0.7));
    let want = matmul(&x, &w, 8, 16, 4);
    let sx = Sharding::from_placements(&mesh, &[Placement::Shard(1)], 2).unwrap();
    let sw = Sharding::from_placements(&mesh, &[Placement::Shard(0)], 2).unwrap();
    let rep = Sharding::replicated(&mesh, 2);
    let text = matmul_program(&sx, &sw, &rep);
    assert!(text.contains(r#"sdy.mesh @mesh = <["x"=4]>"#) && text.contains("mhlo.num_partitions = 4"), "{text}");
    let inputs =
        [Input { data: &x, shape: &[8, 16], sharding: &sx }, Input { data: &w, shape: &[16, 4], sharding: &sw }];
    let (outs, order) = run_spmd(&mesh, &text, &inputs, &[(&[8, 4], &rep)]).unwrap();
    assert_eq!(order, vec![0, 1, 2, 3]);
    // The partitioner all-reduced the partial products: every device holds the whole result.
    for (d, y) in outs[0].iter().enumerate() {
        assert!(close(y, &want), "device {d}: {y:?} vs {want:?}");
    }

    // Partial(sum) results: each device keeps its partial product, which add up to the result.
    let partial = Sharding::from_placements(&mesh, &[Placement::Partial(PartialOp::Sum)], 2).unwrap();
    let text = matmul_program(&sx, &sw, &partial);
    assert!(text.contains(r#"unreduced={"x"}"#), "{text}");
    let (outs, _) = run_spmd(&mesh, &text, &inputs, &[(&[8, 4], &partial)]).unwrap();
    let xs = &x;
    for (d, y) in outs[0].iter().enumerate() {
        let own = matmul(
            &(0..8)
                .flat_map(|i| (0..16).map(move |p| if p / 4 == d { xs[i * 16 + p] } else { 0.0 }))
                .collect::<Vec<_>>(),
            &w,
            8,
            16,
            4,
        );
        assert!(close(y, &own), "device {d} holds its own partial product");
    }
    let sum: Vec<f32> = (0..32).map(|i| outs[0].iter().map(|y| y[i]).sum()).collect();
    assert!(close(&sum, &want));
}

#[test]
fn a_two_dimensional_mesh_shards_rows_over_dp_and_the_contraction_over_tp() {
    setup();
    let mesh = kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp", "tp"]).unwrap();
    let (x, w) = (data(128, 0.3), data(64, 0.9));
    let want = matmul(&x, &w, 8, 16, 4);
    let sx = Sharding::from_placements(&mesh, &[Placement::Shard(0), Placement::Shard(1)], 2).unwrap();
    // w through the "tp" sub-mesh: split over tp, replicated over dp.
    let sw = Sharding::from_placements(&mesh["tp"], &[Placement::Shard(0)], 2).unwrap();
    let sy = Sharding::from_placements(&mesh["dp"], &[Placement::Shard(0)], 2).unwrap();
    let text = matmul_program(&sx, &sw, &sy);
    let inputs =
        [Input { data: &x, shape: &[8, 16], sharding: &sx }, Input { data: &w, shape: &[16, 4], sharding: &sw }];
    let (outs, _) = run_spmd(&mesh, &text, &inputs, &[(&[8, 4], &sy)]).unwrap();
    // Rows 0-3 on the dp=0 devices (0 and 1), rows 4-7 on the dp=1 devices (2 and 3).
    assert!(close(&outs[0][0], &want[..16]) && close(&outs[0][1], &want[..16]));
    assert!(close(&outs[0][2], &want[16..]) && close(&outs[0][3], &want[16..]));
    assert!(close(&assemble(&outs[0], &[8, 4], &sy), &want));
}

#[test]
fn the_device_assignment_is_part_of_the_cache_key_and_sets_the_device_order() {
    setup();
    let b = kiln_tpu::backend().unwrap();
    let fwd = kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[4], &["x"]).unwrap();
    let rev = DeviceMesh::new(DeviceKind::Tpu, &[3, 2, 1, 0], &[4], &["x"]).unwrap();
    // An uneven split (f32[10] over 4 devices: shards of 3, the last padded), doubled.
    let v: Vec<f32> = (0..10).map(|i| i as f32).collect();
    // The program carries the padded [12]; it computes on the logical [10] and pads its result back.
    let program = |m: &DeviceMesh| {
        let s = Sharding::from_placements(m, &[Placement::Shard(0)], 1).unwrap();
        assert_eq!(s.padded_shape(&[10]), vec![12]);
        let mut bl = Builder::new(&[]).0;
        let a = bl.add_sharded_arg(Ty::new(&[12], DType::F32), s.clone()).unwrap();
        let a = bl.slice(&a, &[0], &[10], &[1]);
        let y = bl.add(&a, &a);
        let y = bl.pad(&y, kiln_tpu::lower::Lit::F(0.0), &[0], &[2]);
        (bl.finish_sharded(&[y], std::slice::from_ref(&s)).unwrap().text(), s)
    };
    let (text, s) = program(&fwd);
    assert_eq!(program(&rev).0, text, "the same program text on both meshes");
    let inputs = [Input { data: &v, shape: &[10], sharding: &s }];
    let (outs, order) = run_spmd(&fwd, &text, &inputs, &[(&[12], &s)]).unwrap();
    assert_eq!(order, vec![0, 1, 2, 3]);
    let want: Vec<f32> = v.iter().map(|x| 2.0 * x).collect();
    assert_eq!(assemble(&outs[0], &[10], &s), want);
    assert_eq!(outs[0][3], vec![18.0, 0.0, 0.0]);

    let s_rev = program(&rev).1;
    let inputs = [Input { data: &v, shape: &[10], sharding: &s_rev }];
    let (outs, order) = run_spmd(&rev, &text, &inputs, &[(&[12], &s_rev)]).unwrap();
    assert_eq!(order, vec![3, 2, 1, 0], "partition i runs on the mesh's i-th device");
    assert_eq!(assemble(&outs[0], &[10], &s_rev), want);
    // Two assignments, two executables; asking again finds each one.
    let exe = |ids: &[i64]| b.executable_of_text(&text, &CompileOptions::spmd(ids)).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&exe(&[0, 1, 2, 3]), &exe(&[3, 2, 1, 0])));
    assert!(std::sync::Arc::ptr_eq(&exe(&[3, 2, 1, 0]), &exe(&[3, 2, 1, 0])));
    assert_eq!(exe(&[3, 2, 1, 0]).addressable_devices().unwrap(), vec![3, 2, 1, 0]);
}

#[test]
fn a_wrong_launch_is_an_error_and_never_hangs() {
    setup();
    let b = kiln_tpu::backend().unwrap();
    let client = b.client();
    let mesh = kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[4], &["x"]).unwrap();
    let sx = Sharding::from_placements(&mesh, &[Placement::Shard(1)], 2).unwrap();
    let sw = Sharding::from_placements(&mesh, &[Placement::Shard(0)], 2).unwrap();
    let text = matmul_program(&sx, &sw, &Sharding::replicated(&mesh, 2));
    let exe = b.executable_of_text(&text, &CompileOptions::spmd(&[0, 1, 2, 3])).unwrap();
    let shard = |shape: &[usize], d: usize| {
        client.buffer_from_host(&vec![0u8; shape.iter().product::<usize>() * 4], DType::F32, shape, d).unwrap()
    };
    let meta = [(DType::F32, vec![8, 4])];
    // Fewer device lists than devices: refused before launching (the others would wait forever).
    let bufs: Vec<Vec<Buffer>> = (0..3).map(|d| vec![shard(&[8, 4], d), shard(&[4, 4], d)]).collect();
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|v| v.iter().collect()).collect();
    let e = exe.execute_spmd(&args, &meta, &[], 0).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("runs on 4 devices") && e.contains("3 argument lists"), "{e}");
    // A shard of the wrong shape: the plugin's error, surfaced.
    let bufs: Vec<Vec<Buffer>> = (0..4).map(|d| vec![shard(&[8, 16], d), shard(&[4, 4], d)]).collect();
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|v| v.iter().collect()).collect();
    let e = exe.execute_spmd(&args, &meta, &[], 0).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("f32[8,4]") || e.contains("size"), "{e}");
    // A shard on the wrong device.
    let bufs: Vec<Vec<Buffer>> = (0..4).map(|d| vec![shard(&[8, 4], (d + 1) % 4), shard(&[4, 4], d)]).collect();
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|v| v.iter().collect()).collect();
    let e = exe.execute_spmd(&args, &meta, &[], 0).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("device"), "{e}");
    // A mesh larger than the client.
    let e = kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[4, 4], &["a", "b"]).unwrap_err().to_string();
    assert!(e.contains("KILN_PJRT_CPU_DEVICES"), "{e}");
}

#[test]
fn placements_become_shardy_annotations() {
    let m = tpu_mesh(&[2, 2], &["dp", "tp"]);
    assert_eq!(mesh_decl(&m), r#"sdy.mesh @mesh = <["dp"=2, "tp"=2]>"#);
    let s = Sharding::from_placements(&m, &[Placement::Shard(0), Placement::Shard(1)], 2).unwrap();
    assert_eq!(s.attr(), r#"#sdy.sharding<@mesh, [{"dp"}, {"tp"}]>"#);
    // Both axes on one dimension: the mesh's axis order, major first.
    let s = Sharding::from_placements(&m, &[Placement::Shard(0), Placement::Shard(0)], 2).unwrap();
    assert_eq!(s.attr(), r#"#sdy.sharding<@mesh, [{"dp", "tp"}, {}]>"#);
    let s = Sharding::from_placements(&m, &[Placement::Replicate, Placement::Partial(PartialOp::Sum)], 1).unwrap();
    assert_eq!(s.attr(), r#"#sdy.sharding<@mesh, [{}], unreduced={"tp"}>"#);
    // A sub-mesh names only its axes; the declaration is the root's.
    let tp = m.sub(&["tp"]).unwrap();
    let s = Sharding::from_placements(&tp, &[Placement::Shard(1)], 2).unwrap();
    assert_eq!(s.attr(), r#"#sdy.sharding<@mesh, [{}, {"tp"}]>"#);
    assert_eq!(mesh_decl(&s.mesh), mesh_decl(&m));
    // Errors: the placement count and the sharded dimension.
    let e = Sharding::from_placements(&m, &[Placement::Shard(0)], 2).unwrap_err().to_string();
    assert!(e.contains("1 placements for a mesh of 2 axes"), "{e}");
    let e = Sharding::from_placements(&m, &[Placement::Shard(2), Placement::Replicate], 2).unwrap_err().to_string();
    assert!(e.contains("Shard(dim=2) of a tensor with 2 dimension(s)"), "{e}");
}

#[test]
fn uneven_shards_are_padded_and_round_trip() {
    let m = tpu_mesh(&[4], &["x"]);
    let s = Sharding::from_placements(&m, &[Placement::Shard(0)], 1).unwrap();
    // f32[10] over 4 devices: 3, 3, 3 and 1 real elements, each shard f32[3].
    assert_eq!(s.shard_shape(&[10]), vec![3]);
    let full: Vec<u8> = (0..10u8).collect();
    let shards: Vec<Vec<u8>> = (0..4).map(|d| s.shard_bytes(&full, 1, &[10], d)).collect();
    assert_eq!(shards, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8], vec![9, 0, 0]]);
    let mut back = vec![0xffu8; 10];
    for (d, sh) in shards.iter().enumerate() {
        s.unshard_into(sh, 1, &[10], d, &mut back);
    }
    assert_eq!(back, full);
    // f32[5] over 4: chunks of 2, the last device holds nothing real.
    assert_eq!(s.shard_bytes(&full[..5], 1, &[5], 3), vec![0, 0]);
}

#[test]
fn two_dimensional_shards_follow_mesh_coordinates() {
    let m = tpu_mesh(&[2, 2], &["dp", "tp"]);
    // [3, 4] with dim 0 over dp and dim 1 over tp: shards [2, 2].
    let s = Sharding::from_placements(&m, &[Placement::Shard(0), Placement::Shard(1)], 2).unwrap();
    let full: Vec<u8> = (0..12u8).collect();
    assert_eq!(s.shard_shape(&[3, 4]), vec![2, 2]);
    assert_eq!(s.shard_bytes(&full, 1, &[3, 4], 0), vec![0, 1, 4, 5]);
    assert_eq!(s.shard_bytes(&full, 1, &[3, 4], 1), vec![2, 3, 6, 7]);
    assert_eq!(s.shard_bytes(&full, 1, &[3, 4], 2), vec![8, 9, 0, 0]);
    assert_eq!(s.shard_bytes(&full, 1, &[3, 4], 3), vec![10, 11, 0, 0]);
    // Dim 1 over dp then tp: device (dp, tp) holds chunk 2 dp + tp.
    let s = Sharding::from_placements(&m, &[Placement::Shard(1), Placement::Shard(1)], 2).unwrap();
    assert_eq!(s.chunk_index(1), vec![0, 1]);
    assert_eq!(s.chunk_index(2), vec![0, 2]);
    assert_eq!(s.shard_bytes(&full, 1, &[3, 4], 2), vec![2, 6, 10]);
    let mut back = vec![0u8; 12];
    for d in 0..4 {
        s.unshard_into(&s.shard_bytes(&full, 1, &[3, 4], d), 1, &[3, 4], d, &mut back);
    }
    assert_eq!(back, full);
    // Replicated: every device holds everything.
    let r = Sharding::replicated(&m, 2);
    assert!(r.is_replicated());
    assert_eq!(r.shard_bytes(&full, 1, &[3, 4], 3), full);
}

#[test]
fn meshes_have_named_axes_and_sub_meshes_keep_every_device() {
    let mesh = tpu_mesh(&[2, 2], &["dp", "tp"]);
    assert_eq!((mesh.shape(), mesh.ndim(), mesh.size()), (vec![2, 2], 2, 4));
    assert_eq!(mesh.axis_names(), vec!["dp", "tp"]);
    assert_eq!(mesh.devices(), &[0, 1, 2, 3]);
    assert_eq!(mesh.coordinates(2), vec![1, 0]);
    assert_eq!(mesh.to_string(), "DeviceMesh(tpu, [dp=2, tp=2], devices [0, 1, 2, 3])");
    // mesh["tp"]: one axis exposed, the root's devices kept (Note [Device meshes]).
    let tp = &mesh["tp"];
    assert_eq!((tp.shape(), tp.axis_names(), tp.devices()), (vec![2], vec!["tp"], &[0, 1, 2, 3][..]));
    assert_eq!(tp.to_string(), "DeviceMesh(tpu, [tp=2], devices [0, 1, 2, 3], of [dp=2, tp=2])");
    assert_eq!(tp.root(), mesh);
    assert_eq!(mesh.sub(&["tp", "dp"]).unwrap().shape(), vec![2, 2]);
    assert_eq!(mesh.sub(&["tp", "dp"]).unwrap().axis_names(), vec!["tp", "dp"]);
    assert!(std::ptr::eq(&mesh["dp"], &mesh["dp"]), "one sub-mesh per axis, made once");
    assert_ne!(mesh["dp"], mesh["tp"]);
    assert_eq!(mesh.axis_size("tp").unwrap(), 2);
    // An equal mesh made again compares equal; other devices do not.
    assert_eq!(tpu_mesh(&[2, 2], &["dp", "tp"]), mesh);
    assert_ne!(DeviceMesh::new(DeviceKind::Tpu, &[1, 0, 2, 3], &[2, 2], &["dp", "tp"]).unwrap(), mesh);
    // Errors.
    let err = |r: kiln_tensor::Result<DeviceMesh>| r.unwrap_err().to_string();
    assert!(err(mesh.sub(&["pp"])).contains("no axis \"pp\""));
    assert!(err(mesh["tp"].sub(&["dp"])).contains("not an axis of this mesh"));
    assert!(err(mesh.sub(&["dp", "dp"])).contains("named twice"));
    assert!(err(kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp"])).contains("1 axis names"));
    assert!(err(kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[2, 2], &["a", "a"])).contains("appears twice"));
    assert!(err(kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[2, 0], &["a", "b"])).contains("no empty axis"));
    assert!(err(kiln_tensor::init_device_mesh(DeviceKind::Tpu, &[4], &["x y"])).contains("not an identifier"));
    assert!(err(DeviceMesh::new(DeviceKind::Tpu, &[0, 0], &[2], &["x"])).contains("appears twice"));
    assert!(err(DeviceMesh::new(DeviceKind::Tpu, &[0, 1, 2], &[2], &["x"])).contains("needs 2 devices, 3 were given"));
    let panic = std::panic::catch_unwind(|| mesh["pp"].size()).unwrap_err();
    assert!(panic.downcast_ref::<String>().is_some_and(|m| m.contains("no axis \"pp\"")));
}

#[test]
fn each_device_can_launch_its_own_part_with_a_shared_launch_id() {
    // The multi-controller pattern: one thread per device (as one process per
    // device would) makes its own execute call; the all-reduce the partitioner
    // inserted finds its peers through the shared launch id.
    let mesh = tpu_mesh(&[4], &["x"]);
    let b = kiln_tpu::backend().unwrap();
    let client = b.client();
    let (x, w) = (data(128, 0.3), data(64, 0.9));
    let want = matmul(&x, &w, 8, 16, 4);
    let sx = Sharding::from_placements(&mesh, &[Placement::Shard(1)], 2).unwrap();
    let sw = Sharding::from_placements(&mesh, &[Placement::Shard(0)], 2).unwrap();
    let rep = Sharding::replicated(&mesh, 2);
    let text = matmul_program(&sx, &sw, &rep);
    let ids: Vec<i64> = mesh.devices().iter().map(|&d| client.device_id(d).unwrap()).collect();
    let exe = b.executable_of_text(&text, &CompileOptions::spmd(&ids)).unwrap();
    let meta = [(DType::F32, vec![8, 4])];
    let args: Vec<Vec<Buffer>> = (0..4)
        .map(|pos| {
            let xs = sx.shard_bytes(&f32_bytes(&x), 4, &[8, 16], pos);
            let ws = sw.shard_bytes(&f32_bytes(&w), 4, &[16, 4], pos);
            let d = mesh.devices()[pos];
            vec![
                client.buffer_from_host(&xs, DType::F32, &sx.shard_shape(&[8, 16]), d).unwrap(),
                client.buffer_from_host(&ws, DType::F32, &sw.shard_shape(&[16, 4]), d).unwrap(),
            ]
        })
        .collect();
    for launch in 0..3u64 {
        let id = kiln_tpu::pjrt::launch_id(text.as_bytes(), launch);
        assert_ne!(id, 0);
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|pos| {
                    let (exe, args, meta, d) = (&exe, &args[pos], &meta, mesh.devices()[pos]);
                    s.spawn(move || {
                        let refs: Vec<&Buffer> = args.iter().collect();
                        let (out, event) = exe.execute_sharded(d, &refs, meta, id).unwrap();
                        event.wait("one device's part").unwrap();
                        let mut bytes = vec![0u8; 32 * 4];
                        out[0].copy_to_host(&mut bytes).unwrap();
                        from_bytes(&bytes)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (pos, y) in outs.iter().enumerate() {
            assert!(close(y, &want), "launch {launch}, device {pos}: {y:?} vs {want:?}");
        }
    }
    // Launch id 0 would leave the devices waiting for each other: refused.
    let refs: Vec<&Buffer> = args[0].iter().collect();
    let e = exe.execute_sharded(mesh.devices()[0], &refs, &meta, 0).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("non-zero launch id"), "{e}");
    // The ids differ per launch and per program, and are the same in every process.
    let a = kiln_tpu::pjrt::launch_id(b"program", 1);
    assert_eq!(a, kiln_tpu::pjrt::launch_id(b"program", 1));
    assert_ne!(a, kiln_tpu::pjrt::launch_id(b"program", 2));
    assert_ne!(a, kiln_tpu::pjrt::launch_id(b"other", 1));
}

#[test]
fn a_device_that_never_launches_is_an_error_after_a_bounded_wait() {
    // Three of four devices launch their part; the fourth is late. Waiting on
    // the others gives up with an error instead of hanging; once the fourth
    // launches, the program completes.
    let mesh = tpu_mesh(&[4], &["x"]);
    let b = kiln_tpu::backend().unwrap();
    let client = b.client();
    let sx = Sharding::from_placements(&mesh, &[Placement::Shard(1)], 2).unwrap();
    let sw = Sharding::from_placements(&mesh, &[Placement::Shard(0)], 2).unwrap();
    let text = matmul_program(&sx, &sw, &Sharding::replicated(&mesh, 2));
    let ids: Vec<i64> = mesh.devices().iter().map(|&d| client.device_id(d).unwrap()).collect();
    let exe = b.executable_of_text(&text, &CompileOptions::spmd(&ids)).unwrap();
    let meta = [(DType::F32, vec![8, 4])];
    let args: Vec<Vec<Buffer>> = (0..4)
        .map(|pos| {
            let d = mesh.devices()[pos];
            vec![
                client.buffer_from_host(&f32_bytes(&data(32, 0.2)), DType::F32, &[8, 4], d).unwrap(),
                client.buffer_from_host(&f32_bytes(&data(16, 0.4)), DType::F32, &[4, 4], d).unwrap(),
            ]
        })
        .collect();
    let id = kiln_tpu::pjrt::launch_id(b"a late device", 1);
    let launch = |pos: usize| {
        let refs: Vec<&Buffer> = args[pos].iter().collect();
        exe.execute_sharded(mesh.devices()[pos], &refs, &meta, id).unwrap()
    };
    std::thread::scope(|s| {
        let early: Vec<_> = (0..3).map(|pos| s.spawn(move || launch(pos))).collect();
        let early: Vec<_> = early.into_iter().map(|h| h.join().unwrap()).collect();
        let t = std::time::Instant::now();
        let e = early[0].1.wait_within("device 0's part", std::time::Duration::from_millis(500)).unwrap_err();
        assert!(e.to_string().contains("did not complete within"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        let late = launch(3);
        for (_, ev) in early.iter().chain(std::iter::once(&late)) {
            ev.wait_within("every part", std::time::Duration::from_secs(60)).unwrap();
        }
    });
}

/// A `Program` lowered over a mesh (`lower_mesh_program`, DeferAndFuse's
/// programs on meshes): each parameter is an argument of its padded global
/// type carrying its storage's sharding, a sum over a split dimension is
/// returned unreduced, and a write into a parameter is donated to the result
/// that updates it, except where the update's sharding differs (a parameter
/// holding a partial sum is updated reduced).
#[test]
fn a_program_over_a_mesh_takes_its_parameters_shardings_and_donates_updates_in_place() {
    use kiln_tensor::ir::{ParamKind, Program, ResultKind};
    use kiln_tensor::{Meta, Op, ReduceOp, ViewOp};
    let m = tpu_mesh(&[2, 2], &["dp", "tp"]);
    let rows = Sharding::from_placements(&m, &[Placement::Shard(0), Placement::Replicate], 2).unwrap();
    let cols = Sharding::from_placements(&m, &[Placement::Replicate, Placement::Shard(1)], 2).unwrap();
    let mut p = Program::new();
    // `w` ([5, 4], rows split over dp, uneven) takes `w * 2`; `x` ([4, 6]) is summed over its split columns.
    let w = p.add_param(ParamKind::State, Meta::new(&[20], DType::F32));
    let x = p.add_param(ParamKind::State, Meta::new(&[24], DType::F32));
    let w2 = p.push(Op::View(ViewOp::Reshape([5, 4].as_slice().into())), &[w]).unwrap()[0];
    let x2 = p.push(Op::View(ViewOp::Reshape([4, 6].as_slice().into())), &[x]).unwrap()[0];
    let sum = Op::Reduce { op: ReduceOp::Sum, dims: [1].as_slice().into(), keepdim: false };
    let s = p.push(sum, &[x2]).unwrap()[0];
    let doubled = p.push(Op::Binary(kiln_tensor::BinaryOp::Add), &[w2, w2]).unwrap()[0];
    let write = Op::Assign { shape: [5, 4].as_slice().into(), strides: [4, 1].as_slice().into(), offset: 0 };
    let new_w = p.push(write, &[w, doubled]).unwrap()[0];
    p.add_result(new_w, ResultKind::Update(0)).unwrap();
    p.add_result(s, ResultKind::Fresh).unwrap();
    let lower = |w_sharding: &Sharding| {
        let params = vec![(w_sharding.clone(), vec![5, 4]), (cols.clone(), vec![4, 6])];
        kiln_tpu::lower::lower_mesh_program(&p, &m, params).unwrap()
    };
    let l = lower(&rows);
    let text = l.module.text();
    // `w`'s argument is padded to 6 rows (3 per dp device) and carries its sharding.
    let arg0 =
        r#"%a0: tensor<6x4xf32> {tf.aliasing_output = 0 : i32, sdy.sharding = #sdy.sharding<@mesh, [{"dp"}, {}]>}"#;
    assert!(text.contains(arg0), "{text}");
    assert!(text.contains(r#"%a1: tensor<4x6xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"tp"}]>}"#), "{text}");
    assert_eq!((&l.placements[0].sharding, &l.placements[0].shape[..]), (&rows, &[5, 4][..]));
    assert_eq!(l.placements[1].shape, vec![4]);
    assert_eq!(l.placements[1].sharding.attr(), r#"#sdy.sharding<@mesh, [{}], unreduced={"tp"}>"#);
    assert_eq!(l.outputs[0], (DType::F32, vec![3, 4]), "each device's shard of the padded update");
    // `w` holding a partial sum: its update is reduced, so the argument (of
    // another sharding) is not donated to it.
    let partial =
        Sharding::from_placements(&m, &[Placement::Replicate, Placement::Partial(PartialOp::Sum)], 2).unwrap();
    let l = lower(&partial);
    assert_eq!(l.placements[0].sharding, partial.reduced());
    assert!(!l.module.text().contains("tf.aliasing_output"), "{}", l.module.text());
}
