//! Collectives (`Op::Collective`) as StableHLO's cross-device ops, and the
//! Shardy `manual_computation` that holds them: the body of a local region
//! (see Note [Local regions] in kiln-tensor's `collective.rs`).
use super::{Builder, Sharding, Ty, Val};
use kiln_tensor::collective::{Collective, CollectiveOp};
use kiln_tensor::{Error, Meta, Result};
use std::fmt::Write;

/// Every collective of a program is cross-partition (`type = 1`); the groups
/// name partition ids, which are mesh positions (`use_global_device_ids`).
const CHANNEL: &str = "channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>";

/// `dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>`.
fn int_matrix(rows: &[Vec<usize>], width: usize) -> String {
    if rows.is_empty() {
        return format!("dense<> : tensor<0x{width}xi64>");
    }
    let items: Vec<String> =
        rows.iter().map(|r| format!("[{}]", r.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))).collect();
    format!("dense<[{}]> : tensor<{}x{width}xi64>", items.join(", "), rows.len())
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
    match &c.kind {
        Collective::AllReduce => {
            let region = sum(b);
            let attrs = format!("{CHANNEL}, replica_groups = {groups}, use_global_device_ids");
            b.op_region("stablehlo.all_reduce", &[x], &region, &attrs, ty)
        }
        Collective::AllGather { dim } => {
            let attrs =
                format!("all_gather_dim = {dim} : i64, {CHANNEL}, replica_groups = {groups}, use_global_device_ids");
            b.op("stablehlo.all_gather", &[x], &attrs, ty)
        }
        Collective::ReduceScatter { dim } => {
            let region = sum(b);
            let attrs =
                format!("{CHANNEL}, replica_groups = {groups}, scatter_dimension = {dim} : i64, use_global_device_ids");
            b.op_region("stablehlo.reduce_scatter", &[x], &region, &attrs, ty)
        }
        Collective::AllToAll { split, concat } => {
            let attrs = format!(
                "{CHANNEL}, concat_dimension = {concat} : i64, replica_groups = {groups}, split_count = {n} : i64, split_dimension = {split} : i64"
            );
            b.op("stablehlo.all_to_all", &[x], &attrs, ty)
        }
        Collective::Permute { pairs } => {
            let mut rows = vec![];
            for g in &c.groups {
                rows.extend(pairs.iter().map(|&(s, t)| vec![g[s], g[t]]));
            }
            let attrs = format!("{CHANNEL}, source_target_pairs = {}", int_matrix(&rows, 2));
            b.op("stablehlo.collective_permute", &[x], &attrs, ty)
        }
    }
}

/// `#sdy.sharding<@mesh, [...]>` as an element of `#sdy.sharding_per_value<[...]>`.
fn per_value(s: &[Sharding]) -> String {
    let items: Vec<String> = s.iter().map(|s| s.attr().trim_start_matches("#sdy.sharding").to_string()).collect();
    format!("#sdy.sharding_per_value<[{}]>", items.join(", "))
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
    if body.args.len() != operands.len() || in_shardings.len() != operands.len() {
        return Err(Error::backend("pjrt", "a local region's arguments do not match its operands"));
    }
    b.take_funcs(&mut body);
    // The body's names get their own prefix, so they cannot meet the program's.
    let rename = |s: &str| s.replace("%v", "%lv").replace("%a", "%la");
    let mut region = String::new();
    let header: Vec<String> = operands
        .iter()
        .zip(in_shardings)
        .enumerate()
        .map(|(j, (v, s))| format!("%lb{j}: {}", Ty::new(&s.shard_shape(v.shape()), v.dtype()).mlir()))
        .collect();
    let _ = writeln!(region, "{{\n  ^bb0({}):", header.join(", "));
    for (j, (v, s)) in operands.iter().zip(in_shardings).enumerate() {
        let local = Ty::new(&s.shard_shape(v.shape()), v.dtype());
        let flat = &body.args[j];
        if flat.numel() != local.numel() {
            return Err(Error::backend("pjrt", "a local region's block does not fit its argument"));
        }
        let _ = writeln!(region, "    %la{j} = \"stablehlo.reshape\"(%lb{j}) : ({}) -> {}", local.mlir(), flat.mlir());
    }
    region.push_str(&rename(&body.body));
    let names: Vec<String> = body_outs.iter().map(|v| rename(&v.name)).collect();
    let tys: Vec<String> = body_outs.iter().map(|v| v.ty.mlir()).collect();
    let _ = write!(region, "    \"sdy.return\"({}) : ({}) -> ()\n  }}", names.join(", "), tys.join(", "));
    let axes: Vec<String> = mesh.root_axis_names().iter().map(|a| format!("\"{a}\"")).collect();
    let attrs = format!(
        "in_shardings = {}, manual_axes = #sdy<manual_axes{{{}}}>, out_shardings = {}",
        per_value(in_shardings),
        axes.join(", "),
        per_value(out_shardings)
    );
    let outs = b.op_n("sdy.manual_computation", operands, &region, &attrs, out_tys);
    Ok(outs)
}
