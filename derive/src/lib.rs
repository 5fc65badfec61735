//! kiln's derive macros. `#[derive(Module)]` writes a struct's
//! `kiln::nn::Module` impl (its parameter visitors and its training-mode
//! walk) from its fields; it is re-exported as `kiln::nn::Module`, beside the
//! trait, and documented there.
//!
//! The macro does not look at field types to decide what a field is: every
//! field that is not `#[module(skip)]` is handed to the `ModuleField` trait
//! (a `Tensor` is a parameter, a `Module` is a submodule, and `Option`, `Vec`
//! and arrays of those are walked), so a type alias or a full path works as
//! well as the bare name, and a field that holds no parameters is a compile
//! error until it is marked `skip`.
use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{parse_macro_input, Data, DeriveInput, Fields, LitStr, Path};

/// Derives `kiln::nn::Module` from a struct's fields; see the trait's
/// documentation for the attributes.
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input).unwrap_or_else(|e| e.to_compile_error()).into()
}

/// The struct-level attributes.
struct StructAttrs {
    /// Where `kiln::nn` is (`#[module(crate = "...")]`): `kiln_nn` for a
    /// crate that depends on it directly, `crate` inside kiln-nn.
    krate: Path,
    /// The method `set_mixed_precision_policy` calls
    /// (`#[module(mixed_precision = "...")]`), for a module whose forward
    /// applies a policy it holds.
    mixed_precision: Option<Path>,
}

/// One field to visit.
struct FieldSpec {
    /// How the field is reached from `self` (`name` or `0`).
    member: syn::Member,
    /// Its parameter-name segment: the field's name, its `rename`, or its index.
    name: String,
    ty: syn::Type,
    span: Span,
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let attrs = struct_attrs(input)?;
    let fields = match &input.data {
        Data::Struct(s) => &s.fields,
        Data::Enum(e) => {
            return Err(syn::Error::new(e.enum_token.span, "#[derive(Module)] is for structs, not enums"));
        }
        Data::Union(u) => {
            return Err(syn::Error::new(u.union_token.span, "#[derive(Module)] is for structs, not unions"));
        }
    };
    let specs = field_specs(fields)?;
    let krate = &attrs.krate;
    let p = quote!(#krate::module::__derive);

    let visits = specs.iter().map(|s| {
        let (m, n) = (&s.member, &s.name);
        quote_spanned!(s.span=> #p::ModuleField::visit_field(&self.#m, &#p::join_name(prefix, #n), f);)
    });
    let visits_mut = specs.iter().map(|s| {
        let (m, n) = (&s.member, &s.name);
        quote_spanned!(s.span=> #p::ModuleField::visit_field_mut(&mut self.#m, &#p::join_name(prefix, #n), f)?;)
    });
    let linears = specs.iter().map(|s| {
        let (m, n) = (&s.member, &s.name);
        quote_spanned!(s.span=> #p::ModuleField::visit_linears_field_mut(&mut self.#m, &#p::join_name(prefix, #n), f)?;)
    });
    let trains = specs.iter().map(|s| {
        let m = &s.member;
        quote_spanned!(s.span=> #p::ModuleField::train_field(&mut self.#m, on);)
    });
    let trainings = specs.iter().map(|s| {
        let m = &s.member;
        quote_spanned!(s.span=> || #p::ModuleField::field_is_training(&self.#m))
    });
    let mixed = attrs.mixed_precision.as_ref().map(|method| {
        quote! {
            fn set_mixed_precision_policy(
                &mut self,
                policy: ::core::option::Option<#krate::precision::MixedPrecisionPolicy>,
            ) -> #p::Result<()> {
                #method(self, policy)
            }
        }
    });

    // A generic struct gets a bound per visited field type, so that
    // `struct Stack<M> { layers: Vec<M> }` is a module whenever `M` is.
    let mut generics = input.generics.clone();
    if generics.type_params().next().is_some() {
        let wc = generics.make_where_clause();
        for s in &specs {
            let ty = &s.ty;
            wc.predicates.push(syn::parse_quote_spanned!(s.span=> #ty: #p::ModuleField));
        }
    }
    let (impl_g, ty_g, where_c) = generics.split_for_impl();
    let ident = &input.ident;
    Ok(quote! {
        #[automatically_derived]
        impl #impl_g #krate::module::Module for #ident #ty_g #where_c {
            #[allow(unused_variables)]
            fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &#p::Tensor)) {
                #(#visits)*
            }

            #[allow(unused_variables)]
            fn visit_params_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut #p::Tensor) -> #p::Result<()>,
            ) -> #p::Result<()> {
                #(#visits_mut)*
                ::core::result::Result::Ok(())
            }

            #[allow(unused_variables)]
            fn visit_linears_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut #p::Linear) -> #p::Result<()>,
            ) -> #p::Result<()> {
                #(#linears)*
                ::core::result::Result::Ok(())
            }

            #[allow(unused_variables)]
            fn train(&mut self, on: bool) {
                #(#trains)*
            }

            fn is_training(&self) -> bool {
                false #(#trainings)*
            }

            #mixed
        }
    })
}

/// Reads `#[module(crate = "...", mixed_precision = "...")]` on the struct.
fn struct_attrs(input: &DeriveInput) -> syn::Result<StructAttrs> {
    let mut out = StructAttrs { krate: syn::parse_quote!(::kiln::nn), mixed_precision: None };
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                out.krate = path_value(&meta)?;
            } else if meta.path.is_ident("mixed_precision") {
                out.mixed_precision = Some(path_value(&meta)?);
            } else if meta.path.is_ident("skip") || meta.path.is_ident("rename") {
                return Err(meta.error("`skip` and `rename` go on fields, not on the struct"));
            } else {
                return Err(
                    meta.error("unknown #[module] attribute on a struct: expected `crate` or `mixed_precision`")
                );
            }
            Ok(())
        })?;
    }
    Ok(out)
}

/// A path given as a string (`crate = "kiln_nn"`, as serde takes it).
fn path_value(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<Path> {
    let s: LitStr = meta.value()?.parse()?;
    s.parse::<Path>().map_err(|e| syn::Error::new(s.span(), format!("expected a path: {e}")))
}

/// The fields to visit, in declaration order, with their names; refuses
/// unknown attributes, `rename` with `skip`, and two fields with one name.
fn field_specs(fields: &Fields) -> syn::Result<Vec<FieldSpec>> {
    let mut out: Vec<FieldSpec> = vec![];
    for (i, field) in fields.iter().enumerate() {
        let (mut skip, mut rename) = (false, None::<LitStr>);
        for attr in field.attrs.iter().filter(|a| a.path().is_ident("module")) {
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("skip") {
                    skip = true;
                } else if meta.path.is_ident("rename") {
                    let s: LitStr = meta.value()?.parse()?;
                    if s.value().is_empty() || s.value().split('.').any(str::is_empty) {
                        return Err(syn::Error::new(
                            s.span(),
                            "a renamed field needs a name with no empty dot-separated part",
                        ));
                    }
                    rename = Some(s);
                } else {
                    return Err(meta.error("unknown #[module] attribute on a field: expected `skip` or `rename`"));
                }
                Ok(())
            })?;
        }
        if skip {
            if let Some(r) = rename {
                return Err(syn::Error::new(r.span(), "a field cannot be both `skip` and `rename`d"));
            }
            continue;
        }
        let member = match &field.ident {
            Some(id) => syn::Member::Named(id.clone()),
            None => syn::Member::Unnamed(syn::Index { index: i as u32, span: field.span() }),
        };
        let name = match (&rename, &field.ident) {
            (Some(r), _) => r.value(),
            (None, Some(id)) => id.to_string().trim_start_matches("r#").to_string(),
            (None, None) => i.to_string(),
        };
        if let Some(prev) = out.iter().find(|s| s.name == name) {
            let what = format!("two fields have the parameter name `{name}`");
            let mut e = syn::Error::new(field.span(), &what);
            e.combine(syn::Error::new(prev.span, what));
            return Err(e);
        }
        out.push(FieldSpec { member, name, ty: field.ty.clone(), span: field.span() });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(src: &str) -> String {
        let input: DeriveInput = syn::parse_str(src).unwrap();
        match expand(&input) {
            Ok(t) => panic!("expected an error, got {t}"),
            Err(e) => e.to_string(),
        }
    }

    fn ok(src: &str) -> String {
        let input: DeriveInput = syn::parse_str(src).unwrap();
        expand(&input).unwrap().to_string()
    }

    #[test]
    fn refuses_what_it_cannot_derive() {
        assert!(err("enum E { A }").contains("not enums"));
        assert!(err("union U { a: u32 }").contains("not unions"));
        assert!(err("struct S { #[module(skp)] a: T }").contains("unknown #[module] attribute on a field"));
        assert!(err("#[module(bogus)] struct S { a: T }").contains("unknown #[module] attribute on a struct"));
        assert!(err("#[module(skip)] struct S { a: T }").contains("go on fields"));
        assert!(err("struct S { #[module(skip, rename = \"b\")] a: T }").contains("both `skip` and `rename`"));
        assert!(err("struct S { #[module(rename = \"\")] a: T }").contains("no empty"));
        assert!(err("struct S { #[module(rename = \"x..y\")] a: T }").contains("no empty"));
        assert!(err("struct S { #[module(rename = 3)] a: T }").contains("expected string literal"));
        assert!(err("struct S { a: T, #[module(rename = \"a\")] b: T }").contains("parameter name `a`"));
        assert!(err("#[module(crate = \"not a path\")] struct S { a: T }").contains("expected a path"));
    }

    #[test]
    fn names_and_paths() {
        let s = ok("struct S { #[module(rename = \"model.w\")] w: T, #[module(skip)] eps: f64, r#type: T }");
        assert!(s.contains("\"model.w\"") && s.contains("\"type\"") && !s.contains("eps"), "{s}");
        assert!(s.contains(":: kiln :: nn :: module :: Module for S"), "{s}");
        let s = ok("#[module(crate = \"crate\")] struct P(T, #[module(skip)] usize, U);");
        assert!(s.contains("\"0\"") && s.contains("\"2\"") && !s.contains("\"1\""), "{s}");
        assert!(s.contains("crate :: module :: Module for P"), "{s}");
        let s = ok("struct G<M> { layers: Vec<M>, #[module(skip)] n: usize }");
        assert!(s.contains("Vec < M > : :: kiln :: nn :: module :: __derive :: ModuleField"), "{s}");
        let s = ok("#[module(mixed_precision = \"Self::set_policy\")] struct S { a: T }");
        assert!(s.contains("fn set_mixed_precision_policy") && s.contains("Self :: set_policy (self , policy)"), "{s}");
    }
}
