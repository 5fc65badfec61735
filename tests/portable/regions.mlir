module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a0: tensor<2x8xf32>, %a1: tensor<2x8xi32>, %a2: tensor<2xui64>, %a3: tensor<3x1xi64>) -> (tensor<2x8xf32>, tensor<2x8xi32>, tensor<i64>, tensor<2x8xf32>, tensor<3x9xf32>, tensor<2xui64>, tensor<2x8xui32>, tensor<2x8xi32>, tensor<2x8xf32>, tensor<2x4xf32>, tensor<2x3xf32>, tensor<3x8xf32>, tensor<2x8xf32>, tensor<2x8xf16>, tensor<2x8xbf16>, tensor<2x8xi8>, tensor<2x8xui32>, tensor<2x8xf8E4M3FN>, tensor<2x8xf8E5M2>, tensor<4x2xi32>, tensor<f32>, tensor<2x8xf32>) {
    %v1:2 = "stablehlo.sort"(%a0, %a1) ({
    ^bb0(%p0: tensor<f32>, %p1: tensor<f32>, %p2: tensor<i32>, %p3: tensor<i32>):
      %c = "stablehlo.compare"(%p0, %p1) {comparison_direction = #stablehlo<comparison_direction GT>} : (tensor<f32>, tensor<f32>) -> tensor<i1>
      "stablehlo.return"(%c) : (tensor<i1>) -> ()
    }) {dimension = 1 : i64, is_stable = true} : (tensor<2x8xf32>, tensor<2x8xi32>) -> (tensor<2x8xf32>, tensor<2x8xi32>)
    %v2 = "stablehlo.constant"() {value = dense<0> : tensor<i64>} : () -> tensor<i64>
    %v3:2 = "stablehlo.while"(%v2, %a0) ({
    ^bb0(%n: tensor<i64>, %acc: tensor<2x8xf32>):
      %lim = "stablehlo.constant"() {value = dense<3> : tensor<i64>} : () -> tensor<i64>
      %lt = "stablehlo.compare"(%n, %lim) {comparison_direction = #stablehlo<comparison_direction LT>, compare_type = #stablehlo<comparison_type SIGNED>} : (tensor<i64>, tensor<i64>) -> tensor<i1>
      "stablehlo.return"(%lt) : (tensor<i1>) -> ()
    }, {
    ^bb0(%m: tensor<i64>, %acc2: tensor<2x8xf32>):
      %one = "stablehlo.constant"() {value = dense<1> : tensor<i64>} : () -> tensor<i64>
      %m1 = "stablehlo.add"(%m, %one) : (tensor<i64>, tensor<i64>) -> tensor<i64>
      %acc3 = "stablehlo.multiply"(%acc2, %a0) : (tensor<2x8xf32>, tensor<2x8xf32>) -> tensor<2x8xf32>
      "stablehlo.return"(%m1, %acc3) : (tensor<i64>, tensor<2x8xf32>) -> ()
    }) : (tensor<i64>, tensor<2x8xf32>) -> (tensor<i64>, tensor<2x8xf32>)
    %v4 = "stablehlo.constant"() {value = dense<0.000000e+00> : tensor<f32>} : () -> tensor<f32>
    %v5 = "stablehlo.pad"(%a0, %v4) {edge_padding_low = array<i64: 0, 1>, edge_padding_high = array<i64: 1, 0>, interior_padding = array<i64: 0, 0>} : (tensor<2x8xf32>, tensor<f32>) -> tensor<3x9xf32>
    %v6:2 = "stablehlo.rng_bit_generator"(%a2) {rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>} : (tensor<2xui64>) -> (tensor<2xui64>, tensor<2x8xui32>)
    %v7 = "stablehlo.bitcast_convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xi32>
    %v8 = "stablehlo.constant"() {value = dense<-1.500000e+00> : tensor<f32>} : () -> tensor<f32>
    %v9 = "stablehlo.constant"() {value = dense<0x7F800000> : tensor<f32>} : () -> tensor<f32>
    %v10 = "stablehlo.clamp"(%v8, %a0, %v9) : (tensor<f32>, tensor<2x8xf32>, tensor<f32>) -> tensor<2x8xf32>
    %v11 = "stablehlo.reduce_window"(%a0, %v4) ({
    ^bb0(%r0: tensor<f32>, %r1: tensor<f32>):
      %s = "stablehlo.add"(%r0, %r1) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%s) : (tensor<f32>) -> ()
    }) {window_dimensions = array<i64: 1, 3>, window_strides = array<i64: 1, 2>, padding = dense<[[0, 0], [1, 1]]> : tensor<2x2xi64>} : (tensor<2x8xf32>, tensor<f32>) -> tensor<2x4xf32>
    %v12 = "stablehlo.slice"(%a0) {start_indices = array<i64: 0, 0>, limit_indices = array<i64: 2, 8>, strides = array<i64: 1, 1>} : (tensor<2x8xf32>) -> tensor<2x8xf32>
    %v13 = "stablehlo.transpose"(%v12) {permutation = array<i64: 1, 0>} : (tensor<2x8xf32>) -> tensor<8x2xf32>
    %v14 = "stablehlo.slice"(%v13) {start_indices = array<i64: 0, 0>, limit_indices = array<i64: 8, 2>, strides = array<i64: 1, 1>} : (tensor<8x2xf32>) -> tensor<8x2xf32>
    %v15 = "stablehlo.dot_general"(%a0, %v14) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<2x8xf32>, tensor<8x2xf32>) -> tensor<2x2xf32>
    %v16 = "stablehlo.concatenate"(%v15, %v15, %v15) {dimension = 1 : i64} : (tensor<2x2xf32>, tensor<2x2xf32>, tensor<2x2xf32>) -> tensor<2x6xf32>
    %v17 = "stablehlo.slice"(%v16) {start_indices = array<i64: 0, 0>, limit_indices = array<i64: 2, 3>, strides = array<i64: 1, 1>} : (tensor<2x6xf32>) -> tensor<2x3xf32>
    %v18 = "stablehlo.gather"(%a0, %a3) {dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, 8>} : (tensor<2x8xf32>, tensor<3x1xi64>) -> tensor<3x8xf32>
    %v19 = "stablehlo.scatter"(%a0, %a3, %v18) ({
    ^bb0(%u0: tensor<f32>, %u1: tensor<f32>):
      %u2 = "stablehlo.add"(%u0, %u1) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%u2) : (tensor<f32>) -> ()
    }) {scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>} : (tensor<2x8xf32>, tensor<3x1xi64>, tensor<3x8xf32>) -> tensor<2x8xf32>
    %v20 = "stablehlo.convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xf16>
    %v21 = "stablehlo.convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xbf16>
    %v22 = "stablehlo.convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xi8>
    %v23 = "stablehlo.convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xui32>
    %v24 = "stablehlo.convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xf8E4M3FN>
    %v25 = "stablehlo.convert"(%a0) : (tensor<2x8xf32>) -> tensor<2x8xf8E5M2>
    %v26 = "stablehlo.iota"() {iota_dimension = 0 : i64} : () -> tensor<4x2xi32>
    %v27 = "stablehlo.reduce"(%a0, %v4) ({
    ^bb0(%q0: tensor<f32>, %q1: tensor<f32>):
      %q2 = "stablehlo.maximum"(%q0, %q1) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%q2) : (tensor<f32>) -> ()
    }) {dimensions = array<i64: 0, 1>} : (tensor<2x8xf32>, tensor<f32>) -> tensor<f32>
    %v28 = "stablehlo.dynamic_slice"(%a0, %v2, %v2) {slice_sizes = array<i64: 2, 8>} : (tensor<2x8xf32>, tensor<i64>, tensor<i64>) -> tensor<2x8xf32>
    %v30 = "stablehlo.compare"(%v1#0, %v28) {comparison_direction = #stablehlo<comparison_direction GE>, compare_type = #stablehlo<comparison_type FLOAT>} : (tensor<2x8xf32>, tensor<2x8xf32>) -> tensor<2x8xi1>
    %v29 = "stablehlo.select"(%v30, %v28, %v10) : (tensor<2x8xi1>, tensor<2x8xf32>, tensor<2x8xf32>) -> tensor<2x8xf32>
    "func.return"(%v1#0, %v1#1, %v3#0, %v3#1, %v5, %v6#0, %v6#1, %v7, %v10, %v11, %v17, %v18, %v19, %v20, %v21, %v22, %v23, %v24, %v25, %v26, %v27, %v29) : (tensor<2x8xf32>, tensor<2x8xi32>, tensor<i64>, tensor<2x8xf32>, tensor<3x9xf32>, tensor<2xui64>, tensor<2x8xui32>, tensor<2x8xi32>, tensor<2x8xf32>, tensor<2x4xf32>, tensor<2x3xf32>, tensor<3x8xf32>, tensor<2x8xf32>, tensor<2x8xf16>, tensor<2x8xbf16>, tensor<2x8xi8>, tensor<2x8xui32>, tensor<2x8xf8E4M3FN>, tensor<2x8xf8E5M2>, tensor<4x2xi32>, tensor<f32>, tensor<2x8xf32>) -> ()
  }
}
