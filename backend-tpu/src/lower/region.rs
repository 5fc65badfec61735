//! A local region (Note [Local regions] in kiln-tensor's `collective.rs`)
//! lowered into a program over a mesh: its body, a `Program` recorded on
//! one device's blocks, becomes the body of one `sdy.manual_computation`
//! whose operands are the region's inputs (and the body's creation values,
//! replicated) and whose results are its outputs, then one flag per
//! device-side check of the body, true when it held on every device. A
//! region run on its own (`local.rs`) and a region inside a program
//! (`Op::LocalMap`, lowered by `lower_into`) are built here alike.
use super::{lower_into, manual_computation, Builder, Check, Constants, Lit, Sharding, Ty, Val};
use kiln_tensor::collective::Collective;
use kiln_tensor::ir::{ParamKind, Program};
use kiln_tensor::{DType, DeviceMesh, Error, Op, Placement, Result};

fn local_err(msg: impl Into<String>) -> Error {
    Error::invalid("local_map", msg)
}

/// Checks one list of placements of a local region's inputs or outputs.
pub fn check_placements(what: &str, i: usize, p: &[Placement]) -> Result<()> {
    if p.iter().any(|p| matches!(p, Placement::Partial(_))) {
        return Err(local_err(format!(
            "{what} {i} is placed {p:?}: a local region takes and gives Shard and Replicate placements (reduce partial sums inside it with all_reduce or reduce_scatter)"
        )));
    }
    Ok(())
}

/// The global shape of blocks of shape `local` laid out with `s`.
pub fn global_shape(local: &[usize], s: &Sharding) -> Vec<usize> {
    local.iter().enumerate().map(|(d, &n)| n * s.splits(d)).collect()
}

/// What feeds an argument of a region's body: input `usize`'s block, or a
/// creation value (bytes of a dtype, Note \[Shared constants\]).
pub enum Operand {
    Block(usize),
    Constant(Vec<u8>, DType),
}

/// A region's body lowered into a function of its own (arguments: the
/// program's parameters, then its creation values), returning the output
/// blocks and then one flag (`[1]`) per device-side check.
pub struct Body {
    builder: Builder,
    /// The kind of each parameter of the body (`Input(i)`: input `i`'s block).
    params: Vec<ParamKind>,
    constants: Vec<(Vec<u8>, DType)>,
    outs: Vec<Val>,
    checks: Vec<(Check, &'static str)>,
    n_outs: usize,
    /// The outputs' placements, then every check flag's (split over every axis).
    placements: Vec<Vec<Placement>>,
    /// The bytes one device sends to the others through the body's `all_to_all`s.
    pub all_to_all_bytes: u64,
}

/// The error for a body that reads what is not one of the region's inputs.
pub const OUTSIDE: &str =
    "the function read a tensor that is not one of its inputs (made outside it): pass it among the inputs, with its placements";

impl Body {
    /// Lowers `program` (recorded on one device's blocks) as the body of a
    /// region over `mesh` whose outputs are placed with `out_placements`.
    pub fn new(program: &Program, mesh: &DeviceMesh, out_placements: &[Vec<Placement>]) -> Result<Body> {
        let mut builder = Builder::new(&[]).0;
        let lowered = lower_into(&mut builder, program, Constants::Arguments, None)?;
        let mut outs = lowered.results;
        // Each device's checks come out as one flag per device (every axis splits them).
        let checks: Vec<(Check, &'static str)> = lowered.checks.iter().map(|(_, c, name)| (c.clone(), *name)).collect();
        let n_outs = outs.len();
        for (v, ..) in &lowered.checks {
            outs.push(builder.reshape(v, &[1]));
        }
        let mut placements = out_placements.to_vec();
        placements.extend(checks.iter().map(|_| vec![Placement::Shard(0); mesh.ndim()]));
        Ok(Body {
            builder,
            all_to_all_bytes: all_to_all_bytes(program),
            params: program.params().iter().map(|p| p.kind.clone()).collect(),
            constants: lowered.constants,
            outs,
            checks,
            n_outs,
            placements,
        })
    }

    /// What feeds each argument of the body: a parameter is an input's
    /// block (anything else was made outside the function), then the
    /// creation values.
    pub fn operands(&self) -> Result<Vec<Operand>> {
        let mut ops = vec![];
        for kind in &self.params {
            match kind {
                ParamKind::Input(i) => ops.push(Operand::Block(*i)),
                _ => return Err(local_err(OUTSIDE)),
            }
        }
        ops.extend(self.constants.iter().map(|(b, dt)| Operand::Constant(b.clone(), *dt)));
        Ok(ops)
    }

    /// The output blocks' types (each device's), before the check flags.
    pub fn out_blocks(&self) -> impl Iterator<Item = &Val> {
        self.outs[..self.n_outs].iter()
    }

    /// Emits the region into `b` on `operands` (the body's arguments as
    /// global values, each entering with its sharding in `in_shardings`):
    /// the outputs (global values) with their shardings, and each check's
    /// flag, true when it held on every device.
    #[allow(clippy::type_complexity)]
    pub fn emit(
        self,
        b: &mut Builder,
        mesh: &DeviceMesh,
        operands: &[Val],
        in_shardings: &[Sharding],
    ) -> Result<(Vec<Val>, Vec<Sharding>, Vec<(Val, Check, &'static str)>)> {
        let mut shardings = vec![];
        let mut tys = vec![];
        for (i, (v, p)) in self.outs.iter().zip(&self.placements).enumerate() {
            check_placements("output", i, p)?;
            let s = Sharding::from_placements(mesh, p, v.ty.rank())?;
            tys.push(Ty::new(&global_shape(v.shape(), &s), v.dtype()));
            shardings.push(s);
        }
        let refs: Vec<&Val> = operands.iter().collect();
        let Body { builder, outs: body_outs, checks, n_outs, .. } = self;
        let mut outs = manual_computation(b, &refs, in_shardings, builder, &body_outs, &shardings, &tys)?;
        let flags = outs.split_off(n_outs);
        shardings.truncate(n_outs);
        let checks = flags
            .iter()
            .zip(checks)
            .map(|(flags, (c, name))| (b.reduce(flags, Lit::B(true), &[0], "and"), c, name))
            .collect();
        Ok((outs, shardings, checks))
    }
}

/// The bytes one device sends to the others through `p`'s `all_to_all`s
/// (each keeps one of its block's `n` pieces and sends the others).
fn all_to_all_bytes(p: &Program) -> u64 {
    p.insts()
        .iter()
        .filter_map(|inst| match &inst.op {
            Op::Collective(c) if matches!(c.kind, Collective::AllToAll { .. }) => {
                let m = p.meta(inst.args[0]);
                let block = (m.shape.iter().product::<usize>() * m.dtype.size_in_bytes()) as u64;
                let n = c.group_size() as u64;
                Some(block / n.max(1) * n.saturating_sub(1))
            }
            _ => None,
        })
        .sum()
}
