//! StableHLO portable artifacts (Note [Portable artifacts]): a one-device
//! program kiln lowered, written as the versioned VHLO dialect in MLIR
//! bytecode, the form `jax.export` keeps programs in and every StableHLO
//! consumer (PJRT plugins, `stablehlo.deserialize_portable_artifact`) reads.
mod bytecode;
mod vhlo;

use crate::stablehlo::Module;

// Note [Portable artifacts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// StableHLO promises compatibility through VHLO, a copy of its ops in which
// every op and attribute carries a version (`vhlo.add_v1`,
// `#vhlo.integer_v1<..>`) and every attribute is spelled out, defaults
// included. A program serialized as VHLO in MLIR bytecode, with the producer
// string `StableHLO_vX.Y.Z`, is read by any StableHLO at least that version
// (upgraded op by op to the reader's current forms) for years afterwards;
// MLIR text of the StableHLO dialect promises nothing across versions.
//
// kiln holds no MLIR library (it would bring the C++ build kiln avoids), so
// it writes the artifact itself, from the module tree its lowering builds
// (Note [StableHLO modules]):
//
// * `vhlo` maps each op to its `_v1` form as StableHLO 1.0.0 defines it (the
//   target version `TARGET`: every op kiln emits for one device has one),
//   writes each typed attribute in VHLO's syntax (dimension lists and the
//   fields of dot, gather and scatter dimension numbers as
//   `#vhlo.tensor_v1<dense<..>>`, enums `#vhlo<kind_v1 VALUE>`, scalars
//   `#vhlo.integer_v1`/`bool_v1`/`string_v1`), adds the defaults
//   `stablehlo-legalize-to-vhlo` adds, and maps types (`tensor<2xf32>` is
//   `!vhlo.tensor_v1<2x!vhlo.f32_v1>`).
// * `bytecode` writes MLIR bytecode version 1 (the version StableHLO's own
//   early targets used; readers accept every version since 0): the structure
//   in the binary encoding, attributes and types in their textual form, which
//   the bytecode format allows for any attribute and every reader parses.
//
// Whatever has no VHLO 1.0.0 form (a custom op's function body, which is MLIR
// text the op wrote; collectives; Shardy shardings and meshes) is refused
// with the reason; the export then keeps the text program only and says why
// in its manifest.

/// The StableHLO version the artifacts target: the oldest that reads them.
pub const TARGET: &str = "1.0.0";

/// The portable artifact of `module`, a one-device program kiln lowered;
/// `Err` says what has no portable form.
pub fn serialize(module: &Module) -> Result<Vec<u8>, String> {
    let (attrs, funcs) = vhlo::module(module)?;
    bytecode::write(&attrs, &funcs, &format!("StableHLO_v{TARGET}"))
}

#[cfg(test)]
mod tests {
    use super::bytecode::varint;
    use super::serialize;
    use crate::lower::{Attr, Builder, Ty};
    use crate::stablehlo::{Func, Module};
    use kiln_tensor::DType;

    fn f32s(n: usize) -> Ty {
        Ty::new(&[n], DType::F32)
    }

    /// A module of one function of a `[4]` float argument returning what `body` computes.
    fn program(body: impl FnOnce(&mut Builder, &crate::lower::Val) -> crate::lower::Val) -> Module {
        let (mut b, a) = Builder::new(&[f32s(4)]);
        let v = body(&mut b, &a[0]);
        b.finish(&[v])
    }

    #[test]
    fn artifacts_start_with_the_magic_version_and_producer() {
        let b = serialize(&program(|b, a| b.add(a, a))).unwrap();
        assert_eq!(&b[..4], b"ML\xefR");
        assert_eq!(b[4], (1 << 1) | 1, "bytecode version 1");
        assert_eq!(&b[5..22], b"StableHLO_v1.0.0\0");
    }

    #[test]
    fn programs_without_a_portable_form_are_refused_with_the_reason() {
        let refused = |m: Module, want: &str| {
            let e = serialize(&m).unwrap_err();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        refused(program(|b, a| b.op("chlo.erf", &[a], vec![], a.ty.clone())), "`chlo.erf` has no portable");
        // A custom op's function is its own MLIR text.
        let mut m = program(|b, a| {
            b.op_n("func.call", &[a], vec![], vec![("callee", Attr::Symbol("f".into()))], std::slice::from_ref(&a.ty))
                .remove(0)
        });
        m.funcs.push(Func::Custom {
            name: "f".into(),
            args: vec![f32s(4)],
            results: vec![f32s(4)],
            body: "  return %arg0 : tensor<4xf32>".into(),
        });
        refused(m, "custom op function @f");
        let call = |config: Attr, version: i64| {
            program(|b, a| {
                let attrs = vec![
                    ("api_version", Attr::Int(version, "i32")),
                    ("call_target_name", Attr::Str("k".into())),
                    ("backend_config", config),
                ];
                b.op("stablehlo.custom_call", &[a], attrs, a.ty.clone())
            })
        };
        serialize(&call(Attr::Str("k=3".into()), 1)).unwrap();
        refused(call(Attr::Text("{n = 3 : i64}".into()), 1), "MLIR text a custom op wrote");
        refused(call(Attr::Str("k".into()), 4), "API version has no VHLO 1.0.0 form");
        refused(call(Attr::Str("a\0b".into()), 1), "NUL character");
        let mut over_two = program(|b, a| b.add(a, a));
        over_two.partitions = 2;
        refused(over_two, "over a mesh");
    }

    fn enc(v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        varint(&mut out, v);
        out
    }

    #[test]
    fn varints_follow_the_prefix_encoding() {
        assert_eq!(enc(0), [0b1]);
        assert_eq!(enc(5), [(5 << 1) | 1]);
        assert_eq!(enc(127), [0xff]);
        // 128 needs two bytes: value << 2 | 0b10, little-endian.
        assert_eq!(enc(128), [0b0000_0010, 0b0000_0010]);
        assert_eq!(enc((1 << 14) - 1), [0xfe, 0xff]);
        assert_eq!(enc(1 << 14), [0b100, 0, 0b10]);
        // 56 value bits in eight bytes, then the nine-byte form.
        assert_eq!(enc((1 << 56) - 1), [0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(u64::MAX), [0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    }
}
