//! StableHLO portable artifacts (Note [Portable artifacts]): a one-device
//! program kiln lowered, written as the versioned VHLO dialect in MLIR
//! bytecode, the form `jax.export` keeps programs in and every StableHLO
//! consumer (PJRT plugins, `stablehlo.deserialize_portable_artifact`) reads.
mod bytecode;
mod parse;
mod vhlo;

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
// it writes the artifact itself, from the text its lowering emits:
//
// * `parse` reads that text: a module of `func.func`s whose bodies are in the
//   generic op form, attributes and types kept as text.
// * `vhlo` maps each op to its `_v1` form as StableHLO 1.0.0 defines it (the
//   target version `TARGET`: every op kiln emits for one device has one),
//   converts each attribute by its syntax (`array<i64: ..>` and the fields of
//   `#stablehlo.dot<..>`/`gather`/`scatter` become `#vhlo.tensor_v1<dense<..>>`,
//   enums `#vhlo<kind_v1 VALUE>`, scalars `#vhlo.integer_v1`/`bool_v1`/
//   `string_v1`), adds the defaults `stablehlo-legalize-to-vhlo` adds, and
//   maps types (`tensor<2xf32>` is `!vhlo.tensor_v1<2x!vhlo.f32_v1>`).
// * `bytecode` writes MLIR bytecode version 1 (the version StableHLO's own
//   early targets used; readers accept every version since 0): the structure
//   in the binary encoding, attributes and types in their textual form, which
//   the bytecode format allows for any attribute and every reader parses.
//
// Whatever has no VHLO 1.0.0 form (a custom op's function body written in a
// dialect's pretty syntax, batching dimensions of gathers, newer element
// types, sharding) is refused with the reason; the export then keeps the
// text program only and says why in its manifest.

/// The StableHLO version the artifacts target: the oldest that reads them.
pub const TARGET: &str = "1.0.0";

/// The portable artifact of `module`, a one-device program as kiln's lowering
/// writes it; `Err` says what has no portable form.
pub fn serialize(module: &str) -> Result<Vec<u8>, String> {
    // Attributes and types are written null-terminated.
    if module.contains('\0') {
        return Err("the program text holds a NUL character".into());
    }
    let m = parse::module(module)?;
    let funcs = vhlo::module(&m)?;
    bytecode::write(&m.attrs, &funcs, &format!("StableHLO_v{TARGET}"))
}

#[cfg(test)]
mod tests {
    use super::bytecode::varint;
    use super::serialize;

    /// A module of one function returning `ty` computed by `body`.
    fn program(ty: &str, body: &str) -> String {
        format!(
            "module @kiln attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{\n  func.func public @main(%a0: {ty}) -> ({ty}) {{\n{body}\n    \"func.return\"(%v1) : ({ty}) -> ()\n  }}\n}}\n"
        )
    }

    #[test]
    fn artifacts_start_with_the_magic_version_and_producer() {
        let text = program(
            "tensor<4xf32>",
            r#"    %v1 = "stablehlo.add"(%a0, %a0) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>"#,
        );
        let b = serialize(&text).unwrap();
        assert_eq!(&b[..4], b"ML\xefR");
        assert_eq!(b[4], (1 << 1) | 1, "bytecode version 1");
        assert_eq!(&b[5..22], b"StableHLO_v1.0.0\0");
    }

    #[test]
    fn programs_without_a_portable_form_are_refused_with_the_reason() {
        let refused = |ty: &str, body: &str, want: &str| {
            let e = serialize(&program(ty, body)).unwrap_err();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        let t = "tensor<4xf32>";
        refused(t, "    %v1 = stablehlo.add %a0, %a0 : tensor<4xf32>", "generic form");
        refused(t, r#"    %v1 = "chlo.erf"(%a0) : (tensor<4xf32>) -> tensor<4xf32>"#, "`chlo.erf` has no portable");
        refused(
            t,
            r#"    %v1 = "stablehlo.add"(%a0, %a0) {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}]>]>} : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>"#,
            "attribute sdy.sharding",
        );
        refused(
            "tensor<?xf32>",
            r#"    %v1 = "stablehlo.abs"(%a0) : (tensor<?xf32>) -> tensor<?xf32>"#,
            "static shapes",
        );
        refused(
            "tensor<4xf8E4M3>",
            r#"    %v1 = "stablehlo.abs"(%a0) : (tensor<4xf8E4M3>) -> tensor<4xf8E4M3>"#,
            "f8E4M3 has no VHLO 1.0.0 form",
        );
        refused(
            "tensor<2x4xf32>",
            r#"    %i = "stablehlo.constant"() {value = dense<0> : tensor<2x1xi64>} : () -> tensor<2x1xi64>
    %v1 = "stablehlo.gather"(%a0, %i) {dimension_numbers = #stablehlo.gather<offset_dims = [1], operand_batching_dims = [0], start_indices_batching_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, 4>} : (tensor<2x4xf32>, tensor<2x1xi64>) -> tensor<2x4xf32>"#,
            "batching dimensions",
        );
        // A field the conversion does not know is refused, not dropped.
        refused(
            "tensor<4x4xf32>",
            r#"    %v1 = "stablehlo.dot_general"(%a0, %a0) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0], lhs_ragged_dimensions = [0]>} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>"#,
            "field lhs_ragged_dimensions",
        );
        refused(
            t,
            r#"    %v1 = "stablehlo.add"(%a0, %nope) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>"#,
            "%nope",
        );
        refused(
            t,
            r#"    %v1 = "stablehlo.abs"(%a0) : (tensor<4xf32>) -> tensor<4xf32>
    %v1 = "stablehlo.negate"(%a0) : (tensor<4xf32>) -> tensor<4xf32>"#,
            "%v1 is defined twice",
        );
        refused(
            t,
            r#"    %v1:99999999999999 = "stablehlo.abs"(%a0) : (tensor<4xf32>) -> tensor<4xf32>"#,
            "result count",
        );
        // Regions nested past the bound: an error, not a stack overflow.
        let open = r#""stablehlo.while"() ({ "#.repeat(100_000);
        refused(t, &format!("    %v1 = {open}"), "nested at most 64 deep");
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
