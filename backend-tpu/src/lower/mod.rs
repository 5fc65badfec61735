//! The StableHLO emitter: a [`Module`] tree (Note [StableHLO modules] in
//! `stablehlo/`), built by a small [`Builder`]. `ops.rs` holds one lowering per primitive (`random.rs` the
//! Philox rounds of `random_bits`), `view.rs` the reads
//! and writes of strided views of flat buffers; [`exec_module`],
//! [`read_module`] and [`assign_module`] assemble whole programs. Nothing here
//! needs a device, so every lowering has golden-text tests.
mod collective;
mod custom;
mod elementwise;
mod fused;
mod grouped;
mod index;
pub mod mesh;
mod ops;
mod paged;
mod program;
mod quant;
mod random;
mod reduce;
pub mod region;
pub mod shard;
mod view;

pub use collective::manual_computation;
pub use ops::{lower_op, Check};
pub(crate) use program::{lower_into, Follower};
pub use program::{lower_mesh_program, lower_program, Constants, Lowered, LoweredProgram};
pub use shard::{mesh_decl, Sharding};
pub use view::{read_view, write_view};

use crate::stablehlo::{Func, Port};
use kiln_tensor::{DType, Error, Layout, Meta, Result};

pub use crate::stablehlo::{Attr, Attrs, Module, Name, NameKind, Operation, Region, Ty, Val};

/// A scalar literal before conversion to an element type.
#[derive(Debug, Clone, Copy)]
pub enum Lit {
    F(f64),
    I(i64),
    B(bool),
}

/// `array<i64: 1, 2>`.
pub fn arr(v: &[usize]) -> Attr {
    Attr::I64s(list(v))
}

/// Dimensions as the integers of an attribute (`[1, 2]` inside dialect attributes).
pub fn list(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

/// The attributes of a `stablehlo.gather`: dimension numbers, unsorted
/// indices, slice sizes.
pub fn gather_attrs(
    offset: &[usize],
    collapsed: &[usize],
    start_map: &[usize],
    index_dim: usize,
    sizes: &[usize],
) -> Attrs {
    let dims = Attr::Gather {
        offset_dims: list(offset),
        collapsed_slice_dims: list(collapsed),
        operand_batching_dims: vec![],
        start_indices_batching_dims: vec![],
        start_index_map: list(start_map),
        index_vector_dim: index_dim as i64,
    };
    vec![("dimension_numbers", dims), ("indices_are_sorted", Attr::Bool(false)), ("slice_sizes", arr(sizes))]
}

/// The attributes of a `stablehlo.scatter`: dimension numbers, unsorted and
/// possibly repeated indices.
pub fn scatter_attrs(window: &[usize], inserted: &[usize], to_operand: &[usize], index_dim: usize) -> Attrs {
    let dims = Attr::Scatter {
        update_window_dims: list(window),
        inserted_window_dims: list(inserted),
        scatter_dims_to_operand_dims: list(to_operand),
        index_vector_dim: index_dim as i64,
    };
    vec![
        ("scatter_dimension_numbers", dims),
        ("indices_are_sorted", Attr::Bool(false)),
        ("unique_indices", Attr::Bool(false)),
    ]
}

/// `#stablehlo<kind VALUE>`.
pub fn enum_attr(kind: &'static str, value: &str) -> Attr {
    Attr::Enum { kind, value: value.to_string() }
}

/// A scalar converted to an element type: a bool, an integer (already
/// wrapped to the type), or a float's bit pattern.
enum Converted {
    Bool(bool),
    Int(i64),
    /// The bits and the type's width in bytes.
    Bits(u64, usize),
}

/// `v` converted to `dtype` with PyTorch's cast rules (float to integer
/// truncates through int64, anything to bool is `!= 0`, everything into
/// bf16/f16 goes through float32).
fn convert(v: Lit, dtype: DType) -> Converted {
    let as_f64 = match v {
        Lit::F(f) => f,
        Lit::I(i) => i as f64,
        Lit::B(b) => b as u8 as f64,
    };
    let as_i64 = match v {
        Lit::F(f) => f as i64,
        Lit::I(i) => i,
        Lit::B(b) => b as i64,
    };
    let truth = match v {
        Lit::F(f) => f != 0.0,
        Lit::I(i) => i != 0,
        Lit::B(b) => b,
    };
    let f32v = match v {
        Lit::I(i) => i as f32,
        _ => as_f64 as f32,
    };
    match dtype {
        DType::Bool => Converted::Bool(truth),
        DType::U8 => Converted::Int((as_i64 as u8).into()),
        DType::I8 => Converted::Int((as_i64 as i8).into()),
        DType::I16 => Converted::Int((as_i64 as i16).into()),
        DType::I32 => Converted::Int((as_i64 as i32).into()),
        DType::I64 => Converted::Int(as_i64),
        DType::F8E5M2 => Converted::Bits(kiln_tensor::f8e5m2::from_f32(f32v).to_bits().into(), 1),
        DType::F8E4M3FN => Converted::Bits(kiln_tensor::f8e4m3fn::from_f32(f32v).to_bits().into(), 1),
        DType::F16 => Converted::Bits(half::f16::from_f32(f32v).to_bits().into(), 2),
        DType::BF16 => Converted::Bits(half::bf16::from_f32(f32v).to_bits().into(), 2),
        DType::F32 => Converted::Bits(f32v.to_bits().into(), 4),
        DType::F64 => Converted::Bits(as_f64.to_bits(), 8),
    }
}

/// The literal text of `v` converted to `dtype` (see `convert`). Floats are
/// written as their bit pattern, so NaN, infinities and signed zeros are exact.
pub fn literal(v: Lit, dtype: DType) -> String {
    match convert(v, dtype) {
        Converted::Bool(b) => if b { "true" } else { "false" }.into(),
        Converted::Int(i) => i.to_string(),
        Converted::Bits(bits, width) => format!("0x{bits:0w$X}", w = 2 * width),
    }
}

/// The little-endian bytes of `v` converted to `dtype` exactly as [`literal`]
/// writes it: the value of a scalar argument uploaded at run time.
pub fn literal_bytes(v: Lit, dtype: DType) -> Vec<u8> {
    let width = dtype.size_in_bytes();
    match convert(v, dtype) {
        Converted::Bool(b) => vec![b as u8],
        Converted::Int(i) => i.to_le_bytes()[..width].to_vec(),
        Converted::Bits(bits, w) => bits.to_le_bytes()[..w].to_vec(),
    }
}

/// The scalar values a creation op takes at run time (see [`creation_module`]).
pub fn creation_args(op: &kiln_tensor::Op) -> Option<Vec<(Vec<u8>, DType)>> {
    use kiln_tensor::{Op, Scalar};
    match op {
        Op::Full { value, dtype, .. } => {
            let lit = match *value {
                Scalar::Bool(v) => Lit::B(v),
                Scalar::Int(v) => Lit::I(v),
                Scalar::Float(v) => Lit::F(v),
            };
            Some(vec![(literal_bytes(lit, *dtype), *dtype)])
        }
        Op::Arange { start, step, .. } => {
            Some(vec![(start.to_le_bytes().to_vec(), DType::F64), (step.to_le_bytes().to_vec(), DType::F64)])
        }
        _ => None,
    }
}

/// The program of a creation op (`Full`, `Arange`) whose values are scalar
/// arguments, so that one executable serves every value: a fill value or a
/// range start that changes every step (an optimizer's bias correction, a
/// decoding position) never recompiles.
pub fn creation_module(op: &kiln_tensor::Op) -> Result<Module> {
    let tys: Vec<Ty> = creation_args(op)
        .ok_or_else(|| Error::backend("pjrt", format!("{} is not a creation op", op.name())))?
        .iter()
        .map(|(_, dt)| Ty::new(&[1], *dt))
        .collect();
    let (mut b, args) = Builder::new(&tys);
    let v = creation_lower(&mut b, op, &args)?;
    let n = v.ty.numel();
    let flat = b.reshape(&v, &[n]);
    Ok(b.finish(&[flat]))
}

/// The lowering of a creation op from its scalar arguments (see [`creation_args`]),
/// each a flat one-element value like every program argument.
pub fn creation_lower(b: &mut Builder, op: &kiln_tensor::Op, flat_args: &[Val]) -> Result<Val> {
    use kiln_tensor::Op;
    let args: Vec<Val> = flat_args.iter().map(|a| b.reshape(a, &[])).collect();
    match op {
        Op::Full { shape, .. } => Ok(b.broadcast(&args[0], shape, &[])),
        Op::Arange { len, dtype, .. } => {
            let i = b.iota(&[*len], 0, DType::F64);
            let st = b.broadcast(&args[1], &[*len], &[]);
            let s0 = b.broadcast(&args[0], &[*len], &[]);
            let p = b.mul(&st, &i);
            let v = b.add(&s0, &p);
            Ok(b.cast(&v, *dtype))
        }
        other => Err(Error::backend("pjrt", format!("{} is not a creation op", other.name()))),
    }
}

/// Builds one function of a [`Module`]: its arguments, its body's
/// operations, and the private functions it calls.
pub struct Builder {
    /// The operations of the block being built.
    ops: Vec<Operation>,
    next: usize,
    args: Vec<Ty>,
    /// The sharding of each argument of a program over a mesh (Note [Shardings]).
    arg_shardings: Vec<Option<Sharding>>,
    /// `(argument, output)` pairs: the argument's buffer is donated to the output.
    aliases: Vec<(usize, usize)>,
    /// Private functions of the module (custom ops' lowerings).
    funcs: Vec<Func>,
}

impl Builder {
    /// A builder for a function of the given argument types, and the arguments as values.
    pub fn new(args: &[Ty]) -> (Builder, Vec<Val>) {
        let mut b =
            Builder { ops: vec![], next: 0, args: vec![], arg_shardings: vec![], aliases: vec![], funcs: vec![] };
        let vals = args.iter().map(|t| b.add_arg(t.clone())).collect();
        (b, vals)
    }

    /// Appends an argument to the function and returns it as a value.
    pub fn add_arg(&mut self, ty: Ty) -> Val {
        let v = Val { name: Name::new(NameKind::Arg, self.args.len()), ty: ty.clone() };
        self.args.push(ty);
        self.arg_shardings.push(None);
        v
    }

    /// The function's arguments, as values.
    pub fn args(&self) -> Vec<Val> {
        self.args.iter().enumerate().map(|(i, t)| Val { name: Name::new(NameKind::Arg, i), ty: t.clone() }).collect()
    }

    /// Appends an argument of a program over a mesh: `ty` is the global type,
    /// each device passes its shard.
    /// Whether some argument is sharded: a program over a mesh.
    pub fn is_sharded(&self) -> bool {
        self.arg_shardings.iter().any(|s| s.is_some())
    }

    pub fn add_sharded_arg(&mut self, ty: Ty, sharding: Sharding) -> Result<Val> {
        if let Some(first) = self.arg_shardings.iter().flatten().next() {
            shard::check_mesh(&sharding, &first.mesh)?;
        }
        let v = self.add_arg(ty);
        if let Some(s) = self.arg_shardings.last_mut() {
            *s = Some(sharding);
        }
        Ok(v)
    }

    fn fresh(&mut self) -> Name {
        self.next += 1;
        Name::new(NameKind::Value, self.next)
    }

    /// Appends `"name"(operands) {attrs} : (types) -> out` and returns its result.
    pub fn op(&mut self, name: &str, operands: &[&Val], attrs: Attrs, out: Ty) -> Val {
        self.op_n(name, operands, vec![], attrs, &[out]).pop().expect("one result")
    }

    /// An op with one region and one result.
    pub fn op_region(&mut self, name: &str, operands: &[&Val], region: Region, attrs: Attrs, out: Ty) -> Val {
        self.op_n(name, operands, vec![region], attrs, std::slice::from_ref(&out)).pop().expect("one result")
    }

    /// An op with several results and any number of regions.
    pub fn op_n(&mut self, name: &str, operands: &[&Val], regions: Vec<Region>, attrs: Attrs, outs: &[Ty]) -> Vec<Val> {
        let o = Operation {
            result: Some(self.fresh()),
            name: name.to_string(),
            operands: operands.iter().map(|v| (*v).clone()).collect(),
            regions,
            attrs,
            results: outs.to_vec(),
        };
        let vals = o.values();
        self.ops.push(o);
        vals
    }

    /// A one-block region with arguments of the given types, whose body `f`
    /// builds and returns the values the block yields (`stablehlo.return`).
    pub fn region(&mut self, arg_tys: &[Ty], f: impl FnOnce(&mut Builder, Vec<Val>) -> Vec<Val>) -> Region {
        let saved = std::mem::take(&mut self.ops);
        let args: Vec<Val> = arg_tys.iter().map(|t| Val { name: self.fresh(), ty: t.clone() }).collect();
        let rets = f(self, args.clone());
        self.ops.push(terminator("stablehlo.return", &rets));
        Region { args, ops: std::mem::replace(&mut self.ops, saved) }
    }

    /// The operations built so far (a local region's body, `collective.rs`).
    pub fn take_ops(&mut self) -> Vec<Operation> {
        std::mem::take(&mut self.ops)
    }

    /// The name of the op that defines `v` in this function (`stablehlo.reduce`),
    /// if `v` is the single result of an op of it.
    pub fn defining_op(&self, v: &Val) -> Option<&str> {
        self.ops.iter().find(|o| o.result == Some(v.name) && o.results.len() == 1).map(|o| o.name.as_str())
    }

    /// `x` moved to the sharding `s` (`sdy.reshard`): the partitioner inserts
    /// the collectives (a partial sum resharded without its unreduced axes is all-reduced).
    pub fn reshard(&mut self, x: &Val, s: &Sharding) -> Val {
        self.op("sdy.sharding_constraint", &[x], vec![("sharding", Attr::Sharding(s.clone()))], x.ty.clone())
    }

    /// Adds the private function `f` to the module, once (by name).
    pub fn add_func(&mut self, f: Func) {
        if !self.funcs.iter().any(|g| g.name() == f.name()) {
            self.funcs.push(f);
        }
    }

    /// Takes the private functions of `other` (a region's body) into this module.
    pub fn take_funcs(&mut self, other: &mut Builder) {
        for f in std::mem::take(&mut other.funcs) {
            self.add_func(f);
        }
    }

    /// The function built so far as the private function `@name` of a
    /// module, returning `outs` (to add to another builder with [`Builder::add_func`]).
    pub fn into_private(self, name: &str, outs: &[Val]) -> Func {
        let args = self.args.iter().map(|t| Port { ty: t.clone(), attrs: vec![] }).collect();
        let body_args = self.args();
        let mut ops = self.ops;
        ops.push(terminator("func.return", outs));
        Func::Built {
            name: name.into(),
            public: false,
            args,
            results: outs.iter().map(|v| Port { ty: v.ty.clone(), attrs: vec![] }).collect(),
            body: Region { args: body_args, ops },
        }
    }

    /// Donates argument `arg`'s buffer to output `out` (same type): the program
    /// may write the output in place (`tf.aliasing_output`), and the caller must
    /// not use the argument's buffer afterwards.
    pub fn alias(&mut self, arg: usize, out: usize) {
        self.aliases.push((arg, out));
    }

    /// The whole module with `outs` returned from `@main`.
    /// In a program over a mesh (sharded arguments), the results are replicated.
    pub fn finish(self, outs: &[Val]) -> Module {
        // The arguments share one mesh (`add_sharded_arg`), which the results are replicated over.
        let mesh = self.arg_shardings.iter().flatten().next().map(|s| s.mesh.clone());
        let outs_sharded: Vec<Sharding> = match &mesh {
            Some(m) => outs.iter().map(|v| Sharding::replicated(m, v.ty.rank())).collect(),
            None => vec![],
        };
        self.assemble(outs, &outs_sharded, mesh)
    }

    /// The whole module, the results of a program over a mesh carrying
    /// `out_shardings` (one per result, or none for a one-device program). Every
    /// sharding must be over the same root mesh, which the module declares.
    pub fn finish_sharded(self, outs: &[Val], out_shardings: &[Sharding]) -> Result<Module> {
        let mut mesh: Option<kiln_tensor::DeviceMesh> = None;
        for s in self.arg_shardings.iter().flatten().chain(out_shardings) {
            match &mesh {
                None => mesh = Some(s.mesh.clone()),
                Some(m) => shard::check_mesh(s, m)?,
            }
        }
        if mesh.is_some() && out_shardings.len() != outs.len() {
            return Err(kiln_tensor::Error::backend(
                "pjrt",
                format!(
                    "a program over a mesh with {} results was given {} result shardings",
                    outs.len(),
                    out_shardings.len()
                ),
            ));
        }
        Ok(self.assemble(outs, out_shardings, mesh))
    }

    /// The module of checked parts: one sharding per result when `mesh` is set.
    fn assemble(self, outs: &[Val], out_shardings: &[Sharding], mesh: Option<kiln_tensor::DeviceMesh>) -> Module {
        let args: Vec<Port> = (0..self.args.len())
            .map(|i| {
                let mut attrs: Attrs = vec![];
                if let Some((_, o)) = self.aliases.iter().find(|a| a.0 == i) {
                    attrs.push(("tf.aliasing_output", Attr::Int(*o as i64, "i32")));
                }
                if let Some(s) = &self.arg_shardings[i] {
                    attrs.push(("sdy.sharding", Attr::Sharding(s.clone())));
                }
                Port { ty: self.args[i].clone(), attrs }
            })
            .collect();
        // A partial-sum result must be declared unreduced inside the function too
        // (Shardy refuses an implicit unreduced-to-reduced transition at the return).
        let body_args = self.args();
        let mut ops = self.ops;
        let mut rets: Vec<Val> = outs.to_vec();
        for (i, s) in out_shardings.iter().enumerate() {
            if !s.unreduced.is_empty() {
                let name = Name::new(NameKind::Unreduced, i);
                ops.push(Operation {
                    result: Some(name),
                    name: "sdy.sharding_constraint".into(),
                    operands: vec![rets[i].clone()],
                    regions: vec![],
                    attrs: vec![("sharding", Attr::Sharding(s.clone()))],
                    results: vec![rets[i].ty.clone()],
                });
                rets[i] = Val { name, ty: rets[i].ty.clone() };
            }
        }
        ops.push(terminator("func.return", &rets));
        let results: Vec<Port> = outs
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let attrs = match (&mesh, out_shardings.get(i)) {
                    (Some(_), Some(s)) => vec![("sdy.sharding", Attr::Sharding(s.clone()))],
                    _ => vec![],
                };
                Port { ty: v.ty.clone(), attrs }
            })
            .collect();
        let main =
            Func::Built { name: "main".into(), public: true, args, results, body: Region { args: body_args, ops } };
        let mut funcs = vec![main];
        funcs.extend(self.funcs);
        Module { partitions: mesh.as_ref().map_or(1, |m| m.devices().len()), mesh, funcs }
    }

    // ---- building blocks ---------------------------------------------------------------

    /// A scalar constant of `dtype`.
    pub fn constant(&mut self, v: Lit, dtype: DType) -> Val {
        let ty = Ty::new(&[], dtype);
        let attrs = vec![("value", Attr::Scalar { literal: literal(v, dtype), ty: ty.clone() })];
        self.op("stablehlo.constant", &[], attrs, ty)
    }
    /// `v` broadcast to `shape`.
    pub fn splat(&mut self, v: Lit, dtype: DType, shape: &[usize]) -> Val {
        let c = self.constant(v, dtype);
        self.broadcast(&c, shape, &[])
    }
    /// A constant like `like` (same shape and dtype).
    pub fn splat_like(&mut self, v: Lit, like: &Val) -> Val {
        let (dt, shape) = (like.dtype(), like.shape().to_vec());
        self.splat(v, dt, &shape)
    }
    /// `broadcast_in_dim`: operand dim `i` becomes output dim `dims[i]`.
    pub fn broadcast(&mut self, x: &Val, shape: &[usize], dims: &[usize]) -> Val {
        if x.shape() == shape && dims.iter().enumerate().all(|(i, &d)| i == d) {
            return x.clone();
        }
        self.op(
            "stablehlo.broadcast_in_dim",
            &[x],
            vec![("broadcast_dimensions", arr(dims))],
            Ty::new(shape, x.dtype()),
        )
    }
    pub fn unary(&mut self, name: &str, x: &Val) -> Val {
        self.op(&format!("stablehlo.{name}"), &[x], vec![], x.ty.clone())
    }
    pub fn binary(&mut self, name: &str, a: &Val, b: &Val) -> Val {
        self.op(&format!("stablehlo.{name}"), &[a, b], vec![], a.ty.clone())
    }
    pub fn add(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("add", a, b)
    }
    pub fn sub(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("subtract", a, b)
    }
    pub fn mul(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("multiply", a, b)
    }
    pub fn div(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("divide", a, b)
    }
    /// `compare` with direction `EQ`, `NE`, `LT`, `LE`, `GT`, `GE`: output bool.
    pub fn compare(&mut self, dir: &str, a: &Val, b: &Val) -> Val {
        let kind = match a.dtype() {
            d if d.is_float() => "FLOAT",
            DType::Bool | DType::U8 => "UNSIGNED",
            _ => "SIGNED",
        };
        let attrs = vec![
            ("comparison_direction", enum_attr("comparison_direction", dir)),
            ("compare_type", enum_attr("comparison_type", kind)),
        ];
        self.op("stablehlo.compare", &[a, b], attrs, a.ty.with_dtype(DType::Bool))
    }
    /// `compare(x, v)` against a constant.
    pub fn compare_lit(&mut self, dir: &str, x: &Val, v: Lit) -> Val {
        let c = self.splat_like(v, x);
        self.compare(dir, x, &c)
    }
    pub fn select(&mut self, c: &Val, a: &Val, b: &Val) -> Val {
        self.op("stablehlo.select", &[c, a, b], vec![], a.ty.clone())
    }
    pub fn and(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("and", a, b)
    }
    pub fn or(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("or", a, b)
    }
    pub fn not(&mut self, a: &Val) -> Val {
        self.unary("not", a)
    }
    /// `x != x`.
    pub fn is_nan(&mut self, x: &Val) -> Val {
        self.compare("NE", x, x)
    }
    /// A plain element conversion (`stablehlo.convert`).
    pub fn convert_raw(&mut self, x: &Val, to: DType) -> Val {
        if x.dtype() == to {
            return x.clone();
        }
        self.op("stablehlo.convert", &[x], vec![], x.ty.with_dtype(to))
    }
    /// PyTorch's cast (`tensor.to(dtype)`): to bool is `!= 0` (NaN is true), float
    /// to integer truncates through int64 (then wraps), into bf16/f16 goes through float32.
    pub fn cast(&mut self, x: &Val, to: DType) -> Val {
        let from = x.dtype();
        if from == to {
            return x.clone();
        }
        if to == DType::Bool {
            return self.compare_lit("NE", x, Lit::I(0));
        }
        if from == DType::Bool {
            return self.convert_raw(x, to);
        }
        if from.is_float() && !to.is_float() {
            let t = self.convert_raw(x, DType::I64);
            return self.convert_raw(&t, to);
        }
        // Into bf16/f16/float8 from a wider type goes through float32, as c10's
        // constructors take a float (one rounding to f32, then one to the target).
        let narrow = matches!(to, DType::BF16 | DType::F16) || to.is_float8();
        if narrow && from != DType::F32 && !matches!(from, DType::BF16 | DType::F16) {
            let t = self.convert_raw(x, DType::F32);
            return self.convert_raw(&t, to);
        }
        if !from.is_float() && !to.is_float() {
            // Integer to integer wraps, through int64 like the CPU kernels.
            let t = self.convert_raw(x, DType::I64);
            return self.convert_raw(&t, to);
        }
        self.convert_raw(x, to)
    }
    pub fn reshape(&mut self, x: &Val, shape: &[usize]) -> Val {
        if x.shape() == shape {
            return x.clone();
        }
        self.op("stablehlo.reshape", &[x], vec![], Ty::new(shape, x.dtype()))
    }
    pub fn transpose(&mut self, x: &Val, perm: &[usize]) -> Val {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return x.clone();
        }
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
        self.op("stablehlo.transpose", &[x], vec![("permutation", arr(perm))], Ty::new(&shape, x.dtype()))
    }
    pub fn slice(&mut self, x: &Val, start: &[usize], limit: &[usize], strides: &[usize]) -> Val {
        if start.iter().all(|&s| s == 0) && limit == x.shape() && strides.iter().all(|&s| s == 1) {
            return x.clone();
        }
        let shape: Vec<usize> = (0..start.len()).map(|i| (limit[i] - start[i]).div_ceil(strides[i])).collect();
        let attrs = vec![("start_indices", arr(start)), ("limit_indices", arr(limit)), ("strides", arr(strides))];
        self.op("stablehlo.slice", &[x], attrs, Ty::new(&shape, x.dtype()))
    }
    /// `x[..., a:b, ...]` along `dim`.
    pub fn slice_dim(&mut self, x: &Val, dim: usize, a: usize, b: usize) -> Val {
        let mut start = vec![0; x.ty.rank()];
        let mut limit = x.shape().to_vec();
        start[dim] = a;
        limit[dim] = b;
        self.slice(x, &start, &limit, &vec![1; x.ty.rank()])
    }
    /// `0, 1, 2, ...` along `dim` of `shape`.
    pub fn iota(&mut self, shape: &[usize], dim: usize, dtype: DType) -> Val {
        self.op("stablehlo.iota", &[], vec![("iota_dimension", Attr::Int(dim as i64, "i64"))], Ty::new(shape, dtype))
    }
    pub fn concat(&mut self, xs: &[&Val], dim: usize) -> Val {
        let mut shape = xs[0].shape().to_vec();
        shape[dim] = xs.iter().map(|x| x.shape()[dim]).sum();
        let dt = xs[0].dtype();
        self.op("stablehlo.concatenate", xs, vec![("dimension", Attr::Int(dim as i64, "i64"))], Ty::new(&shape, dt))
    }
    /// Pads with `value`: `low`/`high` elements before/after each dim.
    pub fn pad(&mut self, x: &Val, value: Lit, low: &[usize], high: &[usize]) -> Val {
        if low.iter().chain(high).all(|&p| p == 0) {
            return x.clone();
        }
        let v = self.constant(value, x.dtype());
        let shape: Vec<usize> = (0..low.len()).map(|i| x.shape()[i] + low[i] + high[i]).collect();
        let attrs = vec![
            ("edge_padding_low", arr(low)),
            ("edge_padding_high", arr(high)),
            ("interior_padding", arr(&vec![0; low.len()])),
        ];
        self.op("stablehlo.pad", &[x, &v], attrs, Ty::new(&shape, x.dtype()))
    }
    /// Reduces `dims` of `x` with the binary op `body` (e.g. `add`; `nan_maximum` and
    /// `nan_minimum` propagate NaN) from `init`.
    pub fn reduce(&mut self, x: &Val, init: Lit, dims: &[usize], body: &str) -> Val {
        let dt = x.dtype();
        let init = self.constant(init, dt);
        let st = Ty::new(&[], dt);
        let body = body.to_string();
        let region = self.region(&[st.clone(), st], |b, a| {
            vec![match body.as_str() {
                "nan_maximum" => elementwise::nan_max(b, &a[0], &a[1], true),
                "nan_minimum" => elementwise::nan_max(b, &a[0], &a[1], false),
                _ => b.binary(&body, &a[0], &a[1]),
            }]
        });
        let shape: Vec<usize> = (0..x.ty.rank()).filter(|d| !dims.contains(d)).map(|d| x.shape()[d]).collect();
        self.op_region("stablehlo.reduce", &[x, &init], region, vec![("dimensions", arr(dims))], Ty::new(&shape, dt))
    }
    /// Batched matrix product: `lhs [batch..., m, k] @ rhs [batch..., k, n]`
    /// (general dimension numbers), computed at full precision.
    pub fn dot_general(&mut self, lhs: &Val, rhs: &Val, lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]) -> Val {
        let mut shape: Vec<usize> = lb.iter().map(|&d| lhs.shape()[d]).collect();
        shape.extend((0..lhs.ty.rank()).filter(|d| !lb.contains(d) && !lc.contains(d)).map(|d| lhs.shape()[d]));
        shape.extend((0..rhs.ty.rank()).filter(|d| !rb.contains(d) && !rc.contains(d)).map(|d| rhs.shape()[d]));
        let dims =
            Attr::Dot { lhs_batch: list(lb), rhs_batch: list(rb), lhs_contract: list(lc), rhs_contract: list(rc) };
        let highest = Attr::Array(vec![enum_attr("precision", "HIGHEST"), enum_attr("precision", "HIGHEST")]);
        let attrs = vec![("dot_dimension_numbers", dims), ("precision_config", highest)];
        self.op("stablehlo.dot_general", &[lhs, rhs], attrs, Ty::new(&shape, lhs.dtype()))
    }
}

/// The terminator `name` (`stablehlo.return`, `func.return`, `sdy.return`) of `values`.
pub fn terminator(name: &str, values: &[Val]) -> Operation {
    Operation {
        result: None,
        name: name.into(),
        operands: values.to_vec(),
        regions: vec![],
        attrs: vec![],
        results: vec![],
    }
}

/// Describes one program argument: a flat device buffer of `len` elements of
/// `dtype`, read through `layout` (a view of it).
#[derive(Debug, Clone)]
pub struct ArgView<'a> {
    pub layout: &'a Layout,
    pub len: usize,
    pub dtype: DType,
}

/// The program of one primitive: arguments are the inputs' flat storages,
/// each read through its view; outputs are flat (their storages), followed by
/// one bool scalar per returned [`Check`].
pub fn exec_module(op: &kiln_tensor::Op, inputs: &[ArgView<'_>], outs: &[Meta]) -> Result<(Module, Vec<Check>)> {
    let arg_tys: Vec<Ty> = inputs.iter().map(|a| Ty::new(&[a.len], a.dtype)).collect();
    let (mut b, args) = Builder::new(&arg_tys);
    let mut vals = Vec::with_capacity(inputs.len());
    for (a, v) in inputs.iter().zip(&args) {
        vals.push(read_view(&mut b, v, a.layout)?);
    }
    let (results, checks) = lower_op(&mut b, op, &vals, outs)?;
    check_results(op, &results, outs)?;
    let mut flat = Vec::with_capacity(results.len() + checks.len());
    for r in &results {
        let n = r.ty.numel();
        flat.push(b.reshape(r, &[n]));
    }
    let kinds = checks.iter().map(|c| c.1.clone()).collect();
    flat.extend(checks.into_iter().map(|c| c.0));
    Ok((b.finish(&flat), kinds))
}

/// Checks that a lowering produced the outputs `Op::infer` promised.
pub fn check_results(op: &kiln_tensor::Op, results: &[Val], outs: &[Meta]) -> Result<()> {
    if results.len() != outs.len() {
        return Err(Error::backend(
            "pjrt",
            format!("lowering of {} produced {} outputs, expected {}", op.name(), results.len(), outs.len()),
        ));
    }
    for (r, m) in results.iter().zip(outs) {
        if r.shape() != &m.shape[..] || r.dtype() != m.dtype {
            return Err(Error::backend(
                "pjrt",
                format!(
                    "lowering of {} produced {:?} {}, expected {:?} {}",
                    op.name(),
                    r.shape(),
                    r.dtype(),
                    m.shape,
                    m.dtype
                ),
            ));
        }
    }
    Ok(())
}

/// A program reading the view `layout` of a flat buffer into a flat contiguous one.
pub fn read_module(layout: &Layout, len: usize, dtype: DType) -> Result<Module> {
    let (mut b, args) = Builder::new(&[Ty::new(&[len], dtype)]);
    let v = read_view(&mut b, &args[0], layout)?;
    let n = v.ty.numel();
    let flat = b.reshape(&v, &[n]);
    Ok(b.finish(&[flat]))
}

/// A program writing `src` (read through `src_layout` from its flat storage)
/// into the positions `dst_layout` views of the flat buffer `dst`; the output
/// is the new flat `dst`. With `same_storage`, `src` reads from `dst` itself
/// (one argument). With `donate`, `dst`'s buffer is donated to the output, so
/// the write happens in place.
pub fn assign_module(
    dst_layout: &Layout,
    dst_len: usize,
    src: ArgView<'_>,
    same_storage: bool,
    donate: bool,
) -> Result<Module> {
    let mut tys = vec![Ty::new(&[dst_len], src.dtype)];
    if !same_storage {
        tys.push(Ty::new(&[src.len], src.dtype));
    }
    let (mut b, args) = Builder::new(&tys);
    let s = read_view(&mut b, args.last().expect("an argument"), src.layout)?;
    let out = write_view(&mut b, &args[0], dst_layout, &s)?;
    if donate {
        b.alias(0, 0);
    }
    Ok(b.finish(&[out]))
}

#[cfg(test)]
mod tests;
