//! The text form of a program (`Display`), stable and documented in Note
//! \[Program text\]: golden tests and capture's messages compare it.
use super::program::{Param, ParamKind, Program, ResultKind};
use crate::collective::Collective;
use crate::op::{ArgReduceOp, ScatterReduce};
use crate::quant::{Activations, Codes, Global};
use crate::{DType, Meta, Op, Scalar, ViewOp};
use std::fmt::{self, Write};

// Note [Program text]
// ~~~~~~~~~~~~~~~~~~~
// A program prints as
//
//   program(%0: f32[16] state, %1: i64[2] generator, %2: f32[4, 4] input 0) {
//     %3 = view(%0) {shape=[4, 4]} : f32[4, 4]
//     %4 = add(%3, %2) : f32[4, 4]
//     %5, %6 = topk(%4) {k=2, dim=1, largest=true} : f32[4, 2], i64[4, 2]
//     %7 = copy_(%0, %4) {shape=[4, 4], strides=[4, 1], offset=0} : f32[16]
//     return %5 fresh, %7 updates %0
//   }
//
// (with more than four parameters, one parameter per line, each followed by
// a comma), one instruction per line: its outputs, the op's name (`Op::name`, PyTorch's
// names), its operands, its attributes in braces (none for ops without), and
// the outputs' types, `dtype[shape]` with the short dtype names below. Floats
// print as Rust's shortest round-trip form (`0.1`, `-0.0`, `inf`, `NaN`), so
// the text determines every attribute exactly. Results name their kind:
// `fresh`, `updates %p` (the new value of parameter `%p`, written into its
// storage), `state` (state the function created), `check "message"`. A
// custom op prints its name and, when it has a StableHLO lowering, a 64-bit
// FNV-1a tag of it (`{lowering=..}`): ops of one name that compute different
// things print differently. A local region (`local_map`) prints its
// placements and a tag of its body's text, then the body itself, a program
// of its own, on the lines below it, indented.

/// FNV-1a, 64 bits: a short, stable tag for a custom op's lowering in the text.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The short name of a dtype in program text.
pub fn dtype_short(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::U8 => "u8",
        DType::I8 => "i8",
        DType::I16 => "i16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::F8E5M2 => "f8e5m2",
        DType::F8E4M3FN => "f8e4m3fn",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::F64 => "f64",
    }
}

/// `f32[4, 8]`.
pub fn type_text(m: &Meta) -> String {
    format!("{}{}", dtype_short(m.dtype), list(&m.shape))
}

fn list(xs: &[usize]) -> String {
    let items: Vec<String> = xs.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(", "))
}

fn scalar(s: &Scalar) -> String {
    match s {
        Scalar::Bool(b) => b.to_string(),
        Scalar::Int(i) => i.to_string(),
        Scalar::Float(f) => format!("{f:?}"),
    }
}

/// An op's attributes, `k=v` pairs in a fixed order (empty for ops without).
pub fn attributes(op: &Op) -> Vec<(&'static str, String)> {
    let b = |x: bool| x.to_string();
    let f = |x: f64| format!("{x:?}");
    match op {
        Op::Full { shape, value, dtype } => {
            vec![("shape", list(shape)), ("value", scalar(value)), ("dtype", dtype_short(*dtype).into())]
        }
        Op::Arange { start, step, len, dtype } => vec![
            ("start", f(*start)),
            ("step", f(*step)),
            ("len", len.to_string()),
            ("dtype", dtype_short(*dtype).into()),
        ],
        Op::RandomBits { shape } => vec![("shape", list(shape))],
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Copy | Op::Rotary => vec![],
        Op::MatMul | Op::GroupedMatMul => vec![],
        Op::Cast(d) => vec![("dtype", dtype_short(*d).into())],
        Op::Reduce { dims, keepdim, .. } => vec![("dims", list(dims)), ("keepdim", b(*keepdim))],
        Op::ArgReduce { op: ArgReduceOp::ArgMax | ArgReduceOp::ArgMin, dim, keepdim } => {
            vec![("dim", dim.map_or_else(|| "none".to_string(), |d| d.to_string())), ("keepdim", b(*keepdim))]
        }
        Op::Softmax { dim, log: _ } | Op::LogSumExp { dim } | Op::Cumsum { dim } => vec![("dim", dim.to_string())],
        Op::Attention { scale, causal } | Op::AttentionBackward { scale, causal } => {
            vec![("scale", f(*scale)), ("causal", b(*causal))]
        }
        Op::CrossEntropyBackward { smoothing } => vec![("smoothing", f(*smoothing))],
        Op::RmsNorm { eps } | Op::RmsNormBackward { eps } => vec![("eps", f(*eps))],
        Op::View(v) => view_attributes(v),
        Op::Cat { dim } | Op::Gather { dim } | Op::IndexSelect { dim } | Op::IndexAdd { dim } => {
            vec![("dim", dim.to_string())]
        }
        Op::Scatter { dim, reduce: ScatterReduce::Replace | ScatterReduce::Add } => vec![("dim", dim.to_string())],
        Op::Sort { dim, descending, stable } => {
            vec![("dim", dim.to_string()), ("descending", b(*descending)), ("stable", b(*stable))]
        }
        Op::TopK { k, dim, largest } => vec![("k", k.to_string()), ("dim", dim.to_string()), ("largest", b(*largest))],
        Op::Assign { shape, strides, offset } => {
            vec![("shape", list(shape)), ("strides", list(strides)), ("offset", offset.to_string())]
        }
        Op::Collective(c) => {
            let groups: Vec<String> = c.groups.iter().map(|g| list(g)).collect();
            let mut a = match &c.kind {
                Collective::AllReduce => vec![],
                Collective::AllGather { dim } | Collective::ReduceScatter { dim } => vec![("dim", dim.to_string())],
                Collective::AllToAll { split, concat } => {
                    vec![("split", split.to_string()), ("concat", concat.to_string())]
                }
                Collective::Permute { pairs } => {
                    let p: Vec<String> = pairs.iter().map(|(s, t)| format!("{s}->{t}")).collect();
                    vec![("pairs", format!("[{}]", p.join(", ")))]
                }
            };
            a.push(("groups", format!("[{}]", groups.join(", "))));
            a
        }
        Op::Redistribute(r) => {
            let p: Vec<String> = r.placements.iter().map(|p| p.to_string()).collect();
            vec![
                ("mesh", r.device.to_string()),
                ("axes", format!("[{}]", r.axes.join(", "))),
                ("placements", format!("[{}]", p.join(", "))),
            ]
        }
        Op::LocalMap(r) => {
            let lists = |ps: &[Vec<crate::Placement>]| {
                let each: Vec<String> = ps
                    .iter()
                    .map(|p| format!("[{}]", p.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")))
                    .collect();
                format!("[{}]", each.join(", "))
            };
            vec![
                ("mesh", r.device.to_string()),
                ("in", lists(&r.in_placements)),
                ("out", lists(&r.out_placements)),
                ("body", format!("{:016x}", fnv1a(r.text.as_bytes()))),
            ]
        }
        Op::Dequantize(q) | Op::QuantMatMul(q) => {
            let codes = match q.codes {
                Codes::E4M3 => "e4m3",
                Codes::E2M1 => "e2m1",
                Codes::I8 => "i8",
                Codes::I4 => "i4",
            };
            let mut a = vec![("codes", codes.to_string()), ("block", list(&q.block))];
            match q.global {
                Some(Global::Mul(g)) => a.push(("global", format!("*{g:?}"))),
                Some(Global::Div(g)) => a.push(("global", format!("/{g:?}"))),
                None => {}
            }
            match q.activations {
                Activations::Exact => {}
                Activations::Int8 => a.push(("activations", "int8".to_string())),
            }
            a
        }
        Op::PagedAttention { scale, kv_scales } => vec![("scale", f(*scale)), ("kv_scales", b(*kv_scales))],
        // The op's name is printed as the instruction's; the printer adds a
        // tag of its lowering (which needs the operands' types).
        Op::Custom(_) => vec![],
    }
}

fn view_attributes(v: &ViewOp) -> Vec<(&'static str, String)> {
    match v {
        ViewOp::Reshape(s) | ViewOp::Expand(s) => vec![("shape", list(s))],
        ViewOp::Permute(p) => vec![("dims", list(p))],
        ViewOp::Slice { dim, start, end, step } => vec![
            ("dim", dim.to_string()),
            ("start", start.to_string()),
            ("end", end.to_string()),
            ("step", step.to_string()),
        ],
        ViewOp::Select { dim, index } => vec![("dim", dim.to_string()), ("index", index.to_string())],
        ViewOp::Unsqueeze(d) => vec![("dim", d.to_string())],
        ViewOp::Squeeze(d) => vec![("dims", list(d))],
        ViewOp::Diagonal { offset, dim1, dim2 } => {
            vec![("offset", offset.to_string()), ("dim1", dim1.to_string()), ("dim2", dim2.to_string())]
        }
        ViewOp::AsStrided { shape, strides, offset } => {
            vec![("shape", list(shape)), ("strides", list(strides)), ("offset", offset.to_string())]
        }
    }
}

fn param_text(p: &Param, prog: &Program, out: &mut String) {
    let kind = match &p.kind {
        ParamKind::Input(i) => format!("input {i}"),
        ParamKind::State => "state".into(),
        ParamKind::Generator => "generator".into(),
        ParamKind::Constant => "constant".into(),
    };
    let _ = write!(out, "{}: {} {kind}", p.value, type_text(prog.meta(p.value)));
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut params = vec![];
        for p in &self.params {
            let mut s = String::new();
            param_text(p, self, &mut s);
            params.push(s);
        }
        if params.len() <= 4 {
            writeln!(f, "program({}) {{", params.join(", "))?;
        } else {
            writeln!(f, "program(")?;
            for p in &params {
                writeln!(f, "    {p},")?;
            }
            writeln!(f, ") {{")?;
        }
        for inst in &self.insts {
            let outs: Vec<String> = inst.results().map(|v| v.to_string()).collect();
            let args: Vec<String> = inst.args.iter().map(|v| v.to_string()).collect();
            let mut attrs = attributes(&inst.op);
            if let Op::Custom(c) = &inst.op {
                let ins: Vec<Meta> = inst.args.iter().map(|v| self.meta(*v).clone()).collect();
                if let Some(id) = c.identity(&ins, &inst.outs) {
                    attrs.push(("lowering", format!("{:016x}", fnv1a(id.as_bytes()))));
                }
            }
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                let kv: Vec<String> = attrs.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!(" {{{}}}", kv.join(", "))
            };
            let types: Vec<String> = inst.outs.iter().map(type_text).collect();
            writeln!(
                f,
                "  {} = {}({}){attrs} : {}",
                outs.join(", "),
                inst.op.name(),
                args.join(", "),
                types.join(", ")
            )?;
            // A local region's body follows it, indented: a program of its own.
            if let Op::LocalMap(r) = &inst.op {
                for line in r.text.lines() {
                    writeln!(f, "    {line}")?;
                }
            }
        }
        let results: Vec<String> = self
            .results
            .iter()
            .map(|r| match &r.kind {
                ResultKind::Fresh => format!("{} fresh", r.value),
                ResultKind::Update(p) => format!("{} updates {}", r.value, self.params[*p].value),
                ResultKind::State => format!("{} state", r.value),
                ResultKind::Check(msg) => format!("{} check {msg:?}", r.value),
            })
            .collect();
        writeln!(f, "  return {}", results.join(", "))?;
        write!(f, "}}")
    }
}
