//! The lowering of custom ops (Note [Custom ops] in kiln-tensor's `custom.rs`):
//! a user's StableHLO function becomes a private function of the module,
//! called with `func.call`; a custom call target becomes `stablehlo.custom_call`.
use super::ops::Lowered;
use super::{Builder, Ty, Val};
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
            let (sym, text) = function(c.name(), x, &out_tys, &body);
            b.add_func(&sym, &text);
            b.op_n("func.call", &operands, "", &format!("callee = @{sym}"), &out_tys)
        }
        Lowering::CustomCall { target, api_version, backend_config } => {
            if target.is_empty() || target.contains(['"', '\\', '\n']) {
                return Err(Error::invalid(c.name(), format!("{target:?} is not a custom call target name")));
            }
            let mut attrs = format!("api_version = {api_version} : i32, call_target_name = \"{target}\"");
            if !backend_config.is_empty() {
                attrs.push_str(&format!(", backend_config = {backend_config}"));
            }
            b.op_n("stablehlo.custom_call", &operands, "", &attrs, &out_tys)
        }
    };
    Ok((results, vec![]))
}

/// The symbol and text (signature and body) of the private function holding
/// `body`, named after the op and a hash of its text, so that equal programs
/// keep equal text.
fn function(name: &str, x: &[Val], outs: &[Ty], body: &str) -> (String, String) {
    let args: Vec<String> = x.iter().enumerate().map(|(i, v)| format!("%arg{i}: {}", v.ty.mlir())).collect();
    let res: Vec<String> = outs.iter().map(|t| t.mlir()).collect();
    let text = format!("({}) -> ({}) {{\n{}\n  }}", args.join(", "), res.join(", "), body.trim_end());
    let hash = Sha256::digest(text.as_bytes());
    let tag: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let clean: String = name.chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' }).collect();
    (format!("kiln_custom_{clean}_{tag}"), text)
}
