//! CPU reference backend: bf16 storage, f32 accumulation, fixed reduction orders.
//!
//! Every function computes each output row with the same sequence of operations whatever
//! the number of rows, the row's position in the batch, or the number of threads.
//! (Interface fixed by the lead; bodies are filled in by the kernels work.)

pub mod attention;
pub mod elementwise;
pub mod matmul;
pub mod norm;
pub mod rope;
pub mod softmax;

pub use attention::{attention, AttnShape, ATTN_BLOCK};
pub use elementwise::{add_assign, add_row_bias, embedding, silu_mul};
pub use matmul::{plain_matmul, tree_matmul, TreeMatmul};
pub use norm::rms_norm;
pub use rope::{RopeScaling, RopeTable};
pub use softmax::{argmax, log_softmax_at, softmax};
