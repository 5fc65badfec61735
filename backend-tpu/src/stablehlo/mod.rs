//! StableHLO modules as data (Note [StableHLO modules]): values, operations,
//! regions, attributes and types as Rust values, built by the lowering's
//! [`Builder`](crate::lower::Builder), printed for the plugin (`print.rs`) and
//! serialized to VHLO bytecode (`crate::portable`) from the same tree.
mod print;
pub mod sharding;

use kiln_tensor::{DType, DeviceMesh};
pub use sharding::Sharding;

// Note [StableHLO modules]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The lowering builds a `Module`: functions whose bodies are `Region`s of
// `Operation`s; an operation names its dialect op (`stablehlo.add`), reads
// `Val`s (a `Name` and a `Ty`), holds nested regions (a reduction's body, a
// loop's condition, a local region) and typed `Attr`s, and defines results.
// Nothing is ever read back from text: the plugin gets the module printed in
// MLIR's generic op form (`Display`, one stable form, so equal modules print
// equal text: the executable cache keys on it), the portable artifact is
// written from the tree (each `Attr` knows its VHLO form), queries such as
// "which op defines this value" look at the tree, and a local region's body
// is moved into its `sdy.manual_computation` by renaming its `Name`s.
//
// The one exception is what a custom op writes itself (Note [Custom ops]): a
// `Lowering::Function` body is MLIR text of the op's own, kept as
// `Func::Custom` and printed as given, and a custom call's `backend_config`
// other than a plain string is `Attr::Text`; neither has a portable form.

/// A tensor type: shape and dtype.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ty {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl Ty {
    pub fn new(shape: &[usize], dtype: DType) -> Ty {
        Ty { shape: shape.to_vec(), dtype }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// `tensor<2x3xf32>`.
    pub fn mlir(&self) -> String {
        kiln_tensor::custom::mlir_type(&self.shape, self.dtype)
    }
    pub fn with_dtype(&self, dtype: DType) -> Ty {
        Ty { shape: self.shape.clone(), dtype }
    }
}

/// The namespace of a value's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKind {
    /// `%vN`: an op's result or a region's argument.
    Value,
    /// `%aN`: an argument of a function.
    Arg,
    /// `%lvN`, `%laN`: a value or argument of a local region's body, moved
    /// into the program's `sdy.manual_computation` ([`Name::local`]).
    LocalValue,
    LocalArg,
    /// `%lbN`: a block argument of a local region (one device's block).
    LocalBlock,
    /// `%uN`: result `N` of `@main` declared unreduced before it returns.
    Unreduced,
}

/// A value's name: `%v3`, or `%v3#1` for result 1 of a multi-result op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Name {
    pub kind: NameKind,
    pub n: u32,
    pub part: Option<u32>,
}

impl Name {
    pub fn new(kind: NameKind, n: usize) -> Name {
        Name { kind, n: n as u32, part: None }
    }
    /// Result `i` of the multi-result op whose results are named `self`.
    pub fn part(self, i: usize) -> Name {
        Name { part: Some(i as u32), ..self }
    }
    /// The op result this name is part of (`%v3` for `%v3#1`).
    pub fn base(self) -> Name {
        Name { part: None, ..self }
    }
    /// The name in a local region's namespace (`%v3` is `%lv3`, `%a0` is `%la0`).
    pub fn local(self) -> Name {
        let kind = match self.kind {
            NameKind::Value => NameKind::LocalValue,
            NameKind::Arg => NameKind::LocalArg,
            k @ (NameKind::LocalValue | NameKind::LocalArg | NameKind::LocalBlock | NameKind::Unreduced) => k,
        };
        Name { kind, ..self }
    }
}

/// An SSA value and its type.
#[derive(Debug, Clone, PartialEq)]
pub struct Val {
    pub name: Name,
    pub ty: Ty,
}

impl Val {
    pub fn shape(&self) -> &[usize] {
        &self.ty.shape
    }
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }
    fn local(&self) -> Val {
        Val { name: self.name.local(), ty: self.ty.clone() }
    }
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    /// `true`.
    Bool(bool),
    /// `3 : i64` (the integer and its type, `i32` or `i64`).
    Int(i64, &'static str),
    /// `"text"` (no `"` or `\` inside).
    Str(String),
    /// `array<i64: 1, 2>`.
    I64s(Vec<i64>),
    /// A scalar `dense<LITERAL> : tensor<..>` (a constant's value; the literal
    /// as `lower::literal` writes it).
    Scalar { literal: String, ty: Ty },
    /// `dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>`: rows of `width` integers.
    IntRows { rows: Vec<Vec<i64>>, width: usize },
    /// `#stablehlo<kind VALUE>` (`comparison_direction`, `precision`, ...).
    Enum { kind: &'static str, value: String },
    /// `[a, b]`.
    Array(Vec<Attr>),
    /// `#stablehlo.dot<..>`: dimension numbers of `dot_general`.
    Dot { lhs_batch: Vec<i64>, rhs_batch: Vec<i64>, lhs_contract: Vec<i64>, rhs_contract: Vec<i64> },
    /// `#stablehlo.gather<..>`.
    Gather {
        offset_dims: Vec<i64>,
        collapsed_slice_dims: Vec<i64>,
        /// Dimensions of the operand that pair with `start_indices_batching_dims`
        /// of the indices, element for element (empty: none).
        operand_batching_dims: Vec<i64>,
        start_indices_batching_dims: Vec<i64>,
        start_index_map: Vec<i64>,
        index_vector_dim: i64,
    },
    /// `#stablehlo.scatter<..>`.
    Scatter {
        update_window_dims: Vec<i64>,
        inserted_window_dims: Vec<i64>,
        scatter_dims_to_operand_dims: Vec<i64>,
        index_vector_dim: i64,
    },
    /// `#stablehlo.channel_handle<handle = 1, type = 1>`.
    Channel { handle: i64, kind: i64 },
    /// A unit attribute: its name alone (`use_global_device_ids`).
    Unit,
    /// `@symbol`.
    Symbol(String),
    /// `#sdy.sharding<..>`.
    Sharding(Sharding),
    /// `#sdy.sharding_per_value<[..]>`.
    ShardingPerValue(Vec<Sharding>),
    /// `#sdy<manual_axes{"x", "y"}>`.
    ManualAxes(Vec<String>),
    /// MLIR text a custom op wrote (a `backend_config` dictionary), printed as given.
    Text(String),
}

/// `name = value` pairs, in the order they print.
pub type Attrs = Vec<(&'static str, Attr)>;

/// One operation: `results = "name"(operands) (regions) {attrs} : (operand
/// types) -> result types`. A terminator (`stablehlo.return`) has no results.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation {
    /// The name its results carry (`%v3`, results `%v3#i` when several).
    pub result: Option<Name>,
    pub name: String,
    pub operands: Vec<Val>,
    pub regions: Vec<Region>,
    pub attrs: Attrs,
    pub results: Vec<Ty>,
}

impl Operation {
    /// The values the operation defines.
    pub fn values(&self) -> Vec<Val> {
        match self.result {
            None => vec![],
            Some(r) if self.results.len() == 1 => vec![Val { name: r, ty: self.results[0].clone() }],
            Some(r) => self.results.iter().enumerate().map(|(i, t)| Val { name: r.part(i), ty: t.clone() }).collect(),
        }
    }

    /// The operation with every name in a local region's namespace.
    fn local(&self) -> Operation {
        Operation {
            result: self.result.map(Name::local),
            name: self.name.clone(),
            operands: self.operands.iter().map(Val::local).collect(),
            regions: self.regions.iter().map(Region::local).collect(),
            attrs: self.attrs.clone(),
            results: self.results.clone(),
        }
    }
}

/// A region of one block: its arguments and its operations, the last one
/// its terminator.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Region {
    pub args: Vec<Val>,
    pub ops: Vec<Operation>,
}

impl Region {
    /// The region with every name in a local region's namespace.
    pub fn local(&self) -> Region {
        Region {
            args: self.args.iter().map(Val::local).collect(),
            ops: self.ops.iter().map(Operation::local).collect(),
        }
    }
}

/// A function argument or result: its type and attributes
/// (`tf.aliasing_output`, `sdy.sharding`).
#[derive(Debug, Clone, PartialEq)]
pub struct Port {
    pub ty: Ty,
    pub attrs: Attrs,
}

/// A function of the module.
#[derive(Debug, Clone, PartialEq)]
pub enum Func {
    /// A function kiln built: its body's arguments are the function's
    /// (with `args`' attributes), its last operation `func.return`.
    Built { name: String, public: bool, args: Vec<Port>, results: Vec<Port>, body: Region },
    /// A custom op's function (Note [Custom ops]): its signature, and its body
    /// as the op wrote it, reading `%arg0`, `%arg1`, ...
    Custom { name: String, args: Vec<Ty>, results: Vec<Ty>, body: String },
}

impl Func {
    pub fn name(&self) -> &str {
        match self {
            Func::Built { name, .. } | Func::Custom { name, .. } => name,
        }
    }
}

/// A module: `@main` and the private functions it calls, over one device or a mesh.
#[derive(Debug, Clone, PartialEq)]
pub struct Module {
    /// The devices the program is partitioned over (1 for one device).
    pub partitions: usize,
    /// The mesh the module declares (`sdy.mesh @mesh`), for a program over a mesh.
    pub mesh: Option<DeviceMesh>,
    pub funcs: Vec<Func>,
}

impl Module {
    /// The module as the plugin reads it (Note [StableHLO modules]).
    pub fn text(&self) -> String {
        self.to_string()
    }
}
