//! `Program`: typed instructions over [`Op`], the parameters a program reads
//! (by kind) and the results it gives (by kind). See Note \[Programs\] in `ir/mod.rs`.
use crate::{Device, Error, Meta, Op, Result, Tensor};
use smallvec::SmallVec;
use std::fmt;

/// A value of a program: `%n` in its text. Each value is defined once, by a
/// parameter or by one output of one instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(pub(crate) u32);

impl Value {
    /// The value's index in [`Program::meta`]'s numbering.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// What a parameter of a program is: where its value comes from on every run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// The storage of input `usize` of the traced function, flat.
    Input(usize),
    /// A storage that outlives the call (a parameter, `.grad`, optimizer
    /// state), read as it is at each run.
    State,
    /// A generator's state (int64 `[2]`, Note \[Generators\]): state that a
    /// random op reads and writes.
    Generator,
    /// A value fixed when the program was traced (data uploaded inside the
    /// function, or a tensor dropped inside it).
    Constant,
}

/// A parameter: its kind and its value's type.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub kind: ParamKind,
    pub value: Value,
}

/// What a result of a program is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ResultKind {
    /// A value in a storage of its own, new on every run (a returned tensor).
    Fresh,
    /// The new value of parameter `usize` (an index into [`Program::params`]),
    /// written into its storage in place: state read and written, donated.
    Update(usize),
    /// State the function creates without reading it (a `.grad` made on the
    /// first call): written into that storage on every run.
    State,
    /// A device-side check (a bool scalar): false fails the run with the message.
    Check(String),
}

/// One result: a value and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramResult {
    pub value: Value,
    pub kind: ResultKind,
}

/// One instruction: `outs = op(args)`, its outputs numbered from `first`.
#[derive(Debug, Clone, PartialEq)]
pub struct Inst {
    pub op: Op,
    pub args: SmallVec<[Value; 4]>,
    pub outs: SmallVec<[Meta; 2]>,
    /// The value of the first output; output `i` is `first + i`.
    pub first: Value,
}

impl Inst {
    /// The values the instruction defines, in output order.
    pub fn results(&self) -> impl Iterator<Item = Value> + '_ {
        (0..self.outs.len()).map(|i| Value(self.first.0 + i as u32))
    }
    /// Output `i`'s value.
    pub fn result(&self, i: usize) -> Value {
        Value(self.first.0 + i as u32)
    }
}

/// Whether two ops are the same op, attributes compared exactly: `==` on
/// floats misses what the exact text of the attributes tells (a NaN attribute,
/// `fill_(NaN)`, is the same op again; `0.0` and `-0.0` are not). An op unequal
/// to itself holds a NaN.
pub(super) fn same_op(x: &Op, y: &Op) -> bool {
    let nan = !PartialEq::eq(x, x);
    (x == y || nan) && x.name() == y.name() && super::print::attributes(x) == super::print::attributes(y)
}

/// Where a value is defined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Def {
    /// Parameter `usize` (an index into [`Program::params`]).
    Param(usize),
    /// Output `.1` of instruction `.0`.
    Inst(usize, usize),
}

/// A program: parameters, instructions in order (each reads values defined
/// before it), results (Note \[Programs\] in `ir/mod.rs`).
#[derive(Debug, Clone, Default, PartialEq)]
///
/// A program is built only through its verbs ([`Program::add_param`],
/// [`Program::push`], [`Program::add_result`]), each of which refuses a value
/// the program does not define yet, so every value a program holds is defined
/// before it is read and printing or running it never meets an unknown value.
pub struct Program {
    pub(super) params: Vec<Param>,
    pub(super) insts: Vec<Inst>,
    pub(super) results: Vec<ProgramResult>,
    /// Every value's type and definition, by value number.
    values: Vec<(Meta, Def)>,
}

impl Program {
    /// An empty program.
    pub fn new() -> Program {
        Program::default()
    }

    /// The number of values defined so far.
    pub fn num_values(&self) -> usize {
        self.values.len()
    }

    /// The parameters, in argument order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The instructions, in order.
    pub fn insts(&self) -> &[Inst] {
        &self.insts
    }

    /// The results, in order.
    pub fn results(&self) -> &[ProgramResult] {
        &self.results
    }

    /// A value's type.
    ///
    /// # Panics
    /// When `v` is no value of this program (a value of another program): the
    /// values a program hands out are all defined in it.
    pub fn meta(&self, v: Value) -> &Meta {
        &self.values[v.index()].0
    }

    /// Where a value is defined (panics as [`Program::meta`] does).
    pub fn def(&self, v: Value) -> Def {
        self.values[v.index()].1
    }

    /// Changes what parameter `k` is (a recorder classifies storages once the
    /// trace has ended); an error when there is no such parameter.
    pub fn set_param_kind(&mut self, k: usize, kind: ParamKind) -> Result<()> {
        let n = self.params.len();
        let p = self
            .params
            .get_mut(k)
            .ok_or_else(|| Error::invalid("program", format!("parameter {k} does not exist ({n} parameters)")))?;
        p.kind = kind;
        Ok(())
    }

    /// Adds a parameter of `kind` holding a value of type `meta`.
    pub fn add_param(&mut self, kind: ParamKind, meta: Meta) -> Value {
        let v = Value(self.values.len() as u32);
        self.values.push((meta, Def::Param(self.params.len())));
        self.params.push(Param { kind, value: v });
        v
    }

    /// Appends `op` on `args`, typed by [`Op::infer`]; returns its outputs.
    pub fn push(&mut self, op: Op, args: &[Value]) -> Result<SmallVec<[Value; 2]>> {
        let metas: SmallVec<[Meta; 4]> = args.iter().map(|a| self.checked_meta(*a).cloned()).collect::<Result<_>>()?;
        let outs = op.infer(&metas)?;
        self.push_typed(op, args, outs)
    }

    /// Appends `op` on `args` with outputs already typed by [`Op::infer`] (the
    /// recorder's case: `Tensor::apply` inferred them); [`Program::verify`]
    /// checks the types. An argument the program does not define is an error.
    pub fn push_typed(&mut self, op: Op, args: &[Value], outs: SmallVec<[Meta; 2]>) -> Result<SmallVec<[Value; 2]>> {
        for a in args {
            self.checked_meta(*a)?;
        }
        Ok(self.push_defined(op, args, outs))
    }

    /// `push_typed` for operands known to be defined (a pass copying a
    /// program that holds only defined values).
    pub(super) fn push_defined(&mut self, op: Op, args: &[Value], outs: SmallVec<[Meta; 2]>) -> SmallVec<[Value; 2]> {
        let first = Value(self.values.len() as u32);
        let i = self.insts.len();
        for (k, m) in outs.iter().enumerate() {
            self.values.push((m.clone(), Def::Inst(i, k)));
        }
        let inst = Inst { op, args: args.into(), outs, first };
        let results = inst.results().collect();
        self.insts.push(inst);
        results
    }

    /// Declares `value` a result of kind `kind`; an error when the program
    /// does not define `value` or (for an update) has no such parameter.
    pub fn add_result(&mut self, value: Value, kind: ResultKind) -> Result<()> {
        self.checked_meta(value)?;
        if let ResultKind::Update(p) = kind {
            if p >= self.params.len() {
                return Err(Error::invalid("program", format!("an update of parameter {p}, which does not exist")));
            }
        }
        self.results.push(ProgramResult { value, kind });
        Ok(())
    }

    /// A value's type, or an error when the program defines no such value.
    pub(crate) fn checked_meta(&self, v: Value) -> Result<&Meta> {
        self.values
            .get(v.index())
            .map(|(m, _)| m)
            .ok_or_else(|| Error::invalid("program", format!("{v} is not a value of the program")))
    }

    /// The same program with its values renumbered in order of definition
    /// (parameters first, then instructions), so that two programs doing the
    /// same thing print and compare equal however they were built.
    pub fn renumbered(&self) -> Program {
        self.rebuild(|_, _, _| Some(None))
    }

    /// Whether `other` is the same program: equal parameters, results and
    /// instructions, where two custom ops of one name are the same op when
    /// they lower alike ([`CustomOpRef::identity`](crate::custom::CustomOpRef::identity)),
    /// so a function that makes its op anew on every call is still one program.
    pub fn same_as(&self, other: &Program) -> bool {
        if self.params != other.params || self.results != other.results || self.insts.len() != other.insts.len() {
            return false;
        }
        self.insts.iter().zip(&other.insts).all(|(a, b)| {
            if a.args != b.args || a.outs != b.outs || a.first != b.first {
                return false;
            }
            match (&a.op, &b.op) {
                (Op::Custom(x), Op::Custom(y)) if x != y => {
                    let ins: Vec<Meta> = a.args.iter().map(|v| self.meta(*v).clone()).collect();
                    x.name() == y.name()
                        && x.identity(&ins, &a.outs).is_some_and(|k| y.identity(&ins, &b.outs) == Some(k))
                }
                (x, y) => same_op(x, y),
            }
        })
    }

    /// Checks the arguments of a run on `device`: one per parameter, of its type, on the device.
    pub fn check_args(&self, args: &[Tensor], device: Device) -> Result<()> {
        if args.len() != self.params.len() {
            return Err(Error::invalid(
                "program",
                format!("takes {} arguments, got {}", self.params.len(), args.len()),
            ));
        }
        for (p, a) in self.params.iter().zip(args) {
            let m = self.meta(p.value);
            if a.shape() != &m.shape[..] || a.dtype() != m.dtype || a.device() != device {
                return Err(Error::invalid(
                    "program",
                    format!(
                        "argument {} is {:?} {} on {}, the program expects {:?} {} on {device}",
                        p.value,
                        a.shape(),
                        a.dtype(),
                        a.device(),
                        m.shape,
                        m.dtype
                    ),
                ));
            }
        }
        Ok(())
    }

    /// For each value, the index of the last instruction reading it
    /// (`insts.len()` for a result, `None` when nothing reads it).
    pub fn last_uses(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.values.len()];
        for (i, inst) in self.insts.iter().enumerate() {
            for a in &inst.args {
                last[a.index()] = Some(i);
            }
        }
        for r in &self.results {
            last[r.value.index()] = Some(self.insts.len());
        }
        last
    }
}

impl crate::op::region::RegionBody for Program {
    fn text(&self) -> String {
        self.to_string()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
