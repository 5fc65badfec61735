//! Pipeline parallelism with PyTorch's names (`torch.distributed.pipelining`):
//! a model split into stages, each on its own device with programs of its
//! own, run over microbatches by a schedule (see Note [Pipeline stages]).

// Note [Pipeline stages]
// ~~~~~~~~~~~~~~~~~~~~~~
// kiln's other recipes are SPMD: one program, partitioned over a mesh. A
// pipeline is MPMD: each stage (a run of layers, `LlamaStage`) sits on its
// own device with programs of its own, and activations and their gradients
// move between stages, one microbatch at a time, in the order a schedule
// gives (`order.rs`: GPipe, 1F1B, interleaved 1F1B, as each rank's list of
// forward and backward actions).
// - One controller drives every stage (as one controller drives a mesh):
//   `PipelineSchedule::step` issues the actions in the order of the
//   schedule's timeline (forward cost 1, backward 2), which respects every
//   dependency, so devices that run asynchronously (PJRT) overlap as the
//   schedule intends, and the CPU runs them in that order.
// - A stage runs op by op, keeping each microbatch's autograd graph from its
//   forward to its backward (PyTorch's way), or captured: two programs made
//   by `kiln::compile` on its device (traced until two traces agree, then
//   replayed), a forward and a backward that recomputes the forward from the
//   kept input and returns the input's gradient and the parameters' gradient
//   sums (passed in and out, so the program is a pure function of its inputs
//   and the parameters). The last stage's forward runs inside its backward
//   program, with the loss. A stage drawing random numbers (dropout in
//   training) is refused captured: the recompute would draw others.
//   Each stage's programs differ from the others' (embeddings on the first,
//   the loss on the last): MPMD, not one module.
// - Every microbatch's loss counts `1 / m` (PyTorch's `scale_grads`), so a
//   step's gradients are those of the microbatches' mean loss, which is the
//   batch's mean loss when every microbatch counts as many targets.
// - Tied parameters (an output projection tied to the embeddings) are copies
//   on the stages that use them; after the backwards each copy's gradient
//   becomes their sum (Megatron-LM's embedding all-reduce), so optimizers
//   stepping each stage keep the copies equal. Clipping by the global norm
//   counts them once.
// - Activations move with `to_device`: device to device between PJRT
//   devices of the process, through the host otherwise. A pipeline launched
//   as one process per rank runs `PipelineRank`s instead, each its own
//   rank's order (Note [Pipelines across processes]).
// - Checkpoints (`checkpoint.rs`) are the unpipelined model's: the whole
//   model's weights with Hub names (a tied parameter once) and the stages'
//   optimizer states merged by parameter name, so a run resumes on another
//   number of stages or without a pipeline.
pub mod checkpoint;
pub mod llama;
pub mod order;
pub mod rank;
pub mod schedule;
pub mod stage;

pub use checkpoint::{merged_optimizer_state, restore_pipeline, save_pipeline_checkpoint};
pub use llama::{balanced_split_points, LlamaStage, PipelinePlan};
pub use order::{peak_in_flight, rank_orders, simulate, simulate_with, Action, Phase, ScheduleKind, Timeline};
pub use rank::{PipelineRank, StageTransport};
pub use schedule::{PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B};
pub use stage::{LossFn, PipelineStage, StageModule};
