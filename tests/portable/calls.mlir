module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a0: tensor<2x8xf32> {tf.aliasing_output = 2 : i32}) -> (tensor<2x3xf32>, tensor<2x3xi32>, tensor<2x8xf32>) {
    %v1:2 = "stablehlo.custom_call"(%a0) {api_version = 1 : i32, call_target_name = "TopK", backend_config = "k=3"} : (tensor<2x8xf32>) -> (tensor<2x3xf32>, tensor<2x3xi32>)
    %v2 = "func.call"(%a0) {callee = @kiln_custom_softplus_ab12} : (tensor<2x8xf32>) -> tensor<2x8xf32>
    "func.return"(%v1#0, %v1#1, %v2) : (tensor<2x3xf32>, tensor<2x3xi32>, tensor<2x8xf32>) -> ()
  }
  func.func private @kiln_custom_softplus_ab12(%arg0: tensor<2x8xf32>) -> tensor<2x8xf32> {
    %0 = "stablehlo.exponential"(%arg0) : (tensor<2x8xf32>) -> tensor<2x8xf32>
    %1 = "stablehlo.log_plus_one"(%0) : (tensor<2x8xf32>) -> tensor<2x8xf32>
    "func.return"(%1) : (tensor<2x8xf32>) -> ()
  }
}
