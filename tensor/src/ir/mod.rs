//! kiln's program representation: a typed, printable [`Program`] of [`Op`]
//! instructions that graph modes share (Note \[Programs\]): the verifier, the
//! text form, passes (DCE, CSE) and the interpreter every backend can run it with.
//!
//! [`Op`]: crate::Op
mod fuse;
mod interp;
mod passes;
mod print;
mod program;
mod verify;

#[cfg(test)]
mod tests;

pub use fuse::{schedule, FusedKernel, Fuser, Group, Step};
pub use interp::{Executable, Interpreter};
pub use print::{attributes, dtype_short, type_text};
pub use program::{Def, Inst, Param, ParamKind, Program, ProgramResult, ResultKind, Value};

// Note [Programs]
// ~~~~~~~~~~~~~~~
// A `Program` is what a traced function becomes: parameters, instructions,
// results. Every value is an immutable array of one dtype and shape (`Meta`),
// defined once; an instruction applies one primitive `Op` to earlier values
// and is typed by `Op::infer`, which `Program::verify` re-runs on each one.
//
// PyTorch's mutation semantics become values. A parameter is the content of
// a whole storage, flat (`f32[n]`): an input's, some state's (a parameter, a
// `.grad`, optimizer state, a generator's state), or a constant fixed when
// traced. Reading a tensor is a view of its storage's current value (`view`
// when it is the whole storage reshaped, else `as_strided`, whose strides and
// offset index the value's row-major elements); an in-place write is
// `copy_` (`Op::Assign`), whose output is the storage's next value. A result
// says where a value goes: `fresh` (a returned tensor, in a storage of its
// own), `updates %p` (the new value of parameter `%p`, written into its
// storage: state read and written, donated by backends that can), `state`
// (state the function created), or `check` (a device-side condition).
//
// Because writes are values, a program is pure: dead-code and
// common-subexpression elimination need no alias analysis, and a backend
// is free to update storages in place where no later instruction reads the
// old value (the interpreter does so for storages it made and parameters it
// updates). `Backend::compile` turns a program into an `Executable`; its
// default is the `Interpreter`, which runs each instruction through
// `Backend::exec` / `Backend::assign`, so any backend runs captured programs
// and gives the numbers its eager ops give.
