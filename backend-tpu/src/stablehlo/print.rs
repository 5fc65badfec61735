//! The text of a module: MLIR's generic op form, the one form the plugin is
//! given (Note [StableHLO modules]). Every operation prints on its own line
//! indented by four spaces, nested regions inline in their operation.
use super::{Attr, Attrs, Func, Module, Name, NameKind, Operation, Port, Region, Val};
use std::fmt::{self, Display, Formatter, Write};

impl Display for Name {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let prefix = match self.kind {
            NameKind::Value => "v",
            NameKind::Arg => "a",
            NameKind::LocalValue => "lv",
            NameKind::LocalArg => "la",
            NameKind::LocalBlock => "lb",
            NameKind::Unreduced => "u",
        };
        write!(f, "%{prefix}{}", self.n)?;
        if let Some(p) = self.part {
            write!(f, "#{p}")?;
        }
        Ok(())
    }
}

/// `[1, 2]`.
fn list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(", "))
}

fn join<T>(items: &[T], f: impl Fn(&T) -> String) -> String {
    items.iter().map(f).collect::<Vec<_>>().join(", ")
}

impl Display for Attr {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Bool(b) => write!(f, "{b}"),
            Attr::Int(n, ty) => write!(f, "{n} : {ty}"),
            Attr::Str(s) => write!(f, "\"{s}\""),
            Attr::I64s(v) if v.is_empty() => f.write_str("array<i64>"),
            Attr::I64s(v) => write!(f, "array<i64: {}>", join(v, |x| x.to_string())),
            Attr::Scalar { literal, ty } => write!(f, "dense<{literal}> : {}", ty.mlir()),
            Attr::IntRows { rows, width } if rows.is_empty() => write!(f, "dense<> : tensor<0x{width}xi64>"),
            Attr::IntRows { rows, width } => {
                write!(f, "dense<[{}]> : tensor<{}x{width}xi64>", join(rows, |r| list(r)), rows.len())
            }
            Attr::Enum { kind, value } => write!(f, "#stablehlo<{kind} {value}>"),
            Attr::Array(items) => write!(f, "[{}]", join(items, |a| a.to_string())),
            Attr::Dot { lhs_batch, rhs_batch, lhs_contract, rhs_contract } => write!(
                f,
                "#stablehlo.dot<lhs_batching_dimensions = {}, rhs_batching_dimensions = {}, lhs_contracting_dimensions = {}, rhs_contracting_dimensions = {}>",
                list(lhs_batch),
                list(rhs_batch),
                list(lhs_contract),
                list(rhs_contract)
            ),
            Attr::Gather {
                offset_dims,
                collapsed_slice_dims,
                operand_batching_dims,
                start_indices_batching_dims,
                start_index_map,
                index_vector_dim,
            } => {
                f.write_str("#stablehlo.gather<")?;
                if !offset_dims.is_empty() {
                    write!(f, "offset_dims = {}, ", list(offset_dims))?;
                }
                write!(f, "collapsed_slice_dims = {}, ", list(collapsed_slice_dims))?;
                if !operand_batching_dims.is_empty() {
                    write!(
                        f,
                        "operand_batching_dims = {}, start_indices_batching_dims = {}, ",
                        list(operand_batching_dims),
                        list(start_indices_batching_dims)
                    )?;
                }
                write!(f, "start_index_map = {}, index_vector_dim = {index_vector_dim}>", list(start_index_map))
            }
            Attr::Scatter { update_window_dims, inserted_window_dims, scatter_dims_to_operand_dims, index_vector_dim } => {
                f.write_str("#stablehlo.scatter<")?;
                if !update_window_dims.is_empty() {
                    write!(f, "update_window_dims = {}, ", list(update_window_dims))?;
                }
                write!(
                    f,
                    "inserted_window_dims = {}, scatter_dims_to_operand_dims = {}, index_vector_dim = {index_vector_dim}>",
                    list(inserted_window_dims),
                    list(scatter_dims_to_operand_dims)
                )
            }
            Attr::Channel { handle, kind } => write!(f, "#stablehlo.channel_handle<handle = {handle}, type = {kind}>"),
            Attr::Unit => Ok(()),
            Attr::Symbol(s) => write!(f, "@{s}"),
            Attr::Sharding(s) => f.write_str(&s.attr()),
            Attr::ShardingPerValue(v) => {
                write!(f, "#sdy.sharding_per_value<[{}]>", join(v, |s| s.attr().replacen("#sdy.sharding", "", 1)))
            }
            Attr::ManualAxes(axes) => write!(f, "#sdy<manual_axes{{{}}}>", join(axes, |a| format!("\"{a}\""))),
            Attr::Text(t) => f.write_str(t),
        }
    }
}

/// `k = v, flag` (a unit attribute prints its name alone).
fn attrs(a: &Attrs) -> String {
    join(a, |(k, v)| match v {
        Attr::Unit => k.to_string(),
        v => format!("{k} = {v}"),
    })
}

fn operation(out: &mut String, o: &Operation) {
    out.push_str("    ");
    if let Some(r) = o.result {
        if o.results.len() == 1 {
            let _ = write!(out, "{r} = ");
        } else {
            let _ = write!(out, "{r}:{} = ", o.results.len());
        }
    }
    let _ = write!(out, "\"{}\"({})", o.name, join(&o.operands, |v| v.name.to_string()));
    if !o.regions.is_empty() {
        out.push_str(" (");
        for (i, r) in o.regions.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            region(out, r);
        }
        out.push(')');
    }
    if !o.attrs.is_empty() {
        let _ = write!(out, " {{{}}}", attrs(&o.attrs));
    }
    let outs = match o.results.len() {
        1 => o.results[0].mlir(),
        _ => format!("({})", join(&o.results, |t| t.mlir())),
    };
    let _ = writeln!(out, " : ({}) -> {outs}", join(&o.operands, |v| v.ty.mlir()));
}

fn region(out: &mut String, r: &Region) {
    let _ = writeln!(out, "{{\n  ^bb0({}):", join(&r.args, |a: &Val| format!("{}: {}", a.name, a.ty.mlir())));
    for o in &r.ops {
        operation(out, o);
    }
    out.push_str("  }");
}

/// `ty` or `ty {attrs}`.
fn port(p: &Port) -> String {
    if p.attrs.is_empty() {
        p.ty.mlir()
    } else {
        format!("{} {{{}}}", p.ty.mlir(), attrs(&p.attrs))
    }
}

fn func(out: &mut String, f: &Func) {
    match f {
        Func::Built { name, public, args, results, body } => {
            let params =
                join(&body.args.iter().zip(args).collect::<Vec<_>>(), |(v, p)| format!("{}: {}", v.name, port(p)));
            let visibility = if *public { "public" } else { "private" };
            let _ = writeln!(out, "  func.func {visibility} @{name}({params}) -> ({}) {{", join(results, port));
            for o in &body.ops {
                operation(out, o);
            }
            out.push_str("  }\n");
        }
        Func::Custom { name, args, results, body } => {
            let params: Vec<String> = args.iter().enumerate().map(|(i, t)| format!("%arg{i}: {}", t.mlir())).collect();
            let _ = writeln!(
                out,
                "  func.func private @{name}({}) -> ({}) {{\n{}\n  }}",
                params.join(", "),
                join(results, |t| t.mlir()),
                body.trim_end()
            );
        }
    }
}

impl Display for Module {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let mut out = format!(
            "module @kiln attributes {{mhlo.num_partitions = {} : i32, mhlo.num_replicas = 1 : i32}} {{\n",
            self.partitions
        );
        if let Some(m) = &self.mesh {
            let _ = writeln!(out, "  {}", super::sharding::mesh_decl(m));
        }
        for fun in &self.funcs {
            func(&mut out, fun);
        }
        out.push_str("}\n");
        f.write_str(&out)
    }
}
