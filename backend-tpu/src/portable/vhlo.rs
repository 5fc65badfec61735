//! StableHLO to VHLO, StableHLO's versioned dialect (Note [Portable
//! artifacts]): every op becomes its `_v1` form as StableHLO 1.0.0 defines
//! it, with the attributes VHLO spells out (defaults included, as
//! `stablehlo-legalize-to-vhlo` adds them) in VHLO's attribute syntax.
//!
//! The result keeps the parsed form (`Op`, `Region`): names, attributes and
//! types are VHLO's.
use super::parse::{Func, Module, Op, Region};

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

/// Converts a parsed module's functions; its own attributes stay as written.
pub(crate) fn module(m: &Module) -> Result<Vec<Op>, String> {
    m.funcs.iter().map(func).collect()
}

fn func(f: &Func) -> Result<Op, String> {
    let body = region(&f.args, &f.body)?;
    let args: Vec<&str> = body.args.iter().map(|(_, t)| t.as_str()).collect();
    let results: Vec<String> = f.results.iter().map(|t| ty(t)).collect::<Result<_, _>>()?;
    let fty = format!("#vhlo.type_v1<!vhlo.func_v1<({}) -> {}>>", args.join(", "), results.join(", "));
    let arg_attrs = if f.arg_attrs.iter().all(Vec::is_empty) {
        "#vhlo.array_v1<[]>".to_string()
    } else {
        let dicts: Vec<String> = f
            .arg_attrs
            .iter()
            .map(|d| {
                let items: Vec<String> = d
                    .iter()
                    .map(|(k, v)| Ok(format!("#vhlo.string_v1<\"{k}\"> = {}", value(v)?)))
                    .collect::<Result<_, String>>()?;
                Ok(format!("#vhlo.dict_v1<{{{}}}>", items.join(", ")))
            })
            .collect::<Result<_, String>>()?;
        format!("#vhlo.array_v1<[{}]>", dicts.join(", "))
    };
    let attrs = vec![
        ("arg_attrs".into(), arg_attrs),
        ("function_type".into(), fty),
        ("res_attrs".into(), "#vhlo.array_v1<[]>".into()),
        ("sym_name".into(), format!("#vhlo.string_v1<\"{}\">", f.name)),
        ("sym_visibility".into(), format!("#vhlo.string_v1<\"{}\">", if f.public { "public" } else { "private" })),
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

/// The region of arguments `args` and operations `ops`, converted.
fn region(args: &[(String, String)], ops: &[Op]) -> Result<Region, String> {
    Ok(Region {
        args: args.iter().map(|(n, t)| Ok((n.clone(), ty(t)?))).collect::<Result<_, String>>()?,
        ops: ops.iter().map(op).collect::<Result<_, _>>()?,
    })
}

fn op(o: &Op) -> Result<Op, String> {
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
    defaults(short, o, &mut attrs)?;
    attrs.sort();
    Ok(Op {
        name,
        results: o.results.clone(),
        result_types: o.result_types.iter().map(|t| ty(t)).collect::<Result<_, _>>()?,
        operands: o.operands.clone(),
        attrs,
        regions: o.regions.iter().map(|r| region(&r.args, &r.ops)).collect::<Result<_, _>>()?,
    })
}

/// Adds the attributes VHLO requires that the op leaves at their defaults.
fn defaults(op: &str, o: &Op, attrs: &mut Vec<(String, String)>) -> Result<(), String> {
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
            let n = o
                .attrs
                .iter()
                .find(|(k, _)| k == "window_dimensions")
                .map(|(_, v)| i64_list(v).map(|l| l.len()))
                .ok_or("stablehlo.reduce_window without window_dimensions")??;
            add("window_strides", i64_tensor(&vec![1; n]));
            add("base_dilations", i64_tensor(&vec![1; n]));
            add("window_dilations", i64_tensor(&vec![1; n]));
            add("padding", format!("#vhlo.tensor_v1<dense<0> : tensor<{n}x2xi64>>"));
        }
        _ => {}
    }
    Ok(())
}

/// One StableHLO attribute as the VHLO attributes it becomes.
fn attribute(op: &str, k: &str, v: &str) -> Result<Vec<(String, String)>, String> {
    let one = |x: String| Ok(vec![(k.to_string(), x)]);
    match (op, k) {
        ("dot_general", "dot_dimension_numbers") => struct_attr(
            v,
            "#stablehlo.dot<",
            &[
                "lhs_batching_dimensions",
                "rhs_batching_dimensions",
                "lhs_contracting_dimensions",
                "rhs_contracting_dimensions",
            ],
            &[],
            &[],
        ),
        ("gather", "dimension_numbers") => struct_attr(
            v,
            "#stablehlo.gather<",
            &["offset_dims", "collapsed_slice_dims", "start_index_map"],
            &["index_vector_dim"],
            &["operand_batching_dims", "start_indices_batching_dims"],
        ),
        ("scatter", "scatter_dimension_numbers") => struct_attr(
            v,
            "#stablehlo.scatter<",
            &["update_window_dims", "inserted_window_dims", "scatter_dims_to_operand_dims"],
            &["index_vector_dim"],
            &["input_batching_dims", "scatter_indices_batching_dims"],
        ),
        ("custom_call", "api_version") => {
            let n = v.split(':').next().unwrap_or_default().trim();
            let name = match n {
                "0" => "API_VERSION_UNSPECIFIED",
                "1" => "API_VERSION_ORIGINAL",
                "2" => "API_VERSION_STATUS_RETURNING",
                "3" => "API_VERSION_STATUS_RETURNING_UNIFIED",
                _ => return Err("the custom call API version has no VHLO 1.0.0 form".into()),
            };
            one(format!("#vhlo<api_version_v1 {name}>"))
        }
        (_, "callee") => match v.strip_prefix('@') {
            Some(s) => one(format!("#vhlo.string_v1<\"{s}\">")),
            None => Err("expected a symbol".into()),
        },
        _ => one(value(v)?),
    }
}

/// The general rules, by the attribute's syntax.
fn value(v: &str) -> Result<String, String> {
    let v = v.trim();
    if v.starts_with("dense<") {
        return Ok(format!("#vhlo.tensor_v1<{v}>"));
    }
    if v.starts_with("array<i64") {
        return Ok(i64_tensor(&i64_list(v)?));
    }
    if v == "true" || v == "false" {
        return Ok(format!("#vhlo.bool_v1<{v}>"));
    }
    if v.starts_with('"') {
        return Ok(format!("#vhlo.string_v1<{v}>"));
    }
    if let Some(e) = v.strip_prefix("#stablehlo<").and_then(|e| e.strip_suffix('>')) {
        let (kind, val) = e.split_once(' ').ok_or("expected `kind VALUE`")?;
        return Ok(format!("#vhlo<{kind}_v1 {val}>"));
    }
    if let Some(items) = v.strip_prefix('[').and_then(|e| e.strip_suffix(']')) {
        let items: Vec<String> =
            split_top(items).iter().filter(|s| !s.is_empty()).map(|s| value(s)).collect::<Result<_, _>>()?;
        return Ok(format!("#vhlo.array_v1<[{}]>", items.join(", ")));
    }
    if let Some((n, t)) = v.split_once(" : ") {
        let t = t.trim();
        if n.trim().parse::<i64>().is_ok() && t.starts_with('i') && t[1..].parse::<u32>().is_ok() {
            return Ok(format!("#vhlo.integer_v1<{} : {t}>", n.trim()));
        }
    }
    Err("no VHLO form kiln writes for this attribute".into())
}

/// `#vhlo.tensor_v1<dense<[..]> : tensor<Nxi64>>`, as VHLO 1.0.0 holds dimension lists.
fn i64_tensor(l: &[i64]) -> String {
    if l.is_empty() {
        return "#vhlo.tensor_v1<dense<> : tensor<0xi64>>".into();
    }
    let items: Vec<String> = l.iter().map(|x| x.to_string()).collect();
    format!("#vhlo.tensor_v1<dense<[{}]> : tensor<{}xi64>>", items.join(", "), l.len())
}

/// The integers of `array<i64: a, b>` or `[a, b]`.
fn i64_list(v: &str) -> Result<Vec<i64>, String> {
    let body = if let Some(r) = v.strip_prefix("array<i64") {
        r.strip_suffix('>').ok_or("unterminated array")?.trim_start_matches(':')
    } else {
        v.strip_prefix('[').and_then(|r| r.strip_suffix(']')).ok_or("expected a list of integers")?
    };
    body.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<i64>().map_err(|_| format!("{s:?} is not an integer")))
        .collect()
}

/// The `name = value` fields of a struct attribute `prefix...>`.
fn fields(v: &str, prefix: &str) -> Result<Vec<(String, String)>, String> {
    let body = v.strip_prefix(prefix).and_then(|r| r.strip_suffix('>')).ok_or(format!("expected {prefix}...>"))?;
    split_top(body)
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (k, v) = s.split_once('=').ok_or(format!("expected `name = value`, got {s:?}"))?;
            Ok((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

fn field_list(f: &[(String, String)], name: &str) -> Result<Vec<i64>, String> {
    f.iter().find(|(k, _)| k == name).map_or(Ok(vec![]), |(_, v)| i64_list(v))
}

fn field_int(f: &[(String, String)], name: &str) -> Result<String, String> {
    let v = f.iter().find(|(k, _)| k == name).map_or("0", |(_, v)| v.as_str());
    let n: i64 = v.parse().map_err(|_| format!("{name} = {v} is not an integer"))?;
    Ok(format!("#vhlo.integer_v1<{n} : i64>"))
}

/// The fields of struct attribute `v` (`prefix...>`) as VHLO attributes of
/// their own: `lists` as i64 tensors, `ints` as integers. The `batching`
/// lists have no VHLO 1.0.0 form and must be empty; any other field is an
/// error (never dropped).
fn struct_attr(
    v: &str,
    prefix: &str,
    lists: &[&str],
    ints: &[&str],
    batching: &[&str],
) -> Result<Vec<(String, String)>, String> {
    let f = fields(v, prefix)?;
    let known = |k: &str| lists.contains(&k) || ints.contains(&k) || batching.contains(&k);
    if let Some((k, _)) = f.iter().find(|(k, _)| !known(k)) {
        return Err(format!("field {k} has no VHLO 1.0.0 form kiln writes"));
    }
    for n in batching {
        if !field_list(&f, n)?.is_empty() {
            return Err(format!("{n} (batching dimensions) has no VHLO 1.0.0 form"));
        }
    }
    let mut out: Vec<(String, String)> =
        lists.iter().map(|n| Ok((n.to_string(), i64_tensor(&field_list(&f, n)?)))).collect::<Result<_, String>>()?;
    for n in ints {
        out.push((n.to_string(), field_int(&f, n)?));
    }
    Ok(out)
}

/// Splits at top-level commas (outside brackets and strings).
fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth, mut quoted) = (Vec::new(), String::new(), 0i32, false);
    let mut prev = ' ';
    for c in s.chars() {
        match c {
            '"' if prev != '\\' => quoted = !quoted,
            '<' | '[' | '(' | '{' if !quoted => depth += 1,
            '>' if !quoted && prev == '-' => {}
            '>' | ']' | ')' | '}' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                prev = c;
                continue;
            }
            _ => {}
        }
        cur.push(c);
        prev = c;
    }
    out.push(cur.trim().to_string());
    out
}

/// A builtin type as its VHLO type: `tensor<2x3xf32>` is
/// `!vhlo.tensor_v1<2x3x!vhlo.f32_v1>`.
pub(crate) fn ty(t: &str) -> Result<String, String> {
    let t = t.trim();
    if t == "!stablehlo.token" {
        return Ok("!vhlo.token_v1".into());
    }
    let body =
        t.strip_prefix("tensor<").and_then(|r| r.strip_suffix('>')).ok_or(format!("type {t} has no VHLO form"))?;
    let mut parts: Vec<&str> = body.split('x').collect();
    let e = parts.pop().unwrap_or_default();
    for d in &parts {
        if d.parse::<u64>().is_err() {
            return Err(format!("type {t}: only static shapes have a portable form"));
        }
    }
    let e = match e {
        "i1" => "bool".to_string(),
        "f16" | "bf16" | "f32" | "f64" | "f8E4M3FN" | "f8E5M2" | "i8" | "i16" | "i32" | "i64" | "ui8" | "ui16"
        | "ui32" | "ui64" | "i4" | "ui4" => e.to_string(),
        _ => return Err(format!("element type {e} has no VHLO 1.0.0 form")),
    };
    let dims: String = parts.iter().map(|d| format!("{d}x")).collect();
    Ok(format!("!vhlo.tensor_v1<{dims}!vhlo.{e}_v1>"))
}
