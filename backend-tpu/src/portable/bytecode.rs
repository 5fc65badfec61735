//! A writer of MLIR bytecode, version 1 (Note [Portable artifacts]): the
//! header, the string, dialect, attribute/type and IR sections. Attributes
//! and types are written in their textual form (the format's "assembly
//! format fallback"), which every reader parses with the dialect's own
//! parser; everything else is the binary encoding.
use super::vhlo::{Op, VRegion as Region};
use std::collections::HashMap;

/// The bytecode version written: the one StableHLO's own portable artifacts
/// used for its early targets, which every later reader accepts.
const VERSION: u64 = 1;

const SECTION_STRING: u8 = 0;
const SECTION_DIALECT: u8 = 1;
const SECTION_ATTR_TYPE: u8 = 2;
const SECTION_ATTR_TYPE_OFFSET: u8 = 3;
const SECTION_IR: u8 = 4;

const HAS_ATTRS: u8 = 0b0000_0001;
const HAS_RESULTS: u8 = 0b0000_0010;
const HAS_OPERANDS: u8 = 0b0000_0100;
const HAS_INLINE_REGIONS: u8 = 0b0001_0000;

/// Appends `v` as a PrefixVarInt: the count of extra bytes in unary (trailing
/// zero bits ended by a one) in the low bits of the first byte, then the
/// value, little-endian.
pub(crate) fn varint(out: &mut Vec<u8>, v: u64) {
    for extra in 0..8u32 {
        let bits = 7 * (extra + 1);
        if bits >= 64 || v < (1u64 << bits) {
            let enc = (u128::from(v) << (extra + 1)) | (1u128 << extra);
            out.extend_from_slice(&enc.to_le_bytes()[..extra as usize + 1]);
            return;
        }
    }
    out.push(0);
    out.extend_from_slice(&v.to_le_bytes());
}

/// Interned tables of one module.
#[derive(Default)]
struct Tables {
    strings: Vec<String>,
    string_ids: HashMap<String, u64>,
    attrs: Vec<String>,
    attr_ids: HashMap<String, u64>,
    types: Vec<String>,
    type_ids: HashMap<String, u64>,
    /// Op names by dialect: (dialect index, name string index).
    op_names: Vec<(u64, u64)>,
    op_ids: HashMap<String, u64>,
}

fn intern(list: &mut Vec<String>, ids: &mut HashMap<String, u64>, s: &str) -> u64 {
    if let Some(&i) = ids.get(s) {
        return i;
    }
    let i = list.len() as u64;
    list.push(s.to_string());
    ids.insert(s.to_string(), i);
    i
}

/// The dialects named: `builtin` (the module) and `vhlo`.
const DIALECTS: [&str; 2] = ["builtin", "vhlo"];

impl Tables {
    fn string(&mut self, s: &str) -> u64 {
        intern(&mut self.strings, &mut self.string_ids, s)
    }
    fn attr(&mut self, s: &str) -> u64 {
        intern(&mut self.attrs, &mut self.attr_ids, s)
    }
    fn ty(&mut self, s: &str) -> u64 {
        intern(&mut self.types, &mut self.type_ids, s)
    }
    fn op_name(&mut self, full: &str) -> Result<u64, String> {
        if let Some(&i) = self.op_ids.get(full) {
            return Ok(i);
        }
        let (dialect, name) = full.split_once('.').ok_or(format!("op name {full} has no dialect"))?;
        let d = DIALECTS.iter().position(|x| *x == dialect).ok_or(format!("dialect {dialect} is not written"))?;
        let s = self.string(name);
        let i = self.op_names.len() as u64;
        self.op_names.push((d as u64, s));
        self.op_ids.insert(full.to_string(), i);
        Ok(i)
    }
}

/// The values visible while writing a region: names to indices, innermost
/// region last.
struct Scope {
    frames: Vec<HashMap<String, u64>>,
}

impl Scope {
    fn lookup(&self, name: &str) -> Result<u64, String> {
        self.frames
            .iter()
            .rev()
            .find_map(|f| f.get(name).copied())
            .ok_or(format!("value {name} is used but not defined"))
    }
}

fn dict(attrs: &[(String, String)]) -> String {
    let items: Vec<String> = attrs.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    format!("{{{}}}", items.join(", "))
}

/// The bytecode of `builtin.module` holding `funcs`, with the module's own
/// attributes `module_attrs` (text, builtin syntax), produced by `producer`.
pub(crate) fn write(module_attrs: &[(String, String)], funcs: &[Op], producer: &str) -> Result<Vec<u8>, String> {
    let mut t = Tables::default();
    for d in DIALECTS {
        t.string(d);
    }
    let loc = t.attr("loc(unknown)");
    let mut ir = Vec::new();
    // The top-level block: one op, the module.
    varint(&mut ir, 1 << 1);
    let module_name = t.op_name("builtin.module")?;
    varint(&mut ir, module_name);
    let has_attrs = !module_attrs.is_empty();
    ir.push(HAS_INLINE_REGIONS | if has_attrs { HAS_ATTRS } else { 0 });
    varint(&mut ir, loc);
    if has_attrs {
        let a = t.attr(&dict(module_attrs));
        varint(&mut ir, a);
    }
    // One region, isolated from above, holding no values of its own.
    varint(&mut ir, (1 << 1) | 1);
    varint(&mut ir, 1);
    varint(&mut ir, 0);
    varint(&mut ir, (funcs.len() as u64) << 1);
    let mut scope = Scope { frames: vec![HashMap::new()] };
    for f in funcs {
        op(&mut ir, &mut t, &mut scope, f, loc)?;
    }

    // Strings, attributes and types are written null-terminated.
    if t.strings.iter().chain(&t.attrs).chain(&t.types).any(|s| s.contains('\0')) {
        return Err("the program holds a NUL character (in a name or an attribute)".into());
    }
    let mut out = b"ML\xefR".to_vec();
    varint(&mut out, VERSION);
    out.extend_from_slice(producer.as_bytes());
    out.push(0);

    // Dialect section: the names (unversioned), then op names grouped by dialect.
    let mut ds = Vec::new();
    varint(&mut ds, DIALECTS.len() as u64);
    for (i, _) in DIALECTS.iter().enumerate() {
        varint(&mut ds, (i as u64) << 1);
    }
    // Op names are numbered in the order the groups list them; a group per
    // run of one dialect keeps the interning order (a dialect may have several).
    for run in t.op_names.chunk_by(|a, b| a.0 == b.0) {
        varint(&mut ds, run[0].0);
        varint(&mut ds, run.len() as u64);
        for &(_, s) in run {
            varint(&mut ds, s);
        }
    }

    // Attributes and types as text, each null-terminated, in one group.
    let (mut at, mut offs) = (Vec::new(), Vec::new());
    varint(&mut offs, t.attrs.len() as u64);
    varint(&mut offs, t.types.len() as u64);
    for list in [&t.attrs, &t.types] {
        if list.is_empty() {
            continue;
        }
        varint(&mut offs, 0);
        varint(&mut offs, list.len() as u64);
        for s in list {
            at.extend_from_slice(s.as_bytes());
            at.push(0);
            varint(&mut offs, ((s.len() as u64) + 1) << 1);
        }
    }

    // Strings: the count, the lengths (with the terminator) in reverse, the data.
    let mut ss = Vec::new();
    varint(&mut ss, t.strings.len() as u64);
    for s in t.strings.iter().rev() {
        varint(&mut ss, s.len() as u64 + 1);
    }
    for s in &t.strings {
        ss.extend_from_slice(s.as_bytes());
        ss.push(0);
    }

    for (id, data) in [
        (SECTION_STRING, ss),
        (SECTION_DIALECT, ds),
        (SECTION_ATTR_TYPE, at),
        (SECTION_ATTR_TYPE_OFFSET, offs),
        (SECTION_IR, ir),
    ] {
        out.push(id);
        varint(&mut out, data.len() as u64);
        out.extend_from_slice(&data);
    }
    Ok(out)
}

/// Writes op `o`, then its regions.
fn op(ir: &mut Vec<u8>, t: &mut Tables, scope: &mut Scope, o: &Op, loc: u64) -> Result<(), String> {
    let name = t.op_name(&o.name)?;
    varint(ir, name);
    let mut mask = 0;
    if !o.attrs.is_empty() {
        mask |= HAS_ATTRS;
    }
    if !o.result_types.is_empty() {
        mask |= HAS_RESULTS;
    }
    if !o.operands.is_empty() {
        mask |= HAS_OPERANDS;
    }
    if !o.regions.is_empty() {
        mask |= HAS_INLINE_REGIONS;
    }
    ir.push(mask);
    varint(ir, loc);
    if !o.attrs.is_empty() {
        let a = t.attr(&dict(&o.attrs));
        varint(ir, a);
    }
    if !o.result_types.is_empty() {
        varint(ir, o.result_types.len() as u64);
        for r in &o.result_types {
            let i = t.ty(r);
            varint(ir, i);
        }
    }
    if !o.operands.is_empty() {
        varint(ir, o.operands.len() as u64);
        for v in &o.operands {
            let i = scope.lookup(v)?;
            varint(ir, i);
        }
    }
    if o.regions.is_empty() {
        return Ok(());
    }
    // Regions of VHLO ops are not isolated from above: their values number
    // after those of every enclosing region of the scope.
    varint(ir, (o.regions.len() as u64) << 1);
    let first = scope.frames.iter().map(|f| f.len() as u64).sum::<u64>();
    for r in &o.regions {
        region(ir, t, scope, first, r, loc)?;
    }
    Ok(())
}

fn region(ir: &mut Vec<u8>, t: &mut Tables, scope: &mut Scope, base: u64, r: &Region, loc: u64) -> Result<(), String> {
    // The values the region defines directly (its arguments, its own ops'
    // results), numbered from `base`.
    let mut names = HashMap::new();
    let defined = r.args.iter().map(|(n, _)| n).chain(r.ops.iter().flat_map(|o| &o.results));
    for (k, n) in defined.enumerate() {
        if names.insert(n.clone(), base + k as u64).is_some() {
            return Err(format!("value {n} is defined twice in one region"));
        }
    }
    varint(ir, 1);
    varint(ir, names.len() as u64);
    varint(ir, ((r.ops.len() as u64) << 1) | u64::from(!r.args.is_empty()));
    if !r.args.is_empty() {
        varint(ir, r.args.len() as u64);
        for (_, ty) in &r.args {
            let i = t.ty(ty);
            varint(ir, i);
            varint(ir, loc);
        }
    }
    scope.frames.push(names);
    let res = r.ops.iter().try_for_each(|o| op(ir, t, scope, o, loc));
    scope.frames.pop();
    res
}
