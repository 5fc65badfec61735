//! `ModuleField`: what a field of a `#[derive(Module)]` struct can be, and
//! how each kind is walked. The derive hands every field that is not
//! `#[module(skip)]` to this trait, so the field's type, not its spelling in
//! the source, decides whether it is a parameter, a submodule or a list.
use super::{join_name, Module};
use crate::layers::Linear;
use kiln_tensor::{Result, Tensor};

/// A field of a module that `#[derive(Module)]` walks: a [`Tensor`] (a
/// parameter), any [`Module`] (a submodule, its parameters under the
/// field's name), or an `Option`, `Vec` or array of those (`None` holds
/// nothing; items are named by their index, `layers.0`, `layers.1`, as
/// PyTorch's `ModuleList` names them).
///
/// It is implemented for exactly those; a field of any other type must be
/// marked `#[module(skip)]`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is neither a parameter nor a module",
    label = "this field is walked by #[derive(Module)]",
    note = "a derived module's fields are `Tensor`s, `Module`s, or `Option`s, `Vec`s or arrays of them; \
            mark a field that holds no parameters `#[module(skip)]`"
)]
pub trait ModuleField {
    /// Calls `f` for each parameter the field holds, `name` being the field's
    /// full dotted name.
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor));

    /// [`ModuleField::visit_field`] with mutable access; stops at the first error.
    fn visit_field_mut(&mut self, name: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()>;

    /// Passes a training-mode switch on to the modules the field holds.
    fn train_field(&mut self, on: bool) {
        let _ = on;
    }

    /// Whether a module the field holds is in training mode.
    fn field_is_training(&self) -> bool {
        false
    }

    /// Calls `f` for each [`Linear`] the field holds (see [`Module::visit_linears_mut`]).
    fn visit_linears_field_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>,
    ) -> Result<()> {
        let _ = (name, f);
        Ok(())
    }
}

impl ModuleField for Tensor {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(name, self)
    }

    fn visit_field_mut(&mut self, name: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        f(name, self)
    }
}

impl<M: Module> ModuleField for M {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.visit_params(name, f)
    }

    fn visit_field_mut(&mut self, name: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        self.visit_params_mut(name, f)
    }

    fn train_field(&mut self, on: bool) {
        self.train(on)
    }

    fn field_is_training(&self) -> bool {
        self.is_training()
    }

    fn visit_linears_field_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>,
    ) -> Result<()> {
        self.visit_linears_mut(name, f)
    }
}

impl<T: ModuleField> ModuleField for Option<T> {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        if let Some(t) = self {
            t.visit_field(name, f)
        }
    }

    fn visit_field_mut(&mut self, name: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        match self {
            Some(t) => t.visit_field_mut(name, f),
            None => Ok(()),
        }
    }

    fn train_field(&mut self, on: bool) {
        if let Some(t) = self {
            t.train_field(on)
        }
    }

    fn field_is_training(&self) -> bool {
        self.as_ref().is_some_and(|t| t.field_is_training())
    }

    fn visit_linears_field_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>,
    ) -> Result<()> {
        match self {
            Some(t) => t.visit_linears_field_mut(name, f),
            None => Ok(()),
        }
    }
}

/// Lists (`Vec<T>`, `[T; N]`): items named `{name}.{index}`, every item
/// switched, training when one item is.
macro_rules! list_field {
    ([$($generics:tt)*] $list:ty) => {
        impl<$($generics)*> ModuleField for $list {
            fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor)) {
                for (i, t) in self.iter().enumerate() {
                    t.visit_field(&join_name(name, &i.to_string()), f);
                }
            }

            fn visit_field_mut(
                &mut self,
                name: &str,
                f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>,
            ) -> Result<()> {
                for (i, t) in self.iter_mut().enumerate() {
                    t.visit_field_mut(&join_name(name, &i.to_string()), f)?;
                }
                Ok(())
            }

            fn train_field(&mut self, on: bool) {
                self.iter_mut().for_each(|t| t.train_field(on))
            }

            fn field_is_training(&self) -> bool {
                self.iter().any(|t| t.field_is_training())
            }

            fn visit_linears_field_mut(
                &mut self,
                name: &str,
                f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>,
            ) -> Result<()> {
                for (i, t) in self.iter_mut().enumerate() {
                    t.visit_linears_field_mut(&join_name(name, &i.to_string()), f)?;
                }
                Ok(())
            }
        }
    };
}

list_field!([T: ModuleField] Vec<T>);
list_field!([T: ModuleField, const N: usize] [T; N]);
