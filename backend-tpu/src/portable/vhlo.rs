//! StableHLO to VHLO, StableHLO's versioned dialect (Note [Portable
//! artifacts]): every op of a module tree becomes its `_v1` form as
//! StableHLO 1.0.0 defines it, with the attributes VHLO spells out (defaults
//! included, as `stablehlo-legalize-to-vhlo` adds them), each typed
//! attribute written in VHLO's syntax.
//!
//! The result is what the bytecode writer takes: names, attributes and types
//! as VHLO's text.
use crate::stablehlo::{Attr, Attrs, Func, Module, Operation, Port, Region, Ty, Val};
use kiln_tensor::DType;

/// An op in VHLO form: its result names, name, operand names, regions,
/// attributes and result types as they are written in the bytecode.
#[derive(Debug)]
pub(crate) struct Op {
    pub results: Vec<String>,
    pub name: String,
    pub operands: Vec<String>,
    pub regions: Vec<VRegion>,
    pub attrs: TextAttrs,
    pub result_types: Vec<String>,
}

/// A region of one block in VHLO form.
#[derive(Debug)]
pub(crate) struct VRegion {
    pub args: Vec<(String, String)>,
    pub ops: Vec<Op>,
}

/// The StableHLO ops whose `_v1` form StableHLO 1.0.0 reads and whose
/// attributes this conversion knows.
const V1_OPS: &[&str] = &[
    "abs",
    "add",
    "and",
    "atan2",
    "bitcast_convert",
    "broadcast_in_dim",
    "broadcast",
    "case",
    "cbrt",
    "ceil",
    "clamp",
    "count_leading_zeros",
    "compare",
    "complex",
    "concatenate",
    "constant",
    "convert",
    "cosine",
    "custom_call",
    "divide",
    "dot_general",
    "dot",
    "dynamic_slice",
    "dynamic_update_slice",
    "exponential_minus_one",
    "exponential",
    "floor",
    "gather",
    "get_tuple_element",
    "if",
    "imag",
    "iota",
    "is_finite",
    "log_plus_one",
    "logistic",
    "log",
    "map",
    "maximum",
    "minimum",
    "multiply",
    "negate",
    "not",
    "optimization_barrier",
    "or",
    "pad",
    "popcnt",
    "power",
    "real",
    "reduce",
    "reduce_precision",
    "reduce_window",
    "remainder",
    "reshape",
    "return",
    "reverse",
    "rng_bit_generator",
    "rng",
    "round_nearest_even",
    "round_nearest_afz",
    "rsqrt",
    "scatter",
    "select",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "sign",
    "sine",
    "slice",
    "sort",
    "sqrt",
    "subtract",
    "tanh",
    "transpose",
    "tuple",
    "while",
    "xor",
];

/// `name = value` attributes as written in the bytecode.
pub(crate) type TextAttrs = Vec<(String, String)>;

/// The module's own attributes (builtin syntax) and its functions in VHLO form.
pub(crate) fn module(m: &Module) -> Result<(TextAttrs, Vec<Op>), String> {
    if m.mesh.is_some() || m.partitions != 1 {
        return Err("a program over a mesh (Shardy shardings) has no VHLO 1.0.0 form".into());
    }
    let attrs = vec![
        ("sym_name".to_string(), "\"kiln\"".to_string()),
        ("mhlo.num_partitions".to_string(), "1 : i32".to_string()),
        ("mhlo.num_replicas".to_string(), "1 : i32".to_string()),
    ];
    Ok((attrs, m.funcs.iter().map(func).collect::<Result<_, _>>()?))
}

fn func(f: &Func) -> Result<Op, String> {
    let (name, public, ports, results, body) = match f {
        Func::Built { name, public, args, results, body } => (name, public, args, results, body),
        Func::Custom { name, .. } => {
            return Err(format!(
            "the custom op function @{name} is MLIR text the op wrote, which kiln does not convert (no portable form)"
        ))
        }
    };
    let body = region(body)?;
    let args: Vec<&str> = body.args.iter().map(|(_, t)| t.as_str()).collect();
    let result_tys: Vec<String> = results.iter().map(|p| ty(&p.ty)).collect();
    let fty = format!("#vhlo.type_v1<!vhlo.func_v1<({}) -> {}>>", args.join(", "), result_tys.join(", "));
    let arg_attrs = port_attrs(ports)?;
    let res_attrs = port_attrs(results)?;
    let attrs = vec![
        ("arg_attrs".into(), arg_attrs),
        ("function_type".into(), fty),
        ("res_attrs".into(), res_attrs),
        ("sym_name".into(), format!("#vhlo.string_v1<\"{name}\">")),
        ("sym_visibility".into(), format!("#vhlo.string_v1<\"{}\">", if *public { "public" } else { "private" })),
    ];
    Ok(Op {
        name: "vhlo.func_v1".into(),
        results: vec![],
        result_types: vec![],
        operands: vec![],
        attrs,
        regions: vec![body],
    })
}

/// The attribute dictionaries of a function's arguments or results, as the
/// array VHLO holds them (empty when none has any).
fn port_attrs(ports: &[Port]) -> Result<String, String> {
    if ports.iter().all(|p| p.attrs.is_empty()) {
        return Ok("#vhlo.array_v1<[]>".to_string());
    }
    let dicts: Vec<String> = ports
        .iter()
        .map(|p| {
            let items: Vec<String> = p
                .attrs
                .iter()
                .map(|(k, v)| Ok(format!("#vhlo.string_v1<\"{k}\"> = {}", value(v).map_err(|e| format!("{k}: {e}"))?)))
                .collect::<Result<_, String>>()?;
            Ok(format!("#vhlo.dict_v1<{{{}}}>", items.join(", ")))
        })
        .collect::<Result<_, String>>()?;
    Ok(format!("#vhlo.array_v1<[{}]>", dicts.join(", ")))
}

fn region(r: &Region) -> Result<VRegion, String> {
    Ok(VRegion {
        args: r.args.iter().map(|a: &Val| (a.name.to_string(), ty(&a.ty))).collect(),
        ops: r.ops.iter().map(op).collect::<Result<_, _>>()?,
    })
}

fn op(o: &Operation) -> Result<Op, String> {
    let name = match o.name.as_str() {
        "func.return" | "stablehlo.return" => "vhlo.return_v1".to_string(),
        "func.call" => "vhlo.call_v1".to_string(),
        n => match n.strip_prefix("stablehlo.") {
            Some(s) if V1_OPS.contains(&s) => format!("vhlo.{s}_v1"),
            _ => return Err(format!("`{n}` has no portable (VHLO) form kiln writes")),
        },
    };
    let short = o.name.rsplit('.').next().unwrap_or_default();
    let mut attrs = Vec::new();
    for (k, v) in &o.attrs {
        attrs.extend(attribute(short, k, v).map_err(|e| format!("{}: attribute {k} = {v}: {e}", o.name))?);
    }
    defaults(short, &o.attrs, &mut attrs)?;
    attrs.sort();
    Ok(Op {
        name,
        results: o.values().iter().map(|v| v.name.to_string()).collect(),
        result_types: o.results.iter().map(ty).collect(),
        operands: o.operands.iter().map(|v| v.name.to_string()).collect(),
        attrs,
        regions: o.regions.iter().map(region).collect::<Result<_, _>>()?,
    })
}

/// Adds the attributes VHLO requires that the op leaves at their defaults.
fn defaults(op: &str, given: &Attrs, attrs: &mut Vec<(String, String)>) -> Result<(), String> {
    let mut add = |k: &str, v: String| {
        if !attrs.iter().any(|(n, _)| n == k) {
            attrs.push((k.into(), v));
        }
    };
    let f = || "#vhlo.bool_v1<false>".to_string();
    let empty = || "#vhlo.array_v1<[]>".to_string();
    match op {
        "compare" => add("compare_type", "#vhlo<comparison_type_v1 NOTYPE>".into()),
        "dot_general" | "dot" => {
            add("precision_config", "#vhlo.array_v1<[#vhlo<precision_v1 DEFAULT>, #vhlo<precision_v1 DEFAULT>]>".into())
        }
        "gather" => add("indices_are_sorted", f()),
        "scatter" => {
            add("indices_are_sorted", f());
            add("unique_indices", f());
        }
        "sort" => {
            add("dimension", "#vhlo.integer_v1<-1 : i64>".into());
            add("is_stable", f());
        }
        "custom_call" => {
            add("has_side_effect", f());
            add("backend_config", "#vhlo.string_v1<\"\">".into());
            add("api_version", "#vhlo<api_version_v1 API_VERSION_ORIGINAL>".into());
            add("called_computations", empty());
            add("operand_layouts", empty());
            add("result_layouts", empty());
            add("output_operand_aliases", empty());
        }
        "reduce_window" => {
            let n = match given.iter().find(|(k, _)| *k == "window_dimensions") {
                Some((_, Attr::I64s(w))) => w.len(),
                _ => return Err("stablehlo.reduce_window without window_dimensions".into()),
            };
            add("window_strides", i64_tensor(&vec![1; n]));
            add("base_dilations", i64_tensor(&vec![1; n]));
            add("window_dilations", i64_tensor(&vec![1; n]));
            add("padding", format!("#vhlo.tensor_v1<dense<0> : tensor<{n}x2xi64>>"));
        }
        _ => {}
    }
    Ok(())
}

/// One StableHLO attribute as the VHLO attributes it becomes: the dimension
/// numbers of dots, gathers and scatters become one attribute per field.
fn attribute(op: &str, k: &str, v: &Attr) -> Result<Vec<(String, String)>, String> {
    let list = |name: &str, l: &[i64]| (name.to_string(), i64_tensor(l));
    let int = |name: &str, n: i64| (name.to_string(), format!("#vhlo.integer_v1<{n} : i64>"));
    Ok(match v {
        Attr::Dot { lhs_batch, rhs_batch, lhs_contract, rhs_contract } => vec![
            list("lhs_batching_dimensions", lhs_batch),
            list("rhs_batching_dimensions", rhs_batch),
            list("lhs_contracting_dimensions", lhs_contract),
            list("rhs_contracting_dimensions", rhs_contract),
        ],
        Attr::Gather { operand_batching_dims, .. } if !operand_batching_dims.is_empty() => {
            return Err("a gather with batching dimensions has no VHLO 1.0.0 form".into())
        }
        Attr::Gather { offset_dims, collapsed_slice_dims, start_index_map, index_vector_dim, .. } => vec![
            list("offset_dims", offset_dims),
            list("collapsed_slice_dims", collapsed_slice_dims),
            list("start_index_map", start_index_map),
            int("index_vector_dim", *index_vector_dim),
        ],
        Attr::Scatter { update_window_dims, inserted_window_dims, scatter_dims_to_operand_dims, index_vector_dim } => {
            vec![
                list("update_window_dims", update_window_dims),
                list("inserted_window_dims", inserted_window_dims),
                list("scatter_dims_to_operand_dims", scatter_dims_to_operand_dims),
                int("index_vector_dim", *index_vector_dim),
            ]
        }
        Attr::Int(n, _) if op == "custom_call" && k == "api_version" => {
            let name = match n {
                0 => "API_VERSION_UNSPECIFIED",
                1 => "API_VERSION_ORIGINAL",
                2 => "API_VERSION_STATUS_RETURNING",
                3 => "API_VERSION_STATUS_RETURNING_UNIFIED",
                _ => return Err("the custom call API version has no VHLO 1.0.0 form".into()),
            };
            vec![(k.to_string(), format!("#vhlo<api_version_v1 {name}>"))]
        }
        v => vec![(k.to_string(), value(v)?)],
    })
}

/// An attribute that is one VHLO attribute.
fn value(v: &Attr) -> Result<String, String> {
    Ok(match v {
        Attr::Bool(b) => format!("#vhlo.bool_v1<{b}>"),
        Attr::Int(n, t) => format!("#vhlo.integer_v1<{n} : {t}>"),
        Attr::Str(s) | Attr::Symbol(s) => format!("#vhlo.string_v1<\"{s}\">"),
        Attr::I64s(l) => i64_tensor(l),
        Attr::Scalar { .. } | Attr::IntRows { .. } => format!("#vhlo.tensor_v1<{v}>"),
        Attr::Enum { kind, value } => format!("#vhlo<{kind}_v1 {value}>"),
        Attr::Array(items) => {
            format!("#vhlo.array_v1<[{}]>", items.iter().map(value).collect::<Result<Vec<_>, _>>()?.join(", "))
        }
        Attr::Dot { .. } | Attr::Gather { .. } | Attr::Scatter { .. } => {
            return Err("dimension numbers belong to their op".into())
        }
        Attr::Channel { .. } | Attr::Unit => return Err("collectives have no VHLO form kiln writes".into()),
        Attr::Sharding(_) | Attr::ShardingPerValue(_) | Attr::ManualAxes(_) => {
            return Err("Shardy shardings have no VHLO 1.0.0 form".into())
        }
        Attr::Text(_) => return Err("MLIR text a custom op wrote has no portable form kiln writes".into()),
    })
}

/// `#vhlo.tensor_v1<dense<[..]> : tensor<Nxi64>>`, as VHLO 1.0.0 holds dimension lists.
fn i64_tensor(l: &[i64]) -> String {
    if l.is_empty() {
        return "#vhlo.tensor_v1<dense<> : tensor<0xi64>>".into();
    }
    let items: Vec<String> = l.iter().map(|x| x.to_string()).collect();
    format!("#vhlo.tensor_v1<dense<[{}]> : tensor<{}xi64>>", items.join(", "), l.len())
}

/// A tensor type as its VHLO type: `tensor<2x3xf32>` is
/// `!vhlo.tensor_v1<2x3x!vhlo.f32_v1>`.
pub(crate) fn ty(t: &Ty) -> String {
    // VHLO names element types as MLIR does, but for bool (`i1` in MLIR).
    let e = match t.dtype {
        DType::Bool => "bool",
        d => d.mlir_name(),
    };
    let dims: String = t.shape.iter().map(|d| format!("{d}x")).collect();
    format!("!vhlo.tensor_v1<{dims}!vhlo.{e}_v1>")
}
