//! Collectives (`Op::Collective`) as StableHLO's cross-device ops, and the
//! Shardy `manual_computation` that holds them: the body of a local region
//! (see Note [Local regions] in kiln-tensor's `collective.rs`).
use super::{terminator, Attr, Builder, Name, NameKind, Operation, Region, Sharding, Ty, Val};
use kiln_tensor::collective::{Collective, CollectiveOp};
use kiln_tensor::{Error, Meta, Result};

/// Every collective of a program is cross-partition (`type = 1`); the groups
/// name partition ids, which are mesh positions (`use_global_device_ids`).
const CHANNEL: Attr = Attr::Channel { handle: 1, kind: 1 };

/// `dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>`.
fn int_matrix(rows: &[Vec<usize>], width: usize) -> Attr {
    Attr::IntRows { rows: rows.iter().map(|r| super::list(r)).collect(), width }
}

/// The lowering of one collective on the block `x`.
pub fn lower(b: &mut Builder, c: &CollectiveOp, x: &Val, out: &Meta) -> Val {
    let ty = Ty::new(&out.shape, out.dtype);
    let n = c.group_size();
    let groups = int_matrix(&c.groups, n);
    let sum = |b: &mut Builder| {
        let st = Ty::new(&[], x.dtype());
        b.region(&[st.clone(), st], |b, a| vec![b.add(&a[0], &a[1])])
    };
    let int = |v: usize| Attr::Int(v as i64, "i64");
    match &c.kind {
        Collective::AllReduce => {
            let region = sum(b);
            let attrs =
                vec![("channel_handle", CHANNEL), ("replica_groups", groups), ("use_global_device_ids", Attr::Unit)];
            b.op_region("stablehlo.all_reduce", &[x], region, attrs, ty)
        }
        Collective::AllGather { dim } => {
            let attrs = vec![
                ("all_gather_dim", int(*dim)),
                ("channel_handle", CHANNEL),
                ("replica_groups", groups),
                ("use_global_device_ids", Attr::Unit),
            ];
            b.op("stablehlo.all_gather", &[x], attrs, ty)
        }
        Collective::ReduceScatter { dim } => {
            let region = sum(b);
            let attrs = vec![
                ("channel_handle", CHANNEL),
                ("replica_groups", groups),
                ("scatter_dimension", int(*dim)),
                ("use_global_device_ids", Attr::Unit),
            ];
            b.op_region("stablehlo.reduce_scatter", &[x], region, attrs, ty)
        }
        Collective::AllToAll { split, concat } => {
            let attrs = vec![
                ("channel_handle", CHANNEL),
                ("concat_dimension", int(*concat)),
                ("replica_groups", groups),
                ("split_count", int(n)),
                ("split_dimension", int(*split)),
            ];
            b.op("stablehlo.all_to_all", &[x], attrs, ty)
        }
        Collective::Permute { pairs } => {
            let mut rows = vec![];
            for g in &c.groups {
                rows.extend(pairs.iter().map(|&(s, t)| vec![g[s], g[t]]));
            }
            let attrs = vec![("channel_handle", CHANNEL), ("source_target_pairs", int_matrix(&rows, 2))];
            b.op("stablehlo.collective_permute", &[x], attrs, ty)
        }
    }
}

/// One local region in a program over a mesh: an `sdy.manual_computation`
/// over every axis of the mesh. `operands` are the program's values (global
/// types) entering with `in_shardings`; `body` is a builder whose flat
/// arguments are, in order, each operand's block, and which computed
/// `body_outs` (each device's result blocks); the results leave with
/// `out_shardings` as values of `out_tys` (global types).
pub fn manual_computation(
    b: &mut Builder,
    operands: &[&Val],
    in_shardings: &[Sharding],
    mut body: Builder,
    body_outs: &[Val],
    out_shardings: &[Sharding],
    out_tys: &[Ty],
) -> Result<Vec<Val>> {
    let Some(mesh) = in_shardings.first().or(out_shardings.first()).map(|s| s.mesh.clone()) else {
        return Err(Error::invalid("local_map", "a local region needs at least one input or output"));
    };
    let flat_args = body.args();
    if flat_args.len() != operands.len() || in_shardings.len() != operands.len() {
        return Err(Error::backend("pjrt", "a local region's arguments do not match its operands"));
    }
    b.take_funcs(&mut body);
    // The block's arguments (one device's blocks), reshaped to the body's flat
    // arguments; the body's names move to the local namespace, so they cannot
    // meet the program's.
    let mut region = Region::default();
    for (j, (v, s)) in operands.iter().zip(in_shardings).enumerate() {
        let local = Ty::new(&s.shard_shape(v.shape()), v.dtype());
        let flat = &flat_args[j];
        if flat.ty.numel() != local.numel() {
            return Err(Error::backend("pjrt", "a local region's block does not fit its argument"));
        }
        let block = Val { name: Name::new(NameKind::LocalBlock, j), ty: local };
        region.ops.push(Operation {
            result: Some(flat.name.local()),
            name: "stablehlo.reshape".into(),
            operands: vec![block.clone()],
            regions: vec![],
            attrs: vec![],
            results: vec![flat.ty.clone()],
        });
        region.args.push(block);
    }
    let inner = Region { args: vec![], ops: body.take_ops() }.local();
    region.ops.extend(inner.ops);
    let outs: Vec<Val> = body_outs.iter().map(|v| Val { name: v.name.local(), ty: v.ty.clone() }).collect();
    region.ops.push(terminator("sdy.return", &outs));
    let attrs = vec![
        ("in_shardings", Attr::ShardingPerValue(in_shardings.to_vec())),
        ("manual_axes", Attr::ManualAxes(mesh.root_axis_names().iter().map(|a| a.to_string()).collect())),
        ("out_shardings", Attr::ShardingPerValue(out_shardings.to_vec())),
    ];
    Ok(b.op_n("sdy.manual_computation", operands, vec![region], attrs, out_tys))
}
