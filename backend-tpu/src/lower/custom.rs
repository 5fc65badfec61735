//! The lowering of custom ops (Note [Custom ops] in kiln-tensor's `custom.rs`):
//! a user's StableHLO function becomes a private function of the module,
//! called with `func.call`; a custom call target becomes `stablehlo.custom_call`.
use super::ops::Lowered;
use super::{Attr, Builder, Ty, Val};
use crate::stablehlo::Func;
use kiln_tensor::custom::CustomOpRef;
use kiln_tensor::{Error, Lowering, Meta, Result};
use sha2::{Digest, Sha256};

/// Lowers custom op `c` on `x` to results of the types `outs`.
pub fn lower(b: &mut Builder, c: &CustomOpRef, x: &[Val], outs: &[Meta]) -> Result<Lowered> {
    let ins: Vec<Meta> = x.iter().map(|v| Meta { shape: v.shape().into(), dtype: v.dtype() }).collect();
    let out_tys: Vec<Ty> = outs.iter().map(|m| Ty::new(&m.shape, m.dtype)).collect();
    let operands: Vec<&Val> = x.iter().collect();
    let results = match c.stablehlo(&ins, outs)? {
        Lowering::Function(body) => {
            let f = function(c.name(), x, &out_tys, &body);
            let callee = Attr::Symbol(f.name().to_string());
            b.add_func(f);
            b.op_n("func.call", &operands, vec![], vec![("callee", callee)], &out_tys)
        }
        Lowering::CustomCall { target, api_version, backend_config } => {
            if target.is_empty() || target.contains(['"', '\\', '\n']) {
                return Err(Error::invalid(c.name(), format!("{target:?} is not a custom call target name")));
            }
            let mut attrs =
                vec![("api_version", Attr::Int(api_version.into(), "i32")), ("call_target_name", Attr::Str(target))];
            if !backend_config.is_empty() {
                attrs.push(("backend_config", config(&backend_config)));
            }
            b.op_n("stablehlo.custom_call", &operands, vec![], attrs, &out_tys)
        }
    };
    Ok((results, vec![]))
}

/// A custom call's `backend_config` as given: a plain string literal (no
/// quote or backslash inside) is a string attribute, anything else (a typed
/// FFI dictionary) stays the op's own MLIR text.
fn config(text: &str) -> Attr {
    let t = text.trim();
    match t.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(inner) if !inner.contains(['"', '\\']) => Attr::Str(inner.to_string()),
        _ => Attr::Text(text.to_string()),
    }
}

/// The private function holding `body`, named after the op and a hash of its
/// signature and body, so that equal programs keep equal text.
fn function(name: &str, x: &[Val], outs: &[Ty], body: &str) -> Func {
    let args: Vec<String> = x.iter().enumerate().map(|(i, v)| format!("%arg{i}: {}", v.ty.mlir())).collect();
    let res: Vec<String> = outs.iter().map(|t| t.mlir()).collect();
    let text = format!("({}) -> ({}) {{\n{}\n  }}", args.join(", "), res.join(", "), body.trim_end());
    let hash = Sha256::digest(text.as_bytes());
    let tag: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let clean: String = name.chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' }).collect();
    Func::Custom {
        name: format!("kiln_custom_{clean}_{tag}"),
        args: x.iter().map(|v| v.ty.clone()).collect(),
        results: outs.to_vec(),
        body: body.to_string(),
    }
}
